"""A deployment spec checked against the checkpoint's ``config.json`` (pure, no Ray).

:func:`resolve_deployment` runs the checks that need the model: layers exist and are MoE
layers, the TP size divides the split dimensions, the requested tail is legal (the static plan
every replica starts from), W4A4 needs MXFP4 experts; a ``ValueError`` carries the arithmetic.
A standard (Qwen3-MoE, DeepSeek-V3) model folder has one fixed plan (``tp.plan.standard_plan``):
a spec that forces a latent-only option for it is refused, naming the option.
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_runtime.families import LATENT_MOE, LayerConfig, family_name, is_standard
from moe_runtime.tp.plan import TailPlan, resolve_tail, standard_plan
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
    family: str = LATENT_MOE  # the layers' family (moe_runtime.families): latent_moe, qwen3_moe, deepseek_v3

    def describe(self) -> str:
        return (
            f"deployment {self.spec.name!r}: TP {self.spec.tp_size}, layers {format_layers(self.layers)}, "
            f"dtype {self.spec.dtype}, tail {self.plan.describe()} ({self.plan.reason})"
        )


def latent_only_options(spec: DeploymentSpec) -> list[str]:
    """The options ``spec`` sets that only the latent layer has: its tails, sequence parallelism,
    a pre-sharded up-projection, activation (and so routed-input) quantisation, MXFP4 experts."""
    forced = {
        "tail": spec.tail != "auto",
        "sequence_parallel": spec.sequence_parallel,
        "preshard_up_proj": spec.preshard_up_proj,
        "experts_activation_quant": spec.experts_activation_quant != "none",
        "experts_format": spec.experts_format == "mxfp4",
    }
    return [f"{name}={getattr(spec, name)!r}" for name, on in forced.items() if on]


def resolve_deployment(spec: DeploymentSpec, checkpoint: str, cfg: LayerConfig) -> ResolvedDeployment:
    """Check ``spec`` against the model config; ValueError with the arithmetic when it cannot run."""
    where = f"deployment {spec.name!r}"
    try:
        if is_standard(cfg) and (forced := latent_only_options(spec)):
            raise ValueError(
                f"{', '.join(forced)}: latent-MoE only; {checkpoint} is a {cfg.family} model folder, whose "
                "MoE layers run one fixed plan (one all-reduce per forward): leave tail auto and drop the "
                "latent-only options"
            )
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
        if is_standard(cfg):
            plan = standard_plan(cfg.family, spec.tp_size)
        else:
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
    return ResolvedDeployment(spec, checkpoint, layers, plan, cfg.hidden_size, cfg.num_experts,
                              family_name(cfg))


def default_max_body_bytes(resolved: list[ResolvedDeployment]) -> int:
    """Room for the largest legal request: fp32 hidden states and router logits, plus headers."""
    worst = max(r.spec.max_tokens_per_request * (r.hidden_size + r.num_experts) * 4 for r in resolved)
    return worst + (1 << 16)
