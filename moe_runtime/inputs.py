"""What a layer's input must be: the rules and their words, once, for torch tensors (the runtime,
``layer.check_input``) and for numpy rows (the serving tier, ``deployments.common.requests``).
Shapes and dtype names in, the first thing wrong out; no torch, so that processes which only
check rows need none.
"""

from __future__ import annotations

from collections.abc import Sequence


def wrong_dtype(what: str, got: str, want: str) -> str:
    """``got`` and ``want`` are torch dtype names without the ``torch.`` prefix."""
    return f"{what} dtype is torch.{got}, this layer runs in torch.{want}"


def not_finite(what: str) -> str:
    return f"{what} contains NaN or Inf"


def not_floating(what: str, got: str) -> str:
    """``got``: the dtype as the caller holds it (``torch.int64``, ``numpy int64``)."""
    return f"{what} must be floating point, got {got}"


def rows_problem(shape: Sequence[int], dtype: str, want: str, hidden_size: int, max_tokens: int | None = None,
                 allow_empty: bool = False, what: str = "hidden_states") -> str | None:
    """What is wrong with ``[T, H]`` rows of ``shape`` in ``dtype`` for a layer of ``hidden_size``
    running in ``want`` (``T == 0`` only with ``allow_empty``), apart from their values; None if
    nothing is."""
    H, shape = hidden_size, list(shape)
    if len(shape) != 2 or shape[1] != H:
        return f"{what} must have shape [T, {H}], got {shape}"
    if dtype != want:
        return wrong_dtype(what, dtype, want)
    T = shape[0]
    if T == 0 and not allow_empty:
        return f"{what} has no tokens (T == 0)"
    if max_tokens is not None and T > max_tokens:
        return f"{what} has {T} tokens, more than the limit of {max_tokens}"
    return None


def logits_shape_problem(shape: Sequence[int], tokens: int, num_experts: int) -> str | None:
    """Router logits must be ``[T, E]`` (T of hidden_states); None if they are."""
    if tuple(shape) != (tokens, num_experts):
        return (f"router_logits must have shape [{tokens}, {num_experts}] (T of hidden_states, num_experts), "
                f"got {list(shape)}")
    return None
