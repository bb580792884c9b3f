"""A session peer in a process without Ray (tests/plain_driver.py starts it): joins the ticket it is
given on stdin as peer INDEX, steps STEPS times over LAYERS with the rows of ``seed``, compares
each answer with the expected rows (on stdin too) within the shared-forward tolerance, and prints
one JSON line. Importing Ray here fails the run: a peer needs only the data plane.

    python tests/rayless_peer.py INDEX STEPS < {"ticket": ..., "want": {layer: [[...]]}, "rows": [[...]]}
"""

from __future__ import annotations

import json
import sys

import numpy as np

from deployments.common.wire import WireTensor
from deployments.dataplane.peer import SessionTicket

# Rank 0 may run this peer's rows in one forward with other sessions' rows and the Serve path's:
# a different batch moves fp32 results by a few ulps (1.2e-6 measured on the tiny layer), so the
# comparison with the lone Serve-path forward allows 1e-5.
TOL = 1e-5


def main() -> None:
    index, steps = int(sys.argv[1]), int(sys.argv[2])
    given = json.loads(sys.stdin.read())
    ticket = SessionTicket.from_json(given["ticket"])
    x = WireTensor(np.asarray(given["rows"], np.float32), "float32")
    want = {int(layer): np.asarray(rows, np.float32) for layer, rows in given["want"].items()}
    worst = 0.0
    with ticket.join(index) as peer:
        for _ in range(steps):
            for layer in ticket.layers:
                out, _ = peer.forward_wire(x, layer)
                worst = max(worst, float(np.abs(out.float32() - want[layer]).max()))
                if worst > TOL:
                    raise AssertionError(f"peer {index}, layer {layer}: {worst:.2e} off the Serve path's rows")
    print(json.dumps({"steps": steps, "worst": worst, "ray_imported": "ray" in sys.modules}), flush=True)


if __name__ == "__main__":
    main()
