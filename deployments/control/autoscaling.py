"""Token-aware Serve autoscaling (DESIGN §5.5).

MoE requests differ by orders of magnitude in token count, so request counts are a poor
load signal. Replicas report tokens instead, and the policy sizes the deployment from them.

The Ray Serve 2.60 contract this module is written against (ray/serve/config.py,
ray/serve/autoscaling_policy.py, ray/serve/_private/autoscaling_state.py, replica.py):

* ``AutoscalingConfig.policy = AutoscalingPolicy(policy_function="module:attr",
  policy_kwargs={...})``. A class is instantiated once with ``**policy_kwargs`` and the
  instance is called every control-loop tick; a plain function is called as is.
* Call: ``policy(ctx: AutoscalingContext) -> (target_num_replicas, policy_state: dict)``;
  a float target is rounded up. ``ctx.policy_state`` is the state returned last tick.
* Replica metrics: a deployment method ``record_autoscaling_stats()`` (sync or async,
  10 s timeout) returns ``Dict[str, int | float]``; the controller exposes it as
  ``ctx.aggregated_metrics[name][replica_id]`` (aggregated over ``look_back_period_s`` with
  ``aggregation_function``) and the raw time series as ``ctx.raw_metrics``.
* Ray wraps every custom policy: it applies upscaling/downscaling factors, then its own
  ``upscale_delay_s``/``downscale_delay_s`` on top of the policy's target, then clamps to
  ``ctx.capacity_adjusted_min_replicas``/``max_replicas``. This policy applies its own
  delays, so :func:`build_autoscaling_config` sets Ray's to 0 — otherwise they would add up.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ray.serve.config import AutoscalingContext

# Keys of the dict a replica's record_autoscaling_stats() returns.
QUEUED_TOKENS = "queued_tokens"  # tokens waiting in the replica's batch queue
TOKENS_PER_S = "tokens_per_s"  # tokens the replica processed per second, recently (sessions' rows too)
OPEN_SESSIONS = "open_sessions"  # sessions open on the replica's group

POLICY_IMPORT_PATH = "deployments.control.autoscaling:TokenAutoscalingPolicy"

# Our keys in the policy state (Ray keeps its own delay counters in the same dict).
_UP_SINCE = "token_upscale_since"
_DOWN_SINCE = "token_downscale_since"


@dataclass(frozen=True)
class TokenScalingParams:
    """Targets per replica and how long a change of demand must last before acting on it.

    ``target_queued_tokens_per_replica``: backlog one replica should carry; the burst signal.
    ``target_tokens_per_s_per_replica``: steady throughput one replica should sustain (set it
    below the measured peak to keep headroom); None ignores throughput until it is measured.
    ``upscale_delay_s``: demand must exceed the current size this long (0 = at once).
    ``downscale_delay_s``: demand must stay below the current size this long, without a break.
    Replica bounds are not here: they come from the context's capacity-adjusted bounds.
    """

    target_queued_tokens_per_replica: float = 8192.0
    target_tokens_per_s_per_replica: float | None = None
    upscale_delay_s: float = 0.0
    downscale_delay_s: float = 300.0

    def __post_init__(self) -> None:
        targets = {"target_queued_tokens_per_replica": self.target_queued_tokens_per_replica}
        if self.target_tokens_per_s_per_replica is not None:
            targets["target_tokens_per_s_per_replica"] = self.target_tokens_per_s_per_replica
        for name, value in targets.items():
            if not _is_number(value) or not value > 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        for name in ("upscale_delay_s", "downscale_delay_s"):
            value = getattr(self, name)
            if not _is_number(value) or not value >= 0 or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _tokens(metric: Mapping[str, float], key: str) -> float:
    # A replica may omit a key or report garbage; neither should stop the control loop.
    value = metric.get(key, 0.0)
    return max(0.0, float(value)) if _is_number(value) and math.isfinite(value) else 0.0


def desired_replicas(
    metrics: Sequence[Mapping[str, float]],
    current: int,
    min_replicas: int,
    max_replicas: int,
    params: TokenScalingParams,
    state: Mapping[str, Any],
    now: float,
) -> tuple[int, dict[str, Any]]:
    """Target replica count from per-replica token metrics; returns ``(target, new_state)``.

    Demand = max(ceil(sum queued / target queued per replica),
                 ceil(sum tokens/s / target tokens/s per replica),
                 replicas with open sessions), clamped to [min_replicas, max_replicas]:
    a deployment busy with sessions scales out on their rows (tokens/s counts them), and a
    scale-down never goes below the replicas that hold open sessions. No metrics: hold
    ``current``. Demand above ``current`` for ``upscale_delay_s``: scale up to it. Demand below
    ``current`` continuously for ``downscale_delay_s``: scale down to it. ``state`` is not modified.
    """
    if min_replicas < 0 or max_replicas < min_replicas:
        raise ValueError(
            f"need 0 <= min_replicas <= max_replicas, got min {min_replicas}, max {max_replicas}"
        )
    new_state = dict(state)
    hold = min(max(current, min_replicas), max_replicas)
    if not metrics:
        # Demand is unknown (no replica has reported yet): change nothing, forget any trend.
        new_state[_UP_SINCE] = new_state[_DOWN_SINCE] = None
        return hold, new_state

    queued = sum(_tokens(m, QUEUED_TOKENS) for m in metrics)
    demand = math.ceil(queued / params.target_queued_tokens_per_replica)
    if params.target_tokens_per_s_per_replica is not None:
        rate = sum(_tokens(m, TOKENS_PER_S) for m in metrics)
        demand = max(demand, math.ceil(rate / params.target_tokens_per_s_per_replica))
    demand = max(demand, sum(_tokens(m, OPEN_SESSIONS) > 0 for m in metrics))
    wanted = min(max(demand, min_replicas), max_replicas)

    if wanted == hold:
        new_state[_UP_SINCE] = new_state[_DOWN_SINCE] = None
        return hold, new_state
    # The timer of the direction demand moves in starts (or keeps running); the other resets.
    key, other, delay = (
        (_UP_SINCE, _DOWN_SINCE, params.upscale_delay_s)
        if wanted > hold
        else (_DOWN_SINCE, _UP_SINCE, params.downscale_delay_s)
    )
    since = state.get(key)
    since = now if since is None else since
    new_state[other] = None
    if now - since >= delay:
        new_state[key] = None  # acted on: the next change waits a full delay again
        return wanted, new_state
    new_state[key] = since
    return hold, new_state


def replica_metrics(ctx: AutoscalingContext) -> list[dict[str, float]]:
    """Per-replica ``{queued_tokens, tokens_per_s, open_sessions}`` from the context's aggregated
    metrics."""
    aggregated = ctx.aggregated_metrics or {}
    by_key = {key: aggregated.get(key, {}) for key in (QUEUED_TOKENS, TOKENS_PER_S, OPEN_SESSIONS)}
    replicas = dict.fromkeys(r for values in by_key.values() for r in values)  # union, in a stable order
    return [{key: values.get(r, 0.0) for key, values in by_key.items()} for r in replicas]


def token_autoscaling_policy(
    ctx: AutoscalingContext, params: TokenScalingParams | None = None
) -> tuple[int, dict[str, Any]]:
    """Ray Serve policy function: :func:`desired_replicas` on an ``AutoscalingContext``.

    Usable directly as ``policy_function="deployments.control.autoscaling:token_autoscaling_policy"``
    (default params); :class:`TokenAutoscalingPolicy` takes tuned params via policy_kwargs.
    """
    params = params or TokenScalingParams()
    now = ctx.current_time if ctx.current_time is not None else time.time()
    low = ctx.capacity_adjusted_min_replicas
    # Ray lets the lower bound win when target_capacity pushes it above the upper one.
    high = max(ctx.capacity_adjusted_max_replicas, low)
    # The autoscaler's current target, not the running count: replicas still starting
    # must not read as a reason to scale down.
    return desired_replicas(
        replica_metrics(ctx), ctx.target_num_replicas, low, high, params, ctx.policy_state or {}, now
    )


class TokenAutoscalingPolicy:
    """Class form for ``policy_kwargs``: Ray builds it once with the kwargs, then calls it."""

    def __init__(self, **params: Any) -> None:
        try:
            self.params = TokenScalingParams(**params)
        except TypeError as e:  # unknown keyword
            raise ValueError(f"bad TokenAutoscalingPolicy policy_kwargs {params}: {e}") from None

    def __call__(self, ctx: AutoscalingContext) -> tuple[int, dict[str, Any]]:
        return token_autoscaling_policy(ctx, self.params)


def build_autoscaling_config(
    *,
    min_replicas: int,
    max_replicas: int,
    target_ongoing_requests: float,
    params: TokenScalingParams | None = None,
    token_aware: bool = True,
    look_back_period_s: float = 30.0,
) -> dict[str, Any]:
    """The ``autoscaling_config`` dict of one deployment (keys of Ray's AutoscalingConfig).

    The bounds are the validated spec's (``AutoscalingSpec``), ``max_replicas`` already within the
    cluster's capacity (``deployments.control.capacity``). ``token_aware=False`` keeps Ray's
    request-count policy (``target_ongoing_requests``), with the same delays applied by Ray instead.
    """
    params = params or TokenScalingParams()
    config: dict[str, Any] = {
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "target_ongoing_requests": target_ongoing_requests,
        "look_back_period_s": look_back_period_s,
    }
    if not token_aware:
        config["upscale_delay_s"] = params.upscale_delay_s
        config["downscale_delay_s"] = params.downscale_delay_s
        return config
    config.update(
        # The policy applies the delays itself; Ray's would add to them.
        upscale_delay_s=0.0,
        downscale_delay_s=0.0,
        # Peak over the look-back window: a burst shows at once, and demand counts as low
        # only when the whole window was low.
        aggregation_function="max",
        policy={"policy_function": POLICY_IMPORT_PATH, "policy_kwargs": asdict(params)},
    )
    return config
