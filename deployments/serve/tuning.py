"""The replica's warm-up on its TP group: settle a pending ``auto`` tail by measuring it.

:func:`tune_group` has every rank time each legal tail at ``auto_tune_tokens`` (the tails run
collectives); rank 0's timings decide the plan (fastest tail per token range), and every rank
adopts it on every served layer. The measurement's clock is injectable (``tune_clock:
"module:callable"``, resolved on the workers) so tests are deterministic. The ranks' side of the
timing is ``moe_runtime.tp.tuning``; the keys plans are stored under, ``control.warmup``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import ray

from moe_runtime.logs import log_once
from moe_runtime.tp.plan import Clock, TailPlan, Timings

from .. import logger
from ..cluster import kv
from ..common.private_api import SERVE_NAMESPACE
from ..control.decide import MEASURED, REUSED, Decision, TailDecision, measured_plan
from ..control.warmup import plan_key, plan_key_fields


def tune_group(
    workers: Sequence[Any], decision: Decision, replica: str, clock: Clock = time.time
) -> TailDecision:
    """Replica side: settle a pending ``auto`` tail on the group's workers (``TPWorker`` handles,
    rank-ordered) and return the settled tail decision (unchanged when nothing is pending).

    A plan stored under the same key (``control.warmup``) is reused unless the spec asks to
    remeasure. Otherwise each token count is timed in turn (every rank at once), with a log line
    and a progress record (``status()`` of the ingress: ``warmup``) per finished count; once
    ``warmup_limit_s`` has passed the remaining counts are left to the rule-based tail. The
    measured plan is stored for every later replica with the same key.
    """
    tail, spec = decision.tail, decision.spec
    if not tail.pending:
        return tail

    settings = tail.measure
    fields = plan_key_fields(decision.resolved, decision.accelerator, tail.candidates,
                             settings.token_counts, settings.reps, settings.clock)
    key = kv.PLAN_PREFIX + plan_key(fields)
    progress_key = kv.progress_key(spec.name, replica)
    # Who the record belongs to: Serve names its replica actors in its own namespace.
    owner = {"actor": ray.get_runtime_context().get_actor_name(), "namespace": SERVE_NAMESPACE}
    kv.live_progress()  # records of replicas that ended without deleting theirs go
    timeout_s = spec.bounds.warmup_s
    stored = None if spec.remeasure_tail else kv.get_json(key)
    if stored is not None:
        plan = TailPlan.from_dict(stored["plan"])
        ray.get([w.set_plan.remote(plan) for w in workers], timeout=timeout_s)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(stored["measured_at"]))
        log_once(f"warm-up: deployment {spec.name!r} reuses the tail plan measured at {when} UTC "
                 f"(key {key}): {plan.describe()}", logger)
        kv.put_json(progress_key, {"deployment": spec.name, "replica": replica, "state": REUSED,
                                   "key": key, "measured_at": stored["measured_at"], **owner})
        return tail.with_measurement(plan, REUSED, stored["measured_at"])

    counts = list(settings.token_counts)
    estimate = f"~{tail.estimate_s:.0f} s by the planner's estimate" if tail.estimate_s is not None else \
        "no estimate (memory not planned)"
    logger.info("warm-up: deployment %r replica %s measures tails %s at T = %s, %d reps each: %s "
                "(limit warmup_limit_s = %.0f s)", spec.name, replica, list(tail.candidates), counts,
                settings.reps, estimate, spec.warmup_limit_s)
    start = clock()
    timings: Timings = {t: {} for t in tail.candidates}
    done: list[int] = []
    for T in counts:
        if done and clock() - start > spec.warmup_limit_s:
            break
        one = replace(settings, token_counts=(T,))
        refs = [w.measure_tails.remote(one, list(tail.candidates)) for w in workers]
        rank0 = ray.get(refs, timeout=timeout_s)[0]  # rank 0's: every rank must adopt one plan
        for t, per in rank0.items():
            timings[t].update(per)
        done.append(T)
        elapsed = clock() - start
        left = _remaining_estimate(elapsed, done, counts)
        logger.info("warm-up: deployment %r: T = %d measured (%d/%d) in %.1f s total, ~%.0f s left: %s",
                    spec.name, T, len(done), len(counts), elapsed, left,
                    ", ".join(f"{t} {per[T]:.2f} ms" for t, per in rank0.items()))
        kv.put_json(progress_key, {"deployment": spec.name, "replica": replica, "state": "measuring", **owner,
                                   "measured_tokens": done, "token_counts": counts,
                                   "elapsed_s": round(elapsed, 1),
                                   "remaining_s": round(left, 1), "estimate_s": tail.estimate_s})
    unmeasured = [T for T in counts if T not in done]
    plan = measured_plan(tail, timings, unmeasured)
    ray.get([w.set_plan.remote(plan) for w in workers], timeout=timeout_s)
    now = time.time()
    kv.put_json(key, {"plan": plan.to_dict(), "measured_at": now, "fields": fields})
    kv.put_json(progress_key, {"deployment": spec.name, "replica": replica, "state": MEASURED, **owner,
                               "key": key,
                               "measured_tokens": done, "elapsed_s": round(clock() - start, 1)})
    log_once(f"warm-up: deployment {spec.name!r}: tail {plan.describe()} ({plan.reason}); "
             f"stored as {key}", logger)
    return tail.with_measurement(plan, MEASURED, now)


def _remaining_estimate(elapsed: float, done: Sequence[int], counts: Sequence[int]) -> float:
    """Seconds left if time grows with tokens as it did so far (measured counts' tokens -> time)."""
    left = [T for T in counts if T not in done]
    return elapsed * sum(left) / max(1, sum(done))
