"""App builder: ``serve run deployments.app:build_app checkpoint=DIR tp_size=2 tail=sharded``
or ``serve run deployments/configs/local.yaml``.

Layers: arguments (:mod:`deployments.spec`) -> options (:mod:`deployments.options`, pure) ->
deployments (:mod:`deployments.deployment`, :mod:`deployments.http`). Every check that can
fail before a replica starts (bad field, layer, TP size, illegal tail, autoscaling bounds)
raises ``ValueError`` here, at build time.
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application

from . import logger
from .deployment import MoEGroup
from .http import Ingress
from .options import deployment_options, ingress_options
from .spec import AppArgs, ResolvedDeployment, default_max_body_bytes, resolve_app


def plan_app(
    args: AppArgs | dict[str, Any],
) -> tuple[AppArgs, list[ResolvedDeployment], list[dict[str, Any]]]:
    """Validated arguments, resolved deployments and their Serve options; no Ray needed."""
    args, resolved = resolve_app(args)
    options = [deployment_options(r.spec) for r in resolved]
    return args, resolved, options


def build_app(args: AppArgs) -> Application:
    """The Serve application: an ingress in front of one TP-group deployment per spec.

    Serve converts the ``args`` dict of ``serve run`` / a config file into :class:`AppArgs`
    (the annotation); a plain dict works too when called from Python.
    """
    args, resolved, options = plan_app(args)
    groups = {}
    for r, opts in zip(resolved, options, strict=True):
        logger.info("building %s; options %s", r.describe(), opts)
        groups[r.spec.name] = MoEGroup.options(**opts).bind(r)
    max_body = args.http_max_body_bytes or default_max_body_bytes(resolved)
    timeout = args.request_timeout_s or max(r.spec.call_timeout_s for r in resolved) + 30.0
    layers = {r.spec.name: list(r.layers) for r in resolved}
    return Ingress.options(**ingress_options(args.ingress_cpus)).bind(
        groups, layers, args.default_deployment, max_body, timeout
    )
