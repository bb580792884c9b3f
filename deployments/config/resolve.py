"""A deployment spec checked against the checkpoint's ``config.json`` (pure, no Ray).

:func:`resolve_deployment` runs the checks that need the model: layers exist and are MoE
layers, the TP size divides the split dimensions, the requested tail is legal (the static plan
every replica starts from), W4A4 needs MXFP4 experts; a ``ValueError`` carries the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.config import LatentMoEConfig
from moe_runtime.tp.plan import TailPlan, resolve_tail
from moe_runtime.tp.sharding import check_tp_size
from moe_runtime.units import check_dtype, format_layers

from .spec import DeploymentSpec


@dataclass(frozen=True)
class ResolvedDeployment:
    """A deployment spec checked against the checkpoint, with the tail plan its replicas run."""

    spec: DeploymentSpec
    checkpoint: str
    layers: tuple[int, ...]
    plan: TailPlan
    hidden_size: int
    num_experts: int

    def describe(self) -> str:
        return (
            f"deployment {self.spec.name!r}: TP {self.spec.tp_size}, layers {format_layers(self.layers)}, "
            f"dtype {self.spec.dtype}, tail {self.plan.describe()} ({self.plan.reason})"
        )


def resolve_deployment(spec: DeploymentSpec, checkpoint: str, cfg: LatentMoEConfig) -> ResolvedDeployment:
    """Check ``spec`` against the model config; ValueError with the arithmetic when it cannot run."""
    where = f"deployment {spec.name!r}"
    try:
        check_dtype(spec.dtype)
        if spec.layers is None:
            layers = tuple(cfg.moe_layers)
        else:
            for layer in spec.layers:
                cfg.check_moe_layer(layer)
            layers = tuple(spec.layers)
        check_tp_size(
            spec.tp_size,
            cfg.moe_intermediate_size,
            cfg.shared_intermediate_size,
            cfg.hidden_size if spec.preshard_up_proj else None,
        )
        plan = resolve_tail(spec.tail, cfg, spec.tp_size, spec.preshard_up_proj, spec.sequence_parallel)
        if spec.experts_activation_quant != "none":  # config-only checkpoints plan with "none"
            # The runtime loads torch: imported where a deployment is resolved (the builder),
            # never by a group replica, which imports this module for ResolvedDeployment.
            from moe_runtime.checkpoint import CheckpointReader
            from moe_runtime.tp.runner import check_activation_quant

            reader = CheckpointReader(checkpoint)
            check_activation_quant(spec.experts_activation_quant, cfg, spec.tp_size, reader, layers)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return ResolvedDeployment(spec, checkpoint, layers, plan, cfg.hidden_size, cfg.num_experts)


def default_max_body_bytes(resolved: list[ResolvedDeployment]) -> int:
    """Room for the largest legal request: fp32 hidden states and router logits, plus headers."""
    worst = max(r.spec.max_tokens_per_request * (r.hidden_size + r.num_experts) * 4 for r in resolved)
    return worst + (1 << 16)
