"""App builder: ``serve run deployments.app:build_app checkpoint=DIR tp_size=2 tail=sharded``
or ``serve run deployments/configs/local.yaml``. ``DIR`` is a latent-MoE checkpoint or a Qwen3-MoE /
DeepSeek-V3 model folder (``moe_runtime.families`` tells them apart). ``LMS_HTTP_PORT=PORT serve run
deployments.app:build_app ...`` serves HTTP on PORT (``serve run`` of an import path has no option
for it; a config file's ``http_options`` does).

Layers: arguments (``deployments.config``) -> the controller's decisions, each concept decided
once (``deployments.control``, pure) on the cluster the app will run on (``deployments.cluster``)
-> Serve deployments (``deployments.serve``). Every check that can fail before a replica starts
(bad field, layer, TP size, illegal tail, memory, autoscaling bounds, cluster capacity,
resources no node of the Ray cluster can provide, Serve options) raises ``ValueError`` here, at
build time, with the arithmetic.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ray.serve import Application

from moe_runtime.families import load_layer_config

from . import logger
from .common.layer_routing import LayerRoutes
from .config.resolve import ResolvedDeployment, default_max_body_bytes
from .config.spec import AppArgs
from .config.timeouts import request_bound
from .control.capacity import check_placeable
from .control.cluster_view import ClusterView
from .control.decide import Decision, decide
from .control.serve_options import ingress_options
from .serve.check_options import check_serve_options

HTTP_PORT_ENV = "LMS_HTTP_PORT"  # the HTTP port of the Serve instance build_app starts


def decide_app(
    args: AppArgs | dict[str, Any], view: ClusterView | None = None
) -> tuple[AppArgs, list[ResolvedDeployment], list[Decision]]:
    """Validated arguments, resolved deployments and the controller's decision for each, in the
    order of ``args.deployments``, their Serve options validated by Serve. No Ray cluster is
    needed. ``view``: the cluster to place on (None: the MI300X layout is assumed and placement
    is not checked)."""
    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    checkpoint = str(Path(args.checkpoint).expanduser().resolve())
    cfg = load_layer_config(checkpoint)
    decisions = decide(args.deployments, cfg, checkpoint=checkpoint, view=view)
    ordered = [decisions[spec.name] for spec in args.deployments]
    check_placeable(args, view, {d.deployment: d.accelerator for d in ordered})
    for d in ordered:
        check_serve_options(d.options, d.spec.deployment_config, f"deployment {d.deployment!r}")
    return args, [d.resolved for d in ordered], ordered


def app_options(
    args: AppArgs | dict[str, Any], view: ClusterView | None = None
) -> tuple[AppArgs, list[ResolvedDeployment], list[dict[str, Any]]]:
    """Validated arguments, resolved deployments and their Serve options."""
    args, resolved, decisions = decide_app(args, view)
    return args, resolved, [d.options for d in decisions]


def build_app(args: AppArgs) -> Application:
    """The Serve application: an ingress in front of one TP-group deployment per spec.

    Serve converts the ``args`` dict of ``serve run`` / a config file into :class:`AppArgs`
    (the annotation); a plain dict works too when called from Python.
    """
    from .cluster.live_view import current_cluster_view, launcher_files
    from .serve.deployment import MoEGroup
    from .serve.http import Ingress

    args = args if isinstance(args, AppArgs) else AppArgs.model_validate(args)
    view = current_cluster_view(launcher_files(args.deployments))
    if port := os.environ.get(HTTP_PORT_ENV):
        start_serve(port)
    args, resolved, decisions = decide_app(args, view)  # the controller logs each decision once
    groups = {}
    for decision in decisions:
        # Option names only, at DEBUG: the merged options can carry runtime_env variables (secrets).
        logger.debug("building deployment %r; options %s", decision.deployment, sorted(decision.options))
        groups[decision.deployment] = MoEGroup.options(**decision.options).bind(decision)
    max_body = args.http_max_body_bytes or default_max_body_bytes(resolved)
    timeout = request_bound(args.request_timeout_s, [r.spec for r in resolved])
    routes = LayerRoutes({r.spec.name: r.layers for r in resolved}, args.default_deployment)
    return Ingress.options(**ingress_options(args.ingress_cpus, args.ingress_replicas)).bind(
        groups, routes, max_body, timeout, args.http_token_env, args.http_token_required
    )


def start_serve(port: str) -> None:
    """Start Serve with its HTTP proxy on ``port`` (``serve run`` then uses that instance). A
    Serve that is already running keeps its port: Serve logs that the new one is not applied."""
    from ray import serve

    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{HTTP_PORT_ENV}={port!r} is not a TCP port (1-65535)")
    serve.start(http_options={"port": int(port)})
