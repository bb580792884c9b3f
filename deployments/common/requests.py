"""One check of a forward's input, shared by the Serve path (the replica) and the lane (every
rank of the leased group, which sees the same input and so reaches the same verdict before any
collective). Input kinds and conversions are described in ``deployments.serve.deployment``.

Pure: no Ray import.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import numpy as np
import torch

from moe_runtime.config import LatentMoEConfig
from moe_runtime.layer import check_input

from .errors import ServeInputError, TooLargeError, UnknownLayerError
from .wire import WireTensor


def to_tensor(value: Any, what: str, dtype: torch.dtype | None) -> torch.Tensor:
    """numpy -> torch per the module's rules; ``dtype`` None: any float (router logits)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, WireTensor):
        return value.to_torch()
    if isinstance(value, np.ndarray):
        if dtype is None:
            if value.dtype.kind != "f":
                raise ServeInputError(f"{what} must be floating point, got numpy {value.dtype}")
            return torch.from_numpy(np.array(value, dtype=np.float32, copy=True))
        if value.dtype != np.float32:
            raise ServeInputError(
                f"numpy {what} must be float32 (numpy has no bfloat16; a bfloat16 deployment "
                f"rounds float32 input), got {value.dtype}"
            )
        # Ray hands over read-only arrays; torch wants a writable buffer.
        return torch.from_numpy(np.array(value, copy=True)).to(dtype)
    raise ServeInputError(f"{what} must be a numpy array or a torch tensor, got {type(value).__name__}")


def check_layer(layer: Any, cfg: LatentMoEConfig, served: Collection[int], deployment: str) -> int:
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
    hidden_states: Any, layer: Any, router_logits: Any, *, cfg: LatentMoEConfig, dtype: torch.dtype,
    served: Collection[int], deployment: str, max_tokens: int,
) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """``(layer, x [T, H] in dtype on CPU, fp32 logits or None)``; ServeInputError (4xx) naming
    what is wrong otherwise."""
    layer = check_layer(layer, cfg, served, deployment)
    x = to_tensor(hidden_states, "hidden_states", dtype)
    logits = None if router_logits is None else to_tensor(router_logits, "router_logits", None)
    if x.dim() == 2 and x.shape[0] > max_tokens:
        raise TooLargeError(
            f"hidden_states has {x.shape[0]} tokens, more than max_tokens_per_request = {max_tokens} "
            f"of deployment {deployment!r}; split the request"
        )
    try:
        check_input(x, cfg, dtype, logits, max_tokens=max_tokens)
    except ValueError as e:
        raise ServeInputError(str(e)) from None
    if x.device.type != "cpu":
        x = x.cpu()
    if logits is not None:
        logits = logits.float().cpu()
    return layer, x, logits
