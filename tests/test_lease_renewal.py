"""``kept_renewed`` (deployments/client/leases.py): while a lane or a cohort leases its other
groups or compiles its graph it makes no call, so a thread renews its held leases meanwhile.
Stand-in leases count the renewals; the real thing (a compile longer than the lease term still
ends on the lane) is in tests/test_lane.py."""

from __future__ import annotations

import threading

from waiting import wait_until

from deployments.client.leases import kept_renewed


class StandIn:
    """A lease always due for renewal (``grant`` None: not held); ``renew`` answers ``ok``."""

    def __init__(self, lease_id: str | None, ok: bool = True):
        self.grant = None if lease_id is None else {"lease_id": lease_id, "term_s": 0.08}
        self.ok, self.renewals = ok, 0

    def renew_due(self) -> bool:
        return self.grant is not None

    def renew(self) -> bool:
        self.renewals += 1
        return self.ok


def keepers() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "renew-leases"]


def test_held_leases_are_renewed_while_the_block_runs_and_not_after():
    held, refused, free = StandIn("a"), StandIn("b", ok=False), StandIn(None)
    with kept_renewed([held, refused, free]):
        wait_until(lambda: held.renewals >= 3, timeout_s=30, what="three renewals of the held lease")
        free.grant = {"lease_id": "c", "term_s": 0.08}  # leased while the block runs
        wait_until(lambda: free.renewals >= 1, timeout_s=30, what="a renewal of the lease taken meanwhile")
    # a refused renewal is not asked again: the owner's own next renewal finds the lease ended
    assert refused.renewals == 1
    wait_until(lambda: not keepers(), timeout_s=30, what="the renewing thread ending with the block")
