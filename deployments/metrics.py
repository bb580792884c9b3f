"""Ray metrics of a TP-group replica (DESIGN §5.3): what ran, how long, and what was decided.

Every metric carries the tags ``deployment`` and ``replica``; per-forward metrics add
``layer`` and ``tail``. Ray exports them on its Prometheus endpoint (every node's metrics
agent, ``_metrics_export_port`` / ``--metrics-export-port``) with a ``ray_`` prefix, e.g.
``ray_moe_forward_latency_ms_bucket{deployment="decode",layer="1",tail="sharded",...}``.

* ``moe_forward_latency_ms`` (histogram): wall time of one TP-group forward as the replica
  sees it (submission to rank 0's answer).
* ``moe_batch_tokens`` (histogram): tokens per forward (the token-budget batcher's result).
* ``moe_tail_batches`` (counter): forwards per tail actually run (per-range plans mix tails).
* ``moe_queued_tokens`` (gauge): tokens admitted and not yet answered, the autoscaler's signal.
* ``moe_errors`` (counter): failed requests, ``kind`` = ``client`` (4xx) or ``server`` (5xx).
* ``moe_tail_plan`` (gauge, 1 per tier): the controller's decision, one series per tier of the
  deployment's tail plan (``tail``, ``max_tokens`` = the tier's upper bound or ``inf``).
* ``moe_tail_timing_ms`` (gauge): the warm-up measurement behind an ``auto`` plan, per
  ``tail`` and ``tokens``.
"""

from __future__ import annotations

from ray.util import metrics

from moe_runtime.plan import TailPlan

LATENCY_BOUNDARIES_MS = [0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000]
TOKEN_BOUNDARIES = [float(2**i) for i in range(17)]  # 1 .. 65536

FORWARD_LATENCY = "moe_forward_latency_ms"
BATCH_TOKENS = "moe_batch_tokens"
TAIL_BATCHES = "moe_tail_batches"
QUEUED_TOKENS = "moe_queued_tokens"
ERRORS = "moe_errors"
TAIL_PLAN = "moe_tail_plan"
TAIL_TIMING = "moe_tail_timing_ms"
METRIC_NAMES = (FORWARD_LATENCY, BATCH_TOKENS, TAIL_BATCHES, QUEUED_TOKENS, ERRORS, TAIL_PLAN, TAIL_TIMING)

_BASE = ("deployment", "replica")


class ReplicaMetrics:
    """The metrics of one replica of ``deployment`` (created once, in the replica's __init__)."""

    def __init__(self, deployment: str, replica: str) -> None:
        base = {"deployment": deployment, "replica": replica}
        self.forward_latency = metrics.Histogram(
            FORWARD_LATENCY, description="Wall time of one TP-group forward (ms)",
            boundaries=LATENCY_BOUNDARIES_MS, tag_keys=(*_BASE, "layer", "tail"),
        )
        self.batch_tokens = metrics.Histogram(
            BATCH_TOKENS, description="Tokens per TP-group forward",
            boundaries=TOKEN_BOUNDARIES, tag_keys=(*_BASE, "layer"),
        )
        self.tail_batches = metrics.Counter(
            TAIL_BATCHES, description="TP-group forwards per tail run", tag_keys=(*_BASE, "layer", "tail")
        )
        self.queued = metrics.Gauge(
            QUEUED_TOKENS, description="Tokens admitted and not yet answered", tag_keys=_BASE
        )
        self.errors = metrics.Counter(
            ERRORS, description="Failed requests (client: 4xx, server: 5xx)", tag_keys=(*_BASE, "kind")
        )
        self.tail_plan = metrics.Gauge(
            TAIL_PLAN, description="Controller decision: 1 per tier of the tail plan",
            tag_keys=(*_BASE, "tail", "max_tokens"),
        )
        self.tail_timing = metrics.Gauge(
            TAIL_TIMING, description="Warm-up timing of a tail at a token count (ms)",
            tag_keys=(*_BASE, "tail", "tokens"),
        )
        for metric in (self.forward_latency, self.batch_tokens, self.tail_batches, self.queued,
                       self.errors, self.tail_plan, self.tail_timing):
            metric.set_default_tags(base)
        self.queued.set(0)

    def forward_done(self, layer: int, tokens: int, tail: str, seconds: float) -> None:
        tags = {"layer": str(layer), "tail": tail}
        self.forward_latency.observe(seconds * 1e3, tags=tags)
        self.tail_batches.inc(tags=tags)
        self.batch_tokens.observe(tokens, tags={"layer": str(layer)})

    def queued_tokens(self, tokens: int) -> None:
        self.queued.set(tokens)

    def error(self, kind: str) -> None:
        self.errors.inc(tags={"kind": kind})

    def decision(self, plan: TailPlan) -> None:
        """Export the plan the replica runs (once, after warm-up) and its measurements."""
        for tier in plan.tiers:
            bound = "inf" if tier.max_tokens is None else str(tier.max_tokens)
            self.tail_plan.set(1, tags={"tail": tier.tail, "max_tokens": bound})
        for tail, per_count in plan.timings_ms.items():
            for tokens, ms in per_count.items():
                self.tail_timing.set(ms, tags={"tail": tail, "tokens": str(tokens)})
