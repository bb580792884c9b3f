"""Python clients of the MoE app: Serve handles (``MoEClient``, ``moe_client``), their per-layer
lanes (``MoEClient.lane``, ``lane``), cohorts of attention workers (``MoEClient.cohort``,
``cohort``; workers subclass ``AttentionWorker``), sessions of independent peer processes
(``MoEClient.session``, ``join``, ``session``; ``SessionTicket``, ``SessionError``,
``SessionRefused``), HTTP (``HTTPMoEClient``,
``AsyncHTTPMoEClient``, ``http_client``) and the errors they raise (``errors``). A decoder whose
MoE layers run on the tier, built on these, is an example: ``examples/afd.py``."""

from ..config.timeouts import CLIENT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from ..dataplane.errors import JoinRefused, SessionError
from ..dataplane.peer import Peer, SessionTicket
from .attention import AttentionWorker
from .cohort import Cohort
from .errors import MoEOverloadedError, MoERequestError, MoEServeError, MoEServerError, WorkerError
from .http_client import AsyncHTTPMoEClient, HTTPMoEClient
from .lane import Lane
from .moe_client import MoEClient
from .session import Session, SessionRefused, join

__all__ = [
    "DEFAULT_TIMEOUT_S", "AsyncHTTPMoEClient", "AttentionWorker", "Cohort", "HTTPMoEClient", "JoinRefused",
    "Lane", "MoEClient", "MoEOverloadedError", "MoERequestError", "MoEServeError", "MoEServerError", "Peer",
    "Session", "SessionError", "SessionRefused", "SessionTicket", "WorkerError", "join",
]
