"""``python -m deployments.client session ...``: hold a session open for peer processes without Ray.

Peers that cannot lease themselves (vLLM engines: docs/vllm.md) need a process of the app's Ray
cluster to lease the groups and keep the leases renewed. This one does: it opens the session,
writes its ticket (``--ticket``, written whole or not at all) and holds it until SIGINT or
SIGTERM, or until the session ends; then it releases the leases. ``--counters`` writes each
deployment's group counters (``MoEClient.status()["deployments"][name]["counters"]``) as they were
when the session opened and when it closed, so a caller can count the group forwards its peers
caused.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m deployments.client", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("session", help="open a session, write its ticket, hold it until stopped")
    s.add_argument("--peers", type=int, required=True, help="the session's number of peers")
    s.add_argument("--ticket", type=Path, required=True, help="where to write the ticket (JSON)")
    s.add_argument("--app", default="default", help="the Serve application (default: default)")
    s.add_argument("--layers", type=int, nargs="+", help="its layers (default: every layer of the app)")
    s.add_argument("--max-tokens", type=int, default=1, help="rows per peer and layer (default 1)")
    s.add_argument("--idle-after", type=float, default=None, metavar="S",
                   help="an elastic session: peers may join late, idle, leave or die (see "
                        "MoEClient.session); a step's start waits up to S seconds for its peers")
    s.add_argument("--wait", type=float, default=30.0, metavar="S", help="wait for free groups (default 30)")
    s.add_argument("--name", help="the session's name (default: session-<host>-<pid>)")
    s.add_argument("--counters", type=Path, help="write the app's group counters at open and at close")
    s.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"),
                   help="the Ray cluster (default: RAY_ADDRESS, else auto)")
    return ap


def write_whole(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    part.replace(path)  # a reader sees the whole file or none


def counters(client: Any) -> dict[str, Any]:
    return {name: d.get("counters") for name, d in client.status()["deployments"].items()}


def hold(args: argparse.Namespace) -> int:
    import ray

    from ..cluster.local import leave_ray
    from .moe_client import MoEClient

    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    client = MoEClient(args.app)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with client.session(args.peers, args.layers, max_tokens=args.max_tokens, wait_s=args.wait,
                            name=args.name, idle_after_s=args.idle_after) as session:
            opened = counters(client)
            write_whole(args.ticket, session.ticket.to_json())
            print(f"session {session.name!r}: {args.peers} peer(s), layers {list(session.ticket.layers)}, "
                  f"ticket {args.ticket}", flush=True)
            while session.closed is None and not stop.wait(0.5):
                pass
            why = session.closed or "stopped"
            if args.counters:
                write_whole(args.counters, json.dumps({"opened": opened, "closed": counters(client)}))
        print(f"session {session.name!r} ended: {why}", flush=True)
    finally:
        leave_ray()  # quietly: the app keeps serving
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    for name in ("peers", "max_tokens"):
        if getattr(args, name) < 1:
            parser().error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return hold(args)


if __name__ == "__main__":
    sys.exit(main())
