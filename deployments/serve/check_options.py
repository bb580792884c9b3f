"""Serve's own validation of the options the controller computed (needs Ray Serve).

The control layer merges a spec's ``deployment_config`` over the computed options without Ray;
here Serve's models check the result as they would at deploy time, at build time instead.
"""

from __future__ import annotations

import inspect
from typing import Any

from ray import serve
from ray.serve.deployment import Deployment

_INTERNAL = {"self", "func_or_class", "name", "version", "_init_args", "_init_kwargs", "_internal"}


class _OptionsProbe:
    """A stand-in deployment class: only its options are validated."""


def check_serve_options(options: dict[str, Any], overrides: dict[str, Any], where: str) -> None:
    """ValueError naming the offending option when ``overrides`` (a ``deployment_config``) holds
    an option Serve does not know, or the merged ``options`` fail Serve's validation."""
    allowed = set(inspect.signature(Deployment.options).parameters) - _INTERNAL
    unknown = sorted(set(overrides) - allowed)
    if unknown:
        raise ValueError(f"{where}: deployment_config has unknown Serve option(s) {unknown}; "
                         f"allowed: {sorted(allowed)}")
    try:  # Serve's own validation (DeploymentConfig, replica options), as at deploy time
        serve.deployment(_OptionsProbe).options(**options)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{where}: invalid Serve options after merging deployment_config: {e}") from None
