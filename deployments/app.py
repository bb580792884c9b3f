"""App builder: ``serve run deployments.app:build_app checkpoint=DIR tp_size=2 tail=sharded``
or ``serve run deployments/configs/local.yaml``.

Layers: arguments (:mod:`deployments.spec`) -> the controller's decisions (tail plan and Serve
options per deployment, :mod:`deployments.controller`, pure) -> deployments
(:mod:`deployments.deployment`, :mod:`deployments.http`). Every check that can fail before a
replica starts (bad field, layer, TP size, illegal tail, autoscaling bounds, cluster capacity,
resources no node of the Ray cluster can provide) raises ``ValueError`` here, at build time, as
does a deployment whose layers do not fit its devices' memory (``moe_runtime.memory``, with the
arithmetic). ``build_app`` also resolves each deployment's ``accelerator`` (``auto`` -> gpu or
cpu) on the Ray cluster it is about to run on (:mod:`deployments.placement`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ray.serve import Application

from moe_runtime.config import LatentMoEConfig

from . import logger
from .controller import Decision, decide
from .deployment import MoEGroup
from .http import Ingress
from .options import ingress_options
from .placement import ClusterView, current_cluster_view, launcher_configs, place_app
from .spec import AppArgs, ResolvedDeployment, default_max_body_bytes, resolve_app


def decide_app(
    args: AppArgs | dict[str, Any], cluster: ClusterView | None = None
) -> tuple[AppArgs, list[ResolvedDeployment], list[Decision]]:
    """Validated arguments, resolved deployments and the controller's decision for each.

    ``cluster``: the Ray cluster to place on; each ``accelerator`` is resolved on it and the
    app refused when it cannot be placed. None (pure use, no Ray): ``auto`` keeps the GPU layout.
    """
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    reasons: dict[str, str] = {}
    if cluster is not None:
        args, reasons = place_app(args, cluster)
    args, resolved = resolve_app(args)
    checkpoint = resolved[0].checkpoint
    decisions = decide(args.deployments, LatentMoEConfig.from_pretrained(checkpoint), checkpoint=checkpoint)
    ordered = [
        replace(decisions[r.spec.name], accelerator_reason=reasons.get(r.spec.name)) for r in resolved
    ]
    # The replicas read the startup bound from their spec: the set or derived one.
    resolved = [
        replace(r, spec=r.spec.model_copy(update={"startup_timeout_s": d.startup_timeout_s}))
        for r, d in zip(resolved, ordered, strict=True)
    ]
    return args, resolved, ordered


def plan_app(
    args: AppArgs | dict[str, Any],
) -> tuple[AppArgs, list[ResolvedDeployment], list[dict[str, Any]]]:
    """Validated arguments, resolved deployments and their Serve options; no Ray needed."""
    args, resolved, decisions = decide_app(args)
    return args, resolved, [d.options for d in decisions]


def build_app(args: AppArgs) -> Application:
    """The Serve application: an ingress in front of one TP-group deployment per spec.

    Serve converts the ``args`` dict of ``serve run`` / a config file into :class:`AppArgs`
    (the annotation); a plain dict works too when called from Python.
    """
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    cluster = current_cluster_view(launcher_configs(args.deployments))
    args, resolved, decisions = decide_app(args, cluster)  # the controller logs each decision once
    groups = {}
    for r, decision in zip(resolved, decisions, strict=True):
        logger.info("building deployment %r; options %s", r.spec.name, decision.options)
        groups[r.spec.name] = MoEGroup.options(**decision.options).bind(r, decision)
    max_body = args.http_max_body_bytes or default_max_body_bytes(resolved)
    timeout = args.request_timeout_s or max(r.spec.call_timeout_s for r in resolved) + 30.0
    layers = {r.spec.name: list(r.layers) for r in resolved}
    return Ingress.options(**ingress_options(args.ingress_cpus, args.ingress_replicas)).bind(
        groups, layers, args.default_deployment, max_body, timeout
    )
