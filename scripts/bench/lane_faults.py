"""Lane faults: a killed rank under lane load, and a stalled rank.

One deployment of 2 replicas, each a TP --tp group (tiny checkpoint, CPU, logical GPUs).
**kill**: a closed loop calls ``lane.forward`` (T = --tokens), every answer checked against the
Serve path's; after --warm-s one rank of the session's replica is SIGKILLed and the loop runs
--after-s more: client errors and wrong answers (targets 0), the slowest call, the time to the first
answer on any path and on the healthy replica (the lane's session moves there by itself).
**stall**: once Serve has replaced the killed replica, a fresh lane's rank is SIGSTOPped and one
call made: it must end (answered after the move, or an error) within three call timeouts
(collective_timeout_s + call_margin_s: hearing the failure, then the move) plus 15 s, never hang.

    python -m scripts.bench.lane_faults            # tiny checkpoint, ~2-3 minutes on 2 cores
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch

from . import harness
from .docs import Target, section_start, table, target, verdict, verdict_word

APP, NAME, LAYER = "lanefaults", "pair", 1
SECTION = "# Lane faults (scripts/bench/lane_faults.py)"
TIMEOUTS = {"collective_timeout_s": 4.0, "call_margin_s": 4.0}


def rank_pid(lane: Any, rank: int) -> int:
    return harness.rank_pid(NAME, lane.sessions[NAME].groups()[NAME].replica, rank)


def kill_under_load(client: Any, x: torch.Tensor, want: torch.Tensor, warm_s: float, after_s: float,
                    rank: int) -> dict[str, Any]:
    calls: list[dict[str, Any]] = []
    errors: list[str] = []
    stop = threading.Event()
    with client.lane(max_tokens=x.shape[0], name="bench-kill", retry_s=0.5) as lane:
        def status() -> dict[str, Any]:
            return lane.status()["deployments"][NAME]

        def loop() -> None:
            while not stop.is_set():
                before, start = status()["session_calls"], time.monotonic()
                try:
                    out = lane.forward(x, LAYER)
                    now = status()
                    calls.append({"t": start, "ms": (time.monotonic() - start) * 1e3,
                                  "path": "lane" if now["session_calls"] > before else "serve",
                                  "replica": now["replica"], "ok": bool(torch.equal(out, want))})
                except Exception as e:  # noqa: BLE001 -- counted: the target is none
                    errors.append(f"{type(e).__name__}: {e}")

        thread = threading.Thread(target=loop)
        thread.start()
        time.sleep(warm_s)
        victim, pid = status()["replica"], rank_pid(lane, rank)
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        time.sleep(after_s)
        stop.set()
        thread.join(timeout=600)
        lane_status = status()
    for c in calls:
        c["t"] -= killed
    after = [c for c in calls if c["t"] + c["ms"] / 1e3 > 0]  # calls that ended after the kill
    moved = [c for c in after if c["path"] == "lane" and c["replica"] != victim]
    return {"calls": len(calls), "errors": errors, "wrong": sum(not c["ok"] for c in calls),
            "hung": thread.is_alive(), "max_ms": max(c["ms"] for c in calls),
            "first_answer_s": min((c["t"] + c["ms"] / 1e3 for c in after), default=None),
            "first_lane_answer_s": min((c["t"] + c["ms"] / 1e3 for c in moved), default=None),
            "lane": lane_status, "timeline": calls,
            "serve_calls_after_kill": sum(c["path"] == "serve" for c in after)}


def stall(client: Any, x: torch.Tensor, rank: int, bound_s: float) -> dict[str, Any]:
    from deployments.client import MoEServeError

    with client.lane(max_tokens=x.shape[0], name="bench-stall", wait_s=30) as lane:
        if lane.sessions[NAME] is None:
            return {"skipped": lane.status()["deployments"][NAME]["why_serve"]}
        pid = rank_pid(lane, rank)
        os.kill(pid, signal.SIGSTOP)
        start, outcome = time.monotonic(), "answered"
        try:
            lane.forward(x, LAYER)
        except MoEServeError as e:
            outcome = f"error {e.status}: {e.message[:160]}"
        finally:
            seconds = time.monotonic() - start
            with contextlib.suppress(ProcessLookupError):  # the broken group's replica ended it
                os.kill(pid, signal.SIGCONT)
    return {"seconds": seconds, "outcome": outcome, "bound_s": bound_s}


def plot(results: dict[str, Any], path: Path) -> None:
    fig, ax = harness.pyplot().subplots(figsize=(7, 3.5))
    for path_kind, color in (("lane", "tab:green"), ("serve", "tab:orange")):
        pts = [c for c in results["kill"]["timeline"] if c["path"] == path_kind]
        ax.scatter([c["t"] for c in pts], [c["ms"] for c in pts], s=6, color=color, label=path_kind)
    ax.axvline(0, color="tab:red", lw=1, label="rank SIGKILL")
    ax.set(yscale="log", xlabel="seconds since the kill", ylabel="call ms",
           title=f"lane calls around a rank kill (TP {results['tp']}, T {results['tokens']})")
    ax.legend()
    harness.save_figure(fig, path, dpi=120)


def index_rows(results: dict[str, Any]) -> list[Target]:
    k, s = results["kill"], results["stall"]
    kill = Target("a lane's rank SIGKILLed under load: client errors / wrong answers / hung, all none",
                  f"{len(k['errors'])} / {k['wrong']} / {'yes' if k['hung'] else 'no'}",
                  not k["errors"] and not k["wrong"] and not k["hung"])
    what = "a lane's rank SIGSTOPped: seconds until the call ended"
    return [kill, Target(what, "-", None) if "skipped" in s
            else target(what, verdict(s["seconds"], "<=", s["bound_s"]), ".1f")]


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    k, s = results["kill"], results["stall"]
    kill, stalled = (verdict_word(t.met).strip("*") for t in index_rows(results))

    def sec(v: float | None) -> str:
        return "never" if v is None else f"{v:.2f} s"

    what = f"tiny checkpoint, 2 replicas of TP {results['tp']}, float32, T = {results['tokens']}"
    return "\n".join([
        section_start(SECTION, "lane_faults", results["argv"], results["machine"], what, json_path, png_path),
        "", *table("fault | calls | client errors | wrong | hung | slowest call | first answer after "
                   "| first lane answer after",
                   [[f"SIGKILL rank {results['rank']} of the lane's replica", k["calls"], len(k["errors"]),
                     k["wrong"], "yes" if k["hung"] else "no", f"{k['max_ms']:.0f} ms",
                     sec(k["first_answer_s"]), sec(k["first_lane_answer_s"])]]), "",
        f"After the kill, {k['serve_calls_after_kill']} call(s) ran on the Serve path (the lane's session "
        f"moves to the healthy replica by itself: none expected). Verdict (0 client errors, 0 wrong, none "
        f"hung): **{kill}**.", "",
        f"Stalled rank: not measured ({s['skipped']})." if "skipped" in s else
        f"SIGSTOP of rank {results['rank']} of the lane's replica: the call ended in {s['seconds']:.1f} s "
        f"({s['outcome']}); bound {s['bound_s']:.0f} s (three call timeouts: hearing the group failed and "
        f"the "
        f"move, + 15 s): **{stalled}**."])


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "lane_faults", tp=2)
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--rank", type=int, default=1, help="the rank to kill / stop")
    ap.add_argument("--warm-s", type=float, default=3.0)
    ap.add_argument("--after-s", type=float, default=10.0)
    args = ap.parse_args(argv)
    if not 0 <= args.rank < args.tp:
        ap.error(f"--rank {args.rank} is not a rank of a TP {args.tp} group")
    from deployments.client import MoEClient

    app_args = {"checkpoint": str(harness.preset_checkpoint("tiny")), "ingress_replicas": 1, "deployments": [{
        "name": NAME, "tp_size": args.tp, "dtype": "float32", "num_replicas": 2, "health_check_period_s": 1.0,
        "graceful_shutdown_timeout_s": 1.0, **TIMEOUTS, **({"tail": "sharded"} if args.tp > 1 else {})}]}
    x = harness.seeded_randn(args.tokens, 128, seed=0)
    machine = harness.machine_record(with_ray=True)
    with harness.serving(app_args, APP, num_cpus=6, num_gpus=3 * args.tp):
        client = MoEClient.direct(NAME, APP, timeout_s=120)
        kill = kill_under_load(client, x, client.forward(x, LAYER), args.warm_s, args.after_s, args.rank)
        # Serve replaced the victim
        kill["replaced_after_s"] = harness.healthy_replicas_s(client, 2, timeout_s=600)
        stalled = stall(client, x, args.rank, bound_s=3 * sum(TIMEOUTS.values()) + 15)
    results = {"kill": kill, "stall": stalled, "tp": args.tp, "tokens": args.tokens, "rank": args.rank}
    ok = not kill["errors"] and not kill["wrong"]
    return harness.report(args, results, machine, markdown, index_rows, plot, ok=ok)


if __name__ == "__main__":
    raise SystemExit(main())
