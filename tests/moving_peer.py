"""A session peer in a process without Ray (tests/test_session_moves.py starts it): joins the ticket
given on stdin as peer INDEX and steps over the ticket's layers until it has taken the number of
steps the file STOP names, once it exists (every peer of a strict session stops at the same step),
comparing each answer with the expected rows; faults injected meanwhile must cost it nothing.
After each step it writes its count to PROGRESS (so the test sees every peer step again); at the
end it prints one JSON line: steps, the worst difference, errors, its moves, whether Ray was
imported. Ray cannot be imported here at all (a meta-path blocker): a peer needs only its ticket.

    python tests/moving_peer.py INDEX STOP PROGRESS < {"ticket": ..., "want": {layer: [[...]]}, "rows": [[...]]}
"""

from __future__ import annotations

import importlib.abc
import json
import sys
from pathlib import Path


class NoRay(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"{name}: a Ray-less peer must not import Ray")
        return None


# Rank 0 may run this peer's rows in one forward with other sessions' rows: a different batch moves
# fp32 results by a few ulps (1.2e-6 measured on the tiny layer), so 1e-5 against the lone forward.
TOL = 1e-5


def main() -> None:
    import numpy as np

    from deployments.dataplane import SessionTicket

    index, stop, progress = int(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
    given = json.loads(sys.stdin.read())
    ticket = SessionTicket.from_json(given["ticket"])
    x = np.asarray(given["rows"], np.float32)
    want = {int(layer): np.asarray(rows, np.float32) for layer, rows in given["want"].items()}
    steps, worst, errors = 0, 0.0, []
    peer = ticket.join(index)
    with peer:
        while not stop.exists() or steps < int(stop.read_text() or 1 << 30):
            try:
                for layer in ticket.layers:
                    out = peer.forward(x, layer)
                    worst = max(worst, float(np.abs(out - want[layer]).max()))
            except Exception as e:  # counted, not hidden: the test asserts there are none
                errors.append(f"{type(e).__name__}: {e}")
                break
            steps += 1
            progress.write_text(str(steps))
    print(json.dumps({"steps": steps, "worst": worst, "errors": errors, "moves": peer.moves,
                      "ray_imported": "ray" in sys.modules}), flush=True)


if __name__ == "__main__":
    sys.meta_path.insert(0, NoRay())  # before anything of the project is imported
    main()
