"""``python -m deployments.client session|close ...``: open a session for peer processes without Ray.

Peers that cannot open a session themselves (vLLM engines: docs/vllm.md) need a process of the
app's Ray cluster to open it. ``session`` does: it opens the session on every group serving its
layers (all or none), writes its ticket (``--ticket``, written whole or not at all), and then
either holds it until SIGINT or SIGTERM and closes it (the default), or exits at once leaving it
open (``--detach``: it then ends with ``close --ticket``, or once none of its peers has been
connected for its linger, ``--linger``). It exits non-zero, saying why, when the session cannot
be opened or ends while held for any reason but being stopped. ``--counters`` writes each
deployment's group counters (``MoEClient.status()["deployments"][name]["counters"]``) as they
were when the session opened and when it closed, so a caller can count the group forwards its
peers caused.
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

from ..config.timeouts import DEFAULT_WAIT_S, HOLDER_WATCH_S


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m deployments.client", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("session", help="open a session, write its ticket, hold it until stopped (or detach)")
    s.add_argument("--peers", type=int, required=True, help="the session's number of peers")
    s.add_argument("--ticket", type=Path, required=True, help="where to write the ticket (JSON)")
    s.add_argument("--app", default="default", help="the Serve application (default: default)")
    s.add_argument("--layers", type=int, nargs="+", help="its layers (default: every layer of the app)")
    s.add_argument("--max-tokens", type=int, default=1, help="rows per peer and layer (default 1)")
    s.add_argument("--idle-after", type=float, default=None, metavar="S",
                   help="an elastic session: peers may join late, idle, leave or die (see "
                        "MoEClient.session); a step's start waits up to S seconds for its peers")
    s.add_argument("--linger", type=float, default=None, metavar="S",
                   help="the session ends once none of its peers has been connected for S seconds "
                        "(default: the deployment's session_linger_s)")
    s.add_argument("--detach", action="store_true",
                   help="exit once the ticket is written, leaving the session open")
    s.add_argument("--wait", type=float, default=DEFAULT_WAIT_S, metavar="S",
                   help=f"how long to ask for groups that refuse the session (default {DEFAULT_WAIT_S:g})")
    s.add_argument("--name", help="the session's name (default: session-<host>-<pid>)")
    s.add_argument("--counters", type=Path, help="write the app's group counters at open and at close")
    c = sub.add_parser("close", help="close the session a ticket names (one opened with --detach)")
    c.add_argument("--ticket", type=Path, required=True, help="the session's ticket (JSON)")
    for p in (s, c):
        p.add_argument("--address", default=os.environ.get("RAY_ADDRESS", "auto"),
                       help="the Ray cluster (default: RAY_ADDRESS, else auto)")
    return ap


def write_whole(path: Path, text: str) -> None:
    part = path.with_name(path.name + ".part")
    part.write_text(text)
    part.replace(path)  # a reader sees the whole file or none


def counters(client: Any) -> dict[str, Any]:
    return {name: d.get("counters") for name, d in client.status()["deployments"].items()}


def ended(session: Any) -> str | None:
    """Why the session is over on some group (None: open on every one, or moving: a broken group's
    session goes on where its peers take it)."""
    for deployment, state in session.state().items():
        if state.get("ended") and state.get("failure") not in ("group_failed", "group_timeout"):
            return f"{deployment}: {state.get('failure') or 'ended'}: {state['ended']}"
    return None


def hold(args: argparse.Namespace) -> int:
    import ray

    from ..cluster.local import leave_ray
    from .moe_client import MoEClient
    from .session import SessionRefused

    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    client = MoEClient(args.app)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        try:
            session = client.session(args.peers, args.layers, max_tokens=args.max_tokens, wait_s=args.wait,
                                     name=args.name, idle_after_s=args.idle_after, linger_s=args.linger)
        except (SessionRefused, ValueError) as e:
            print(f"no session: {e}", file=sys.stderr, flush=True)
            return 2
        opened = counters(client) if args.counters else None
        write_whole(args.ticket, session.ticket.to_json())
        print(f"session {session.name!r}: {args.peers} peer(s), layers {list(session.ticket.layers)}, "
              f"ticket {args.ticket}{' (detached)' if args.detach else ''}", flush=True)
        if args.detach:
            return 0
        why = None
        while why is None and not stop.wait(HOLDER_WATCH_S):
            why = ended(session)
        session.close("its holder was stopped" if why is None else why)
        if args.counters:
            write_whole(args.counters, json.dumps({"opened": opened, "closed": counters(client)}))
        if why is not None:
            print(f"session {session.name!r} ended: {why}", file=sys.stderr, flush=True)
            return 1
        print(f"session {session.name!r} closed", flush=True)
        return 0
    finally:
        leave_ray()  # quietly: the app keeps serving


def close(args: argparse.Namespace) -> int:
    import ray

    from ..cluster.local import leave_ray
    from ..dataplane.peer import SessionTicket
    from .session import close_groups

    ticket = SessionTicket.from_json(args.ticket.read_text())
    ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
    try:
        failed = close_groups(ticket, "closed with its ticket")
    finally:
        leave_ray()
    for line in failed:
        print(f"not closed on {line}", file=sys.stderr)
    print(f"session {ticket.name!r} closed on {len(ticket.groups) - len(failed)} of {len(ticket.groups)} "
          "group(s)", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "close":
        return close(args)
    for name in ("peers", "max_tokens"):
        if getattr(args, name) < 1:
            parser().error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return hold(args)


if __name__ == "__main__":
    sys.exit(main())
