"""What a TP-group replica counts: one object feeds ``status()`` and the Serve metrics.

:class:`ReplicaStats` is updated once per event (request admitted, forward done, error) and
keeps both the counters ``status()["counters"]`` reports (and the autoscaler reads) and the
metrics exported through ``ray.serve.metrics``, which tag every series with ``deployment``,
``replica`` and ``application`` themselves. Ray exports them on its Prometheus endpoint with
a ``ray_`` prefix (counters also get ``_total``), e.g.
``ray_moe_forward_latency_ms_bucket{deployment="decode",layer="1",tail="sharded",...}``;
``deployments/dashboards/moe_tier.json`` is a Grafana dashboard over them.

* ``moe_requests`` / ``moe_tokens`` (counters): answered requests and their tokens (tokens/s).
* ``moe_forward_latency_ms`` (histogram, ``layer``, ``tail``): one TP-group forward as the
  replica sees it (submission to rank 0's answer).
* ``moe_batch_tokens`` (histogram, ``layer``): tokens per TP-group forward on every path (a Serve
  batch, a lane call, a cohort layer: the aggregation the tier exists for).
* ``moe_tail_batches`` (counter, ``layer``, ``tail``): forwards per tail actually run.
* ``moe_queued_tokens`` (gauge): tokens admitted and not yet answered (the autoscaler's signal).
* ``moe_errors`` (counter, ``kind`` = ``client`` (4xx) or ``server`` (5xx)).
* ``moe_group_healthy`` (gauge): 1 while the replica's TP group is usable, 0 once broken.
* ``moe_sessions_open`` / ``moe_session_peers`` (gauges): clients' sessions open on the group and
  their peers connected; ``moe_group_busy_fraction`` (gauge): the group's forward time over its
  lifetime. Set when rank 0 pushes a change (at most once a second, nothing while idle) and at
  every ``status()``.
* ``moe_tail_plan`` (gauge, 1 per tier, ``tail``, ``max_tokens``) and ``moe_tail_timing_ms``
  (gauge, ``tail``, ``tokens``): the controller's decision and the warm-up timings behind it.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Any

from ray.serve import metrics

from moe_runtime.tp.plan import TailPlan

LATENCY_BOUNDARIES_MS = [0.25, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 30000]
TOKEN_BOUNDARIES = [float(2**i) for i in range(17)]  # 1 .. 65536
RATE_WINDOW_S = 10.0  # tokens/s reported to the autoscaler is measured over this window
RECENT_BATCHES = 256

REQUESTS_METRIC = "moe_requests"
TOKENS_METRIC = "moe_tokens"
FORWARD_LATENCY_METRIC = "moe_forward_latency_ms"
BATCH_TOKENS_METRIC = "moe_batch_tokens"
TAIL_BATCHES_METRIC = "moe_tail_batches"
QUEUED_TOKENS_METRIC = "moe_queued_tokens"
ERRORS_METRIC = "moe_errors"
GROUP_HEALTHY_METRIC = "moe_group_healthy"
TAIL_PLAN_METRIC = "moe_tail_plan"
TAIL_TIMING_METRIC = "moe_tail_timing_ms"
SESSIONS_OPEN_METRIC = "moe_sessions_open"
SESSION_PEERS_METRIC = "moe_session_peers"
GROUP_BUSY_METRIC = "moe_group_busy_fraction"
METRIC_NAMES = (
    REQUESTS_METRIC, TOKENS_METRIC, FORWARD_LATENCY_METRIC, BATCH_TOKENS_METRIC, TAIL_BATCHES_METRIC,
    QUEUED_TOKENS_METRIC, ERRORS_METRIC, GROUP_HEALTHY_METRIC, TAIL_PLAN_METRIC, TAIL_TIMING_METRIC,
    SESSIONS_OPEN_METRIC, SESSION_PEERS_METRIC, GROUP_BUSY_METRIC,
)


class ReplicaStats:
    """Counters of one replica and its Serve metrics, updated together."""

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0
        self.forwards = 0
        self.forward_tokens = 0
        self.solo_oversize = 0
        self.errors: Counter[str] = Counter()
        self.queued_tokens = 0  # admitted, not yet answered
        self.batch_hist: Counter[int] = Counter()  # power-of-two upper bound -> forwards
        self.recent_batches: deque[int] = deque(maxlen=RECENT_BATCHES)
        self.recent_forward_ms: deque[float] = deque(maxlen=RECENT_BATCHES)
        self.forward_s = 0.0
        self.by_layer: dict[int, Counter[str]] = {}
        self.tails: Counter[str] = Counter()
        self.max_batch_tokens_seen = 0
        self._done: deque[tuple[float, int]] = deque()
        # Of the above, what the sessions made (serve.sessions): their forwards, the steps those
        # started, their peers' parts (requests), tokens and the group's busy seconds.
        self.session_counts: dict[str, float] = {"forwards": 0, "steps": 0, "requests": 0, "tokens": 0,
                                                 "busy_s": 0.0}

        self._requests = metrics.Counter(REQUESTS_METRIC, description="Answered forward requests")
        self._tokens = metrics.Counter(TOKENS_METRIC, description="Tokens of answered forward requests")
        self._latency = metrics.Histogram(
            FORWARD_LATENCY_METRIC, description="Wall time of one TP-group forward (ms)",
            boundaries=LATENCY_BOUNDARIES_MS, tag_keys=("layer", "tail"),
        )
        self._batch_tokens = metrics.Histogram(
            BATCH_TOKENS_METRIC, description="Tokens per TP-group forward", boundaries=TOKEN_BOUNDARIES,
            tag_keys=("layer",),
        )
        self._tail_batches = metrics.Counter(
            TAIL_BATCHES_METRIC, description="TP-group forwards per tail run", tag_keys=("layer", "tail")
        )
        self._queued = metrics.Gauge(QUEUED_TOKENS_METRIC, description="Tokens admitted and not yet answered")
        self._errors = metrics.Counter(
            ERRORS_METRIC, description="Failed requests (client: 4xx, server: 5xx)", tag_keys=("kind",)
        )
        self._healthy = metrics.Gauge(
            GROUP_HEALTHY_METRIC, description="1 while the replica's TP group is usable"
        )
        self._tail_plan = metrics.Gauge(
            TAIL_PLAN_METRIC, description="Controller decision: 1 per tier of the tail plan",
            tag_keys=("tail", "max_tokens"),
        )
        self._tail_timing = metrics.Gauge(
            TAIL_TIMING_METRIC, description="Warm-up timing of a tail at a token count (ms)",
            tag_keys=("tail", "tokens"),
        )
        self._sessions_open = metrics.Gauge(SESSIONS_OPEN_METRIC, description="Sessions open on the group")
        self._session_peers = metrics.Gauge(SESSION_PEERS_METRIC, description="Sessions' peers connected")
        self._group_busy = metrics.Gauge(GROUP_BUSY_METRIC, description="The group's forward time / its age")
        self._queued.set(0)
        self._healthy.set(1)
        self.sessions(0, 0, 0.0)

    # -- events ---------------------------------------------------------------------------

    def admitted(self, tokens: int) -> None:
        self.requests += 1
        self.queued_tokens += tokens
        self._queued.set(self.queued_tokens)

    def released(self, tokens: int, answered: bool) -> None:
        self.queued_tokens -= tokens
        self._queued.set(self.queued_tokens)
        if answered:
            self.tokens += tokens
            self._requests.inc()
            self._tokens.inc(tokens)

    def error(self, kind: str) -> None:
        """``kind``: ``client`` (4xx) or ``server`` (5xx)."""
        self.errors[kind] += 1
        self._errors.inc(tags={"kind": kind})

    def group_broken(self) -> None:
        self._healthy.set(0)

    def _batch(self, tokens: int, layer: int) -> None:
        """One group forward of ``tokens`` tokens, whatever path ran it."""
        self.forwards += 1
        self.forward_tokens += tokens
        self.batch_hist[1 << max(0, (tokens - 1).bit_length())] += 1
        self.recent_batches.append(tokens)
        self.max_batch_tokens_seen = max(self.max_batch_tokens_seen, tokens)
        self._batch_tokens.observe(tokens, tags={"layer": str(layer)})

    def forward_done(self, layer: int, tokens: int, requests: int, tail: str, seconds: float) -> None:
        self._batch(tokens, layer)
        self.forward_s += seconds
        self.recent_forward_ms.append(round(seconds * 1e3, 2))
        self.tails[tail] += 1
        c = self.by_layer.setdefault(layer, Counter())
        c["forwards"] += 1
        c["requests"] += requests
        c["tokens"] += tokens
        self._done.append((time.monotonic(), tokens))
        tags = {"layer": str(layer), "tail": tail}
        self._latency.observe(seconds * 1e3, tags=tags)
        self._tail_batches.inc(tags=tags)

    def session_forwards(self, forwards: int, steps: int, requests: int, tokens: int, seconds: float,
                         tails: dict[str, int], layer_forwards: dict[int, int], layer_parts: dict[int, int],
                         layer_rows: dict[int, int], batches: dict[str, int]) -> None:
        """Forwards the group ran for the replica's sessions (lanes, cohorts, independent peers)
        since rank 0's last push (``serve.sessions``): ``requests`` peers' parts in ``forwards``
        forwards, ``steps`` of which started a step of a session's peers. They count as answered
        requests, tokens (tokens/s for the autoscaler), forwards and busy time, per tail and per
        layer, like Serve's."""
        for key, n in (("forwards", forwards), ("steps", steps), ("requests", requests), ("tokens", tokens),
                       ("busy_s", seconds)):
            self.session_counts[key] += n
        self.requests += requests
        self.tokens += tokens
        self.forward_s += seconds
        self.tails.update(tails)
        for key, n in batches.items():  # "layer:rows" -> forwards
            layer, size = map(int, key.split(":"))
            for _ in range(n):
                self._batch(size, layer)
        for layer, n in layer_forwards.items():
            c = self.by_layer.setdefault(int(layer), Counter())
            c["forwards"] += n
            c["requests"] += layer_parts.get(layer, 0)
            c["tokens"] += layer_rows.get(layer, 0)
        self._done.append((time.monotonic(), tokens))
        if requests:  # Ray counters need > 0
            self._requests.inc(requests)
        if tokens:  # a call that failed on its input answered no tokens
            self._tokens.inc(tokens)

    def sessions(self, open_now: int, peers: int, busy_fraction: float) -> None:
        """The open sessions, their connected peers and the group's busy fraction, as last heard."""
        self._sessions_open.set(open_now)
        self._session_peers.set(peers)
        self._group_busy.set(busy_fraction)

    def decision(self, plan: TailPlan) -> None:
        """Export the plan the replica runs (once, after warm-up) and its measurements."""
        for tier in plan.tiers:
            bound = "inf" if tier.max_tokens is None else str(tier.max_tokens)
            self._tail_plan.set(1, tags={"tail": tier.tail, "max_tokens": bound})
        for tail, per_count in plan.timings_ms.items():
            for tokens, ms in per_count.items():
                self._tail_timing.set(ms, tags={"tail": tail, "tokens": str(tokens)})

    # -- reads ----------------------------------------------------------------------------

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        while self._done and now - self._done[0][0] > RATE_WINDOW_S:
            self._done.popleft()
        return sum(t for _, t in self._done) / RATE_WINDOW_S

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "tokens": self.tokens,
            "forwards": self.forwards,
            "forward_tokens": self.forward_tokens,
            "solo_oversize_requests": self.solo_oversize,
            "errors": {"client": self.errors["client"], "server": self.errors["server"]},
            "queued_tokens": self.queued_tokens,
            "tokens_per_s": round(self.tokens_per_s(), 1),
            "batch_tokens": {
                "count": self.forwards,
                "mean": round(self.forward_tokens / self.forwards, 2) if self.forwards else None,
                "max": self.max_batch_tokens_seen,
                "histogram": {f"<={k}": v for k, v in sorted(self.batch_hist.items())},
                "recent": list(self.recent_batches),
            },
            "forward_ms": {
                "mean": round(self.forward_s * 1e3 / self.forwards, 2) if self.forwards else None,
                "recent": list(self.recent_forward_ms),
            },
            "sessions": {**self.session_counts, "busy_s": round(self.session_counts["busy_s"], 3)},
            "tails": dict(self.tails),
            "by_layer": {str(k): dict(v) for k, v in sorted(self.by_layer.items())},
        }
