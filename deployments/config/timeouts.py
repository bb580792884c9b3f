"""Every time bound of the tier, derived from the deployment spec in this one module, and the
order the bounds must keep.

Per deployment (:class:`Bounds`, from the spec's ``collective_timeout_s``, ``call_margin_s``,
``health_check_timeout_s``, ``warmup_limit_s``, ``startup_timeout_s``, ``session_linger_s``):

==================  =======================================  ===========================================
bound               value                                    what it bounds
==================  =======================================  ===========================================
``collective_s``    ``collective_timeout_s``                 one collective of a loaded group
``call_s``          ``collective_s + call_margin_s``         one group call (a Serve forward, a lane
                                                             call, one layer of a cohort step); past it
                                                             the group is broken
``health_s``        ``collective_s + HEALTH_MARGIN_S``       the replica's health all-reduce
``serve_health_s``  ``health_check_timeout_s`` or            Serve's health probe of the replica
                    ``health_s + HEALTH_MARGIN_S``
``close_s``         ``max(RANK_POLL_S, collective_s)``       rank 0 closing a session (its peers told)
``warmup_s``        ``call_s + warmup_limit_s``              one warm-up measurement call
``startup_s``       ``startup_timeout_s`` or the planner's   workers start, join and load their shards
                    floor
``linger_s``        ``session_linger_s``                     a session none of whose peers has been
                                                             connected this long ends (the default of
                                                             sessions opened without their own)
``heartbeat``       ``HEARTBEAT_S``, then ``call_s -         rank 0 pings an idle group's other ranks;
                    HEARTBEAT_S`` for the answer             a dead or stopped rank is noticed within
                                                             ``call_s`` with no layer in flight
==================  =======================================  ===========================================

Per app: ``request_s`` = ``request_timeout_s`` or the largest ``call_s`` + ``REQUEST_MARGIN_S``:
the ingress's wait for one attempt.

The order (:func:`check_order`, called by the spec's validation: a config that breaks it fails at
build time with the numbers):

1. ``collective_s < call_s``: a forward is its collectives plus compute.
2. ``health_s < serve_health_s``: Serve must not give up on a health all-reduce that is still
   within its own bound (it would kill a slow but healthy replica).
3. ``RANK_POLL_S <= call_s``: a rank's state poll answers within a call's bound, so a rank that
   stops answering polls for ``call_s`` is stalled, not slow.
4. ``HEARTBEAT_S < call_s`` (follows from 3): a rank has ``call_s - HEARTBEAT_S`` to answer a
   heartbeat, so an idle group notices a dead or stopped rank within one call bound.
5. (app) ``call_s < request_s`` for every deployment: the ingress never gives up on a call that
   the group itself still bounds.

Pure: no Ray import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_runtime.planning.cost import STARTUP_FLOOR_S

HEALTH_MARGIN_S = 5.0  # the health all-reduce over the collective timeout, and Serve's over that
REQUEST_MARGIN_S = 30.0  # the ingress's wait over the slowest group call
ROUTING_STATS_PERIOD_S = 0.5  # replicas report health / session load to the request router this often
RANK_POLL_S = 5.0  # a rank slower than this to answer a state call counts as not answering
HEARTBEAT_S = 2.0  # rank 0 pings each other rank after this long without a batch (idle liveness)
EVENTS_PUSH_S = 1.0  # rank 0 pushes changed session counts to the replica at most this often
SESSION_LINGER_S = 300.0  # default: a session ends once none of its peers was connected this long
MAX_LINGER_S = 86400.0  # the longest linger a session may ask for
HOLDER_WATCH_S = 5.0  # the session CLI, holding a session, reads its state this often
MAX_SESSIONS = 64  # default: sessions one group serves at once (the replica's own not counted)
HANDSHAKE_S = 5.0  # a new data-plane connection must prove its secret within this
CONNECT_S = 10.0  # a peer joining a group: connect and handshake
ANSWER_MARGIN_S = 5.0  # a peer's wait for its answer over the layer's bounds (peers, then forward)
DRAIN_S = 2.0  # an ended session's connection is read until its peer closes, at most this long
PROBE_S = 5.0  # one liveness probe of a rank or a worker
INGRESS_HEALTH_S = 5.0  # the ingress's wait for a deployment's cheap health view (/healthz)
OPEN_ATTEMPT_S = 1.0  # one session request's wait on the replica it reached, and between refusals
DEFAULT_WAIT_S = 5.0  # a lane's, cohort's or session's wait for its groups (API and CLI alike)
DEFAULT_RETRY_S = 5.0  # and how often a lane or cohort on the Serve path asks again
RELEASE_S = 10.0  # a client closing its session on rank 0
SESSION_MOVE_S = 180.0  # default: a session's peers look this long for a healthy group after theirs
#   failed (covers Serve replacing a replica: its start, the group's, warm-up)
MOVE_ASK_S = 30.0  # one ask of the app to move a session (the ingress opens it on another group)
MOVE_RETRY_S = 0.5  # a peer asks again this often while no group can take its session yet
MOVE_OPEN_S = 20.0  # an ingress opening a moved session on a replica gives up after this (503: asked again)
MOVE_CLAIM_S = 60.0  # a move claimed by an ingress replica that died is taken over after this (> MOVE_OPEN_S:
#   a live claimer has always finished by then)
CLIENT_TIMEOUT_S = 120.0  # a client's default wait for one answer (handle or HTTP)
DRAIN_POLL_S = 0.2  # a stopping replica looks this often whether its requests are done (Serve: 2 s)


@dataclass(frozen=True)
class Bounds:
    """A deployment's time bounds (seconds); see the module doc."""

    collective_s: float
    call_s: float
    health_s: float
    serve_health_s: float
    close_s: float
    warmup_s: float
    startup_s: float
    linger_s: float

    @classmethod
    def of(cls, spec: Any) -> Bounds:
        """From a ``DeploymentSpec`` (or anything with its timing fields)."""
        collective = spec.collective_timeout_s
        health = collective + HEALTH_MARGIN_S
        call = collective + spec.call_margin_s
        return cls(
            collective_s=collective, call_s=call, health_s=health,
            serve_health_s=spec.health_check_timeout_s or health + HEALTH_MARGIN_S,
            close_s=max(RANK_POLL_S, collective), warmup_s=call + spec.warmup_limit_s,
            startup_s=spec.startup_timeout_s or STARTUP_FLOOR_S, linger_s=spec.session_linger_s,
        )


def check_order(spec: Any) -> Bounds:
    """The spec's bounds, or ``ValueError`` naming the first rule of the module doc it breaks."""
    b = Bounds.of(spec)
    name = getattr(spec, "name", "?")
    if not b.health_s < b.serve_health_s:
        raise ValueError(
            f"deployment {name!r}: health_check_timeout_s {b.serve_health_s:g} s must exceed the health "
            f"all-reduce's bound, collective_timeout_s {b.collective_s:g} + {HEALTH_MARGIN_S:g} = "
            f"{b.health_s:g} s (else Serve kills a replica whose probe is still within its bound)"
        )
    if not RANK_POLL_S <= b.call_s:
        raise ValueError(
            f"deployment {name!r}: collective_timeout_s {b.collective_s:g} + call_margin_s "
            f"{b.call_s - b.collective_s:g} = {b.call_s:g} s is below the rank poll bound {RANK_POLL_S:g} s"
        )
    return b


def request_bound(request_timeout_s: float | None, specs: list[Any]) -> float:
    """The ingress's wait for one attempt (rule 5 of the module doc)."""
    slowest = max(Bounds.of(s).call_s for s in specs)
    if request_timeout_s is None:
        return slowest + REQUEST_MARGIN_S
    if not request_timeout_s > slowest:
        raise ValueError(
            f"request_timeout_s {request_timeout_s:g} s must exceed the slowest group call, "
            f"collective_timeout_s + call_margin_s = {slowest:g} s (else the ingress gives up on "
            "calls the groups still run)"
        )
    return request_timeout_s
