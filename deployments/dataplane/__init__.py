"""The tier's one data plane (design section 9.2): per-layer rows from a session's peers to the ranks
of its TP groups and back, over authenticated TCP connections with blocking waits.

``frames`` (messages and admission), ``errors`` (failure kinds and the one action table), ``steps``
(rank 0's step rules: what runs when, a pure object), ``host`` (rank 0's sockets feed the rules,
every rank forwards), ``peer`` (tickets and peers), ``channel`` (rows that stay on a device, over a
two-member ``torch.distributed`` group). No Ray; torch only in ``channel``, which the others
import only when a peer joins with a channel (importing them loads no torch).

A peer process needs only this package (no Ray): ``from deployments.dataplane import Peer,
SessionTicket``; ``deployments.client`` re-exports the same names.
"""

from .errors import JoinRefused, MoEServeError, SessionError
from .peer import Peer, SessionTicket

__all__ = ["JoinRefused", "MoEServeError", "Peer", "SessionError", "SessionTicket"]
