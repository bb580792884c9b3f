"""The ``vllm`` experts backend: vLLM's fused MoE kernels (Triton; MXFP4 through its w4a16 config).

Optional: vLLM is imported only when this backend is asked whether it can run or is built, and
never by CI; ``vllm_unavailable_reason`` says why it cannot (no CUDA GPU, no vLLM, or a vLLM
without ``fused_experts``). It is not in ``auto``'s preference: a deployment names it
(``backend: vllm``), and like every backend it serves only after its load-time probe against
the ``torch`` reference (``experts.check``) passes.

Shapes: the latent layer's experts are ``w13 [E, 2I, D]`` (gate rows, then up rows) and
``w2 [E, D, I]`` on the latent width D, the layout vLLM's ``fused_experts`` takes for
``hidden_states [T, D]``, ``topk_ids``/``topk_weights [T, K]``; packed experts are passed as
their nibbles (``[E, 2I, D/2]``, ``[E, D, I/2]``) with E8M0 scales through
``mxfp4_w4a16_moe_quant_config``. vLLM weights and sums the K slots itself.

Activation: vLLM's fused MoE kernels apply their own gated activations (``MoEActivation``:
silu, gelu, ...). A layer's activation runs here only if vLLM names it: plain SiLU as
``silu``; SiTU (beta, beta_lin) only where the installed vLLM lists a ``situ`` activation
taking both betas. Otherwise the call raises a ValueError with vLLM's list, and the load-time
probe refuses the backend with that reason (an explicit request fails the load).
"""

from __future__ import annotations

import functools
import importlib
import inspect

import torch

from ..activation import GatedActivation
from ..weights import ExpertWeights
from .base import DEFAULT_SCRATCH_BYTES, check_scratch_bytes, register_backend

FUSED_MOE = "vllm.model_executor.layers.fused_moe"
VLLM_DTYPES = (torch.bfloat16, torch.float16)


def _module(name: str):
    return importlib.import_module(name)


@functools.cache
def vllm_unavailable_reason() -> str | None:
    """None when this process can call vLLM's fused MoE on a CUDA GPU, else why not."""
    if not torch.cuda.is_available() or torch.version.hip is not None:
        return "the vllm experts backend needs a CUDA GPU (ROCm runs aiter's fused MoE)"
    try:
        fused = _module(FUSED_MOE)
    except Exception as exc:  # ImportError, or a vLLM build that fails to import here
        return f"vLLM's fused MoE is not importable: {type(exc).__name__}: {exc}"
    if not callable(getattr(fused, "fused_experts", None)):
        return f"{FUSED_MOE} has no fused_experts in this vLLM"
    return None


def vllm_activations() -> list[str]:
    """The gated activations the installed vLLM's fused MoE names (empty when it lists none)."""
    try:
        enum = _module(f"{FUSED_MOE}.activation").MoEActivation
    except (ImportError, AttributeError):
        return ["silu"]  # vLLMs before the enum took the activation as a string, silu the default
    return [m.value for m in enum if not m.value.endswith("_no_mul")]


def activation_name(act: GatedActivation, available: list[str]) -> str:
    """vLLM's name for ``act``, or a ValueError naming what vLLM offers."""
    if act.beta is None:
        if "silu" in available:
            return "silu"
    elif "situ" in available:
        return "situ"
    what = "SiLU" if act.beta is None else f"SiTU (beta {act.beta}, beta_lin {act.beta_lin})"
    raise ValueError(f"vLLM's fused MoE activations are {available}; the layer's {what} is not among them, "
                     "so the vllm experts backend cannot run this layer")


def expert_args(experts: ExpertWeights) -> dict:
    """What ``fused_experts`` takes for these experts: the weights, and for MXFP4 their quant config."""
    if not experts.packed:
        return {"w1": experts.w13, "w2": experts.w2}
    config = _module(f"{FUSED_MOE}.config").mxfp4_w4a16_moe_quant_config
    return {"w1": experts.w13, "w2": experts.w2,
            "quant_config": config(w1_scale=experts.w13_scale, w2_scale=experts.w2_scale)}


@register_backend("vllm", unavailable=vllm_unavailable_reason, compute=("gpu",))
class VllmExperts:
    name = "vllm"

    def __init__(self, scratch_bytes: int = DEFAULT_SCRATCH_BYTES) -> None:
        reason = vllm_unavailable_reason()
        if reason is not None:
            raise ValueError(reason)
        self.scratch_bytes = check_scratch_bytes(scratch_bytes)  # vLLM sizes its own workspace

    def __call__(self, h_TD, ids_TK, weights_TK, experts: ExpertWeights, act: GatedActivation,
                 act_quant=None) -> torch.Tensor:
        if act_quant is not None:
            raise ValueError("the vllm experts backend has no MXFP4 activation fake-quant (W4A4): use torch")
        if h_TD.dtype not in VLLM_DTYPES or h_TD.dtype != experts.dtype:
            raise ValueError(f"the vllm experts backend runs {[str(d) for d in VLLM_DTYPES]} with the input "
                             f"in the experts' dtype; got input {h_TD.dtype}, experts {experts.dtype}")
        fused_experts = _module(FUSED_MOE).fused_experts
        kwargs = {**expert_args(experts), "activation": activation_name(act, vllm_activations())}
        if act.beta is not None:
            kwargs.update(beta=act.beta, beta_lin=act.beta_lin)
        params = inspect.signature(fused_experts).parameters
        unknown = sorted(k for k in kwargs if k not in params)
        if unknown:
            raise ValueError(f"this vLLM's fused_experts takes no {unknown}: it cannot run these experts")
        if "MoEActivation" in str(params["activation"].annotation):  # vLLMs that take the enum, not its name
            kwargs["activation"] = _module(f"{FUSED_MOE}.activation").MoEActivation(kwargs["activation"])
        out = fused_experts(h_TD, topk_weights=weights_TK.float(), topk_ids=ids_TK.to(torch.int32), **kwargs)
        return out.float()
