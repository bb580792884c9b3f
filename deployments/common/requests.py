"""One check of a forward's input, shared by the Serve path (the replica) and sessions (every
rank of the session's group, which sees the same input and so reaches the same verdict before any
collective). Input kinds and conversions are described in ``deployments.serve.deployment``.

Pure and numpy only: no Ray, no torch (the group replica checks and batches rows without
loading torch; a torch tensor that comes in has loaded it already, and is read as its bits).
"""

from __future__ import annotations

import sys
from collections.abc import Collection
from typing import Any

import numpy as np

from moe_runtime.families import LayerConfig
from moe_runtime.inputs import logits_shape_problem, not_finite, not_floating, rows_problem, wrong_dtype
from moe_runtime.units import dtype_name, torch_dtype

from .errors import ServeInputError, TooLargeError, UnknownLayerError
from .wire import FLOAT_DTYPES, DeviceRows, WireTensor


def is_torch_tensor(value: Any) -> bool:
    torch = sys.modules.get("torch")  # a tensor's class lives there: loaded if one came in
    return torch is not None and isinstance(value, torch.Tensor)


def as_rows(value: Any, what: str, dtype: str, on_device: bool = False) -> WireTensor | DeviceRows:
    """``value`` as a :class:`WireTensor`: a numpy float32 array rounded to ``dtype``; a torch
    tensor in ``dtype`` over its bits (copied to the CPU; ``on_device``: kept where it is, as
    :class:`DeviceRows`); a WireTensor as it is (:func:`check_rows` then checks its dtype)."""
    if isinstance(value, WireTensor | DeviceRows):
        return value
    if is_torch_tensor(value):
        if value.dtype is not torch_dtype(dtype):  # numpy may not hold it either
            raise ServeInputError(wrong_dtype(what, dtype_name(value.dtype), dtype))
        return DeviceRows(value.detach().contiguous(), dtype) if on_device else WireTensor.from_torch(value)
    if isinstance(value, np.ndarray):
        if value.dtype != np.float32:
            raise ServeInputError(
                f"numpy {what} must be float32 (numpy has no bfloat16; a bfloat16 deployment "
                f"rounds float32 input), got {value.dtype}"
            )
        return WireTensor.from_float32(value, dtype)
    raise ServeInputError(f"{what} must be a numpy array or a torch tensor, got {type(value).__name__}")


def as_logits(value: Any) -> np.ndarray:
    """Router logits of any floating dtype as float32 (the router works in fp32)."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind != "f":
            raise ServeInputError(not_floating("router_logits", f"numpy {value.dtype}"))
        return value.astype(np.float32, order="C")
    if is_torch_tensor(value):
        if not value.is_floating_point():
            raise ServeInputError(not_floating("router_logits", str(value.dtype)))
        return WireTensor.from_torch(value.float()).array
    wire = as_rows(value, "router_logits", "float32")
    if wire.dtype not in FLOAT_DTYPES:
        raise ServeInputError(not_floating("router_logits", f"torch.{wire.dtype}"))
    return wire.float32()


def check_layout(x: WireTensor, hidden_size: int, dtype: str, what: str = "hidden_states") -> None:
    """ServeInputError unless ``x`` is ``[T, hidden_size]`` in ``dtype`` (any T)."""
    problem = rows_problem(x.shape, x.dtype, dtype, hidden_size, allow_empty=True, what=what)
    if problem is not None:
        raise ServeInputError(problem)


def check_rows(x: WireTensor, hidden_size: int, dtype: str, max_tokens: int | None = None,
               what: str = "hidden_states") -> None:
    """ServeInputError naming what is wrong with ``[T, H]`` rows in ``dtype``: the rules of
    ``moe_runtime.inputs``, as ``moe_runtime.layer.check_hidden`` applies them to tensors."""
    problem = rows_problem(x.shape, x.dtype, dtype, hidden_size, max_tokens, what=what)
    if problem is not None:
        raise ServeInputError(problem)
    if not x.all_finite():
        raise ServeInputError(not_finite(what))


def check_layer(layer: Any, cfg: LayerConfig, served: Collection[int], deployment: str) -> int:
    """``layer`` as an int, if it is an MoE layer that ``deployment`` serves."""
    if isinstance(layer, bool) or not isinstance(layer, int | np.integer):
        raise UnknownLayerError(f"layer must be an integer, got {layer!r}")
    layer = int(layer)
    try:
        cfg.check_moe_layer(layer)
    except ValueError as e:
        raise UnknownLayerError(str(e)) from None
    if layer not in served:
        raise UnknownLayerError(
            f"layer {layer} is not served by deployment {deployment!r} (it serves layers {sorted(served)})"
        )
    return layer


def validate_forward(
    hidden_states: Any, layer: Any, router_logits: Any, *, cfg: LayerConfig, dtype: str,
    served: Collection[int], deployment: str, max_tokens: int,
) -> tuple[int, WireTensor, np.ndarray | None]:
    """``(layer, x [T, H] in dtype, fp32 logits or None)``; ServeInputError (4xx) naming what
    is wrong otherwise."""
    layer = check_layer(layer, cfg, served, deployment)
    x = as_rows(hidden_states, "hidden_states", dtype)
    logits = None if router_logits is None else as_logits(router_logits)
    if len(x.shape) == 2 and x.shape[0] > max_tokens:
        raise TooLargeError(
            f"hidden_states has {x.shape[0]} tokens, more than max_tokens_per_request = {max_tokens} "
            f"of deployment {deployment!r}; split the request"
        )
    check_rows(x, cfg.hidden_size, dtype, max_tokens)
    if logits is not None:
        problem = logits_shape_problem(logits.shape, x.shape[0], cfg.num_experts)
        if problem is not None:
            raise ServeInputError(problem)
        if not np.isfinite(logits).all():
            raise ServeInputError(not_finite("router_logits"))
    return layer, x, logits
