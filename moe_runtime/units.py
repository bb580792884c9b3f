"""Names and units every part shares: dtypes by name, bytes for people, layer ranges.

Units: GB is 10**9 bytes throughout (an MI300X is sold as 192 GB of HBM3).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

GB = 10**9
# Every compute dtype by its config/spec name (the name of its torch dtype), with its size in
# bytes; a deployment serves the SERVED_DTYPES subset. Names, not torch dtypes: processes that
# only check or route (the HTTP ingress, the app builder) need no torch.
DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
SERVED_DTYPES = ("float32", "bfloat16")
# The dtypes of stored and sent tensors, by the same names. safetensors' codes -> names: numpy
# holds each (bfloat16 as its bits, VIEW_AS); the float8 ones only checkpoints hold.
SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                      "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                      "BOOL": "bool"}
SAFETENSORS_FLOAT8 = {"F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
SAFETENSORS_CODES = {name: code for code, name in (SAFETENSORS_DTYPES | SAFETENSORS_FLOAT8).items()}
VIEW_AS = {"bfloat16": "int16"}  # a dtype numpy lacks -> the dtype its bits travel as (both names)
# The data plane's one-byte dtype codes: a dtype's index here. Append only (peers may be older).
WIRE_DTYPES = ("float32", "bfloat16", "float16", "float64", "int16", "int32", "int64", "uint8")
MXFP4, DENSE = "mxfp4", "dense"  # how a layer's routed experts are stored
EXPERT_FORMATS = (MXFP4, DENSE)
# The parts a rank's resident bytes are reported in (and the memory planner predicts).
PARTS = (
    "experts_packed",
    "experts_dense",
    "experts_backend",  # an experts backend's own copies in its layout (aiter: shuffled MXFP4)
    "shared_experts",
    "latent_projections",
    "up_projection",
    "router",
)
REFERENCE_BACKEND = "torch"  # the experts backend every other one is checked against
DEFAULT_SCRATCH_BYTES = 256 * 2**20  # an experts backend's decode scratch per rank, by default
# How an MXFP4 block's shared exponent follows from its largest magnitude (``mxfp4`` has the math).
SCALE_RULES = ("even", "floor")
WEIGHT_SCALE_RULE = "floor"  # checkpoint encoding (DESIGN §3: the OCP MX rule)
ACTIVATION_SCALE_RULE = "even"  # W4A4 activations: the production rule (Quark/vLLM, aiter Triton)


def check_dtype(name: str) -> str:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(DTYPES)}")
    return name


def check_scale_rule(rule: str) -> str:
    if rule not in SCALE_RULES:
        raise ValueError(f"MXFP4 scale rule {rule!r} is not one of {SCALE_RULES}")
    return rule


def check_mxfp4_scale_rule(
    rule: str, experts_activation_quant: str, routed_input_quant: str = "none"
) -> None:
    """``rule`` names a scale rule and, unless it is the default, something quantises MXFP4
    activations with it (the W4A4 experts or an MXFP4 routed input): ValueError otherwise."""
    check_scale_rule(rule)
    used = experts_activation_quant == "mxfp4" or routed_input_quant in ("mxfp4", "mxfp4-approx")
    if rule != ACTIVATION_SCALE_RULE and not used:
        raise ValueError(
            f"mxfp4_scale_rule {rule!r} would have no effect: nothing quantises MXFP4 activations "
            f"(experts_activation_quant {experts_activation_quant!r}, routed-input quantisation "
            f"{routed_input_quant!r})"
        )


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype ``name`` names: a compute dtype (ValueError for another name), or one a
    tensor file or the wire holds."""
    import torch

    return getattr(torch, name if name in SAFETENSORS_CODES else check_dtype(name))


def dtype_name(dtype: torch.dtype) -> str:
    """A torch dtype's name, as configs and the wire spell it (``torch.bfloat16`` -> "bfloat16")."""
    return str(dtype).removeprefix("torch.")


def dtype_bytes(name: str) -> int:
    return DTYPES[check_dtype(name)]


def gb(n: float) -> str:
    """Bytes for people: GB (1e9) down to MB (1e6) and kB, two decimals."""
    for unit, size in (("GB", GB), ("MB", 10**6), ("kB", 10**3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_layers(layers: Iterable[int]) -> str:
    """Compact ranges: [1, 2, 3, 7] -> "1-3,7"."""
    runs: list[list[int]] = []
    for x in sorted(layers):
        if runs and x == runs[-1][1] + 1:
            runs[-1][1] = x
        else:
            runs.append([x, x])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
