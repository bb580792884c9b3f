"""vLLM engines on the tier: decode tokens/s, what sharing one expert batch buys, and the idle stall.

    python -m scripts.bench.vllm_engines [--tokens N] [--prompts P] [--rounds R]   # in the vLLM lane's venv

The topology of docs/vllm.md (scripts/vllm_tier.py): the tiny tier under `serve run`, the
tiny Qwen3-MoE model, every engine a process of its own greedy-decoding P prompts for N tokens.
Rows, side by side: in_process; tier and tier_eager in turns for R rounds; tier_tp2; shared K /
separate K (``LLM`` engines, engine core in process or apart); serve_shared / serve_separate (2
`vllm serve` OpenAI servers); idle_vllm / idle_tier (an engine idling in bursts beside a busy one,
with vLLM's scheduler and the plugin's); native_vllm / native_tier. The page says how to read them.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from scripts import vllm_tier as vt

from . import harness
from .docs import Target, section_start, table, target, verdict, verdict_text

# Short, yet many times an engine step's own work here (a few ms): the shared rows' idle wait.
IDLE_AFTER_S = 0.05
# docs/vllm.md's advice for engines sharing 2 cores: the idle rows' wait, at each idle turn.
IDLE_STALL_S = 0.2
IDLE_SCHEDULER = "deployments.vllm_plugin.idle.TierScheduler"
BURSTS, PAUSE_S = 8, 0.25  # the idling engine's bursts of one prompt, and its pause after each
CORE_IN_PROCESS, CORE_OWN_PROCESS = "in process", "own process"
CORE_ENV = {CORE_IN_PROCESS: {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, CORE_OWN_PROCESS: {}}
ENGINES = (2, 4)


def prompts(count: int, offset: int) -> list[list[int]]:
    return [[3 + (offset * 7 + i * 13 + j) % 500 for j in range(4)] for i in range(count)]


def alike(latent: list[dict[str, Any]], count: int, tokens: int) -> list[tuple]:
    """Engine specs of one ``latent`` setting each, ``count`` prompts of ``tokens`` tokens."""
    return [(s, prompts(count, i), tokens) for i, s in enumerate(latent)]


def decode(tier: vt.Tier | None, folder: Path, model: Path, specs: list[tuple], core: str = CORE_IN_PROCESS,
           engine: dict | None = None) -> dict[str, Any]:
    """Engines (one per ``(latent_moe, prompts, tokens[, spec extras])``) built, then released
    together: their decode seconds, tokens, and the group forwards during the decode (``tier``)."""
    procs, go = vt.start_engines(folder, model, specs, env=CORE_ENV[core], engine=engine)

    def release() -> list[dict[str, Any]]:
        go.write_text("")
        return [vt.finish_engine(f, p) for f, p in procs]

    return timed(tier, release)


def timed(tier: vt.Tier | None, run: Any) -> dict[str, Any]:
    """``run()``'s engines' outputs, with the machine's busy cores and (``tier``) group forwards."""
    before = vt.status_counts(tier) if tier else (0, 0)
    busy, start = harness.busy_cpu_s(), time.monotonic()
    outs = run()
    busy_s, wall = harness.busy_cpu_s() - busy, time.monotonic() - start
    after = counted_after(tier, before) if tier else (None, None)
    return {"seconds": [o["seconds"] for o in outs], "tokens": sum(len(t) for o in outs for t in o["tokens"]),
            "forwards": after[0], "steps": after[1], "busy_s": busy_s, "wall_s": wall}


def counted_after(tier: vt.Tier, before: tuple[int, int], settle_s: float = 2.0) -> tuple[int, int]:
    """The forwards and group steps since ``before``, once the app's counters stop moving."""
    last, deadline = None, time.monotonic() + settle_s
    while True:
        now = vt.status_counts(tier)
        if now == last or time.monotonic() > deadline:
            return now[0] - before[0], now[1] - before[1]
        last = now
        time.sleep(0.5)


def row(mode: str, engines: int, runs: list[dict[str, Any]], together: bool,
        core: str = CORE_IN_PROCESS) -> dict[str, Any]:
    """``runs``: one decode, or several engines' in turn (not ``together``) or rounds of one."""
    seconds = [s for r in runs for s in r["seconds"]]
    wall = max(seconds) if together else sum(seconds)
    tokens = sum(r["tokens"] for r in runs)
    counted = {k: None if runs[0][k] is None else sum(r[k] for r in runs) for k in ("forwards", "steps")}
    busy = sum(r["busy_s"] for r in runs) / sum(r["wall_s"] for r in runs)
    return {"mode": mode, "engines": engines, "core": core, "tokens": tokens, "decode_s": wall,
            "tokens_per_s": tokens / wall, "cores_busy": busy, **counted}


def measure(args: Any) -> int:
    record = harness.machine_record()
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    models = vt.make_models(work / "models")
    tier = vt.Tier(models["tier"], work / "tier")
    rows: list[dict[str, Any]] = []
    try:
        local = {"checkpoint": str(models["tier"]), "dtype": "float32"}
        rows.append(row("in_process", 1, [decode(None, work / "local", models["model"],
                                                 alike([local], args.prompts, args.tokens))], True))
        for rows_of in (compiled_rows, shared_rows, serve_rows, idle_rows):
            rows += rows_of(tier, work, models["model"], args)
    finally:
        tier.stop()
    rows += native_rows(work, models["model"], args)
    results = {"tokens": args.tokens, "prompts": args.prompts, "layers": len(vt.MOE_LAYERS), "rows": rows,
               "tier_vs_in_process": (find(rows, "tier", 1)["tokens_per_s"]
                                      / find(rows, "in_process", 1)["tokens_per_s"])}
    return harness.report(args, results, record, markdown, index_rows)


def one_peer(tier: vt.Tier, folder: Path, model: Path, args: Any, engine: dict | None = None) -> dict:
    """One engine on a session of its own."""
    with tier.session(folder, peers=1, max_tokens=64) as s:
        specs = alike([{"ticket": str(s["ticket"])}], args.prompts, args.tokens)
        return decode(tier, folder / "run", model, specs, engine=engine)


def compiled_rows(tier: vt.Tier, work: Path, model: Path, args: Any) -> list[dict[str, Any]]:
    """One engine on the tier: compiled (vLLM's default) and eager in turns, ``args.rounds`` each
    (their ratio is noisy here: the median of the rounds' ratios judges it); then at TP 2."""
    runs: dict[str, list[dict[str, Any]]] = {"tier": [], "tier_eager": []}
    for i in range(args.rounds):
        for mode, engine in (("tier", None), ("tier_eager", {"enforce_eager": True})):
            runs[mode].append(one_peer(tier, work / f"{mode}{i}", model, args, engine))
    out = [row(mode, 1, [r], True) | {"round": i} for mode in runs for i, r in enumerate(runs[mode])]
    tp2 = one_peer(tier, work / "tier_tp2", model, args, {"tensor_parallel_size": 2})
    return [*out, row("tier_tp2", 1, [tp2], True)]


def shared_rows(tier: vt.Tier, work: Path, model: Path, args: Any) -> list[dict[str, Any]]:
    """K engines on one elastic session, and the same engines on sessions of their own in turns."""
    rows = []
    for k, core in [(k, CORE_IN_PROCESS) for k in ENGINES] + [(ENGINES[0], CORE_OWN_PROCESS)]:
        name = f"{k}-{core.replace(' ', '-')}"
        with tier.session(work / f"shared{name}", peers=k, idle_after_s=IDLE_AFTER_S, max_tokens=64) as s:
            latent = [{"ticket": str(s["ticket"]), "peer": i} for i in range(k)]
            specs = alike(latent, args.prompts, args.tokens)
            shared = decode(tier, work / f"shared{name}" / "run", model, specs, core)
        rows.append(row("shared", k, [shared], True, core))
        turns = []
        for i in range(k):
            with tier.session(work / f"separate{name}-{i}", peers=1, max_tokens=64) as s:
                specs = alike([{"ticket": str(s["ticket"])}], args.prompts, args.tokens)
                turns.append(decode(tier, work / f"separate{name}-{i}" / "run", model, specs, core))
        rows.append(row("separate", k, turns, False, core))
    return rows


def serve_decode(tier: vt.Tier, folder: Path, model: Path, latent: list[dict], args: Any) -> dict[str, Any]:
    """One `vllm serve` server per ``latent`` setting, each answering its prompts at once, all
    servers released together once each has answered a first completion."""
    folder.mkdir(parents=True, exist_ok=True)
    servers = [vt.start_server(model, s, folder / f"server{i}.log") for i, s in enumerate(latent)]

    def one(i: int) -> dict[str, Any]:
        start = time.perf_counter()
        with ThreadPoolExecutor(args.prompts) as pool:
            answers = list(pool.map(lambda p: vt.complete(servers[i][1], model, p, args.tokens),
                                    prompts(args.prompts, i)))
        return {"seconds": time.perf_counter() - start,
                "tokens": [a["choices"][0]["text"].split() for a in answers]}

    try:
        for i, (server, port) in enumerate(servers):
            vt.first_answer(server, port, model, [5], 1, folder / f"server{i}.log")
        with ThreadPoolExecutor(len(servers)) as pool:
            return timed(tier, lambda: list(pool.map(one, range(len(servers)))))
    finally:
        for server, _ in servers:
            vt.stop(server)


def serve_rows(tier: vt.Tier, work: Path, model: Path, args: Any) -> list[dict[str, Any]]:
    """2 `vllm serve` engines (their engine core always a process apart) on one elastic session,
    then each on a session of its own, in turns."""
    with tier.session(work / "serve-shared", peers=2, idle_after_s=IDLE_AFTER_S, max_tokens=64) as s:
        shared = serve_decode(tier, work / "serve-shared" / "run", model,
                              [{"ticket": str(s["ticket"]), "peer": i} for i in range(2)], args)
    turns = []
    for i in range(2):
        with tier.session(work / f"serve-separate{i}", peers=1, max_tokens=64) as s:
            turns.append(serve_decode(tier, work / f"serve-separate{i}" / "run", model,
                                      [{"ticket": str(s["ticket"])}], args))
    return [row("serve_shared", 2, [shared], True, CORE_OWN_PROCESS),
            row("serve_separate", 2, turns, False, CORE_OWN_PROCESS)]


def idle_rows(tier: vt.Tier, work: Path, model: Path, args: Any) -> list[dict[str, Any]]:
    """Engine 0 decodes its prompts 3 times over; engine 1 decodes one prompt ``BURSTS`` times,
    idle ``PAUSE_S`` after each: on one elastic session (``IDLE_STALL_S``), with vLLM's scheduler
    and with the plugin's, which tells the session when its engine's requests run out."""
    rows = []
    for mode, engine in (("idle_vllm", None), ("idle_tier", {"scheduler_cls": IDLE_SCHEDULER})):
        with tier.session(work / mode, peers=2, idle_after_s=IDLE_STALL_S, max_tokens=64) as s:
            busy, idling = ({"ticket": str(s["ticket"]), "peer": i} for i in range(2))
            specs = [(busy, prompts(args.prompts, 0), args.tokens, {"bursts": 3}),
                     (idling, prompts(1, 1), 4, {"bursts": BURSTS, "pause_s": PAUSE_S})]
            run = decode(tier, work / mode / "run", model, specs, engine=engine)
            [state] = vt.open_sessions(tier)
        rows.append(row(mode, 2, [run], True) | {"parked": state["parked"], "idled": state["idled"],
                                                 "busy_engine_s": run["seconds"][0]})
    return rows


def native_rows(work: Path, model: Path, args: Any) -> list[dict[str, Any]]:
    """The tiny model as the Qwen3-MoE it is: vLLM's own class alone, and the plugin on a tier
    serving the folder's own MoE layers (tail auto: a model folder has one fixed plan)."""
    alone = decode(None, work / "native", model, alike([{}], args.prompts, args.tokens),
                   engine={"hf_overrides": {"architectures": ["Qwen3MoeForCausalLM"]}})
    served = vt.Tier(model, work / "native-tier", {"tail": "auto"})
    try:
        on_tier = one_peer(served, work / "native-on-tier", model, args)
    finally:
        served.stop()
    return [row("native_vllm", 1, [alone], True), row("native_tier", 1, [on_tier], True)]


def find(rows: list[dict[str, Any]], mode: str, engines: int, core: str | None = None) -> dict[str, Any]:
    """The row; for a mode run in rounds, its median-tokens/s round."""
    found = sorted((r for r in rows if (r["mode"], r["engines"]) == (mode, engines)
                    and core in (None, r["core"])), key=lambda r: r["tokens_per_s"])
    return found[len(found) // 2]


def compiled_vs_eager(rows: list[dict[str, Any]]) -> float:
    """The median over rounds of compiled / eager tokens/s of one engine on the tier."""
    pairs = zip(*([r for r in rows if r["mode"] == m] for m in ("tier", "tier_eager")), strict=True)
    return statistics.median(c["tokens_per_s"] / e["tokens_per_s"] for c, e in pairs)


def engine_steps(results: dict[str, Any]) -> float:
    """One engine's model steps: the lone engine on the tier made one group forward per MoE layer
    per step."""
    return find(results["rows"], "tier", 1)["forwards"] / results["layers"]


def forwards_per_step(r: dict[str, Any]) -> float | None:
    return r["forwards"] / r["steps"] if r["forwards"] is not None and r["steps"] else None


def engines_per_step(results: dict[str, Any], r: dict[str, Any]) -> float | None:
    """Engines whose step a group step carried, on average (K: every step shared by all)."""
    return r["engines"] * engine_steps(results) / r["steps"] if r["steps"] else None


def stall_s(r: dict[str, Any]) -> float:
    """Seconds the busy engine's step starts waited for an idle one: each park waited IDLE_STALL_S."""
    return r["parked"] * IDLE_STALL_S


def targets_of(results: dict[str, Any]) -> dict[str, Any]:
    rows, layers, out = results["rows"], results["layers"], {}
    out["compiled_vs_eager"] = verdict(compiled_vs_eager(rows), ">=", 1.3)
    for k in ENGINES:
        shared, separate = (find(rows, m, k, CORE_IN_PROCESS) for m in ("shared", "separate"))
        out[f"forwards_per_step_{k}"] = verdict(forwards_per_step(shared), "<=", float(layers))
        out[f"shared_vs_separate_{k}"] = verdict(shared["tokens_per_s"] / separate["tokens_per_s"], ">=", 1.0)
    before, after = (stall_s(find(rows, m, 2)) for m in ("idle_vllm", "idle_tier"))
    out["idle_stall_removed"] = verdict(1 - after / before if before else None, ">=", 0.9)
    return out


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    t, rows, cpus = targets_of(results), results["rows"], results["machine"]["cpus"]
    head = section_start("## vLLM engines on the tier", "vllm_engines", results["argv"], results["machine"],
                         f"{results['prompts']} prompts x {results['tokens']} tokens per engine, tiny model "
                         f"and tier (TP 2, float32), {results['layers']} MoE layers", json_path)
    cells = ([r["mode"], r["engines"], r["core"], r["tokens"], f"{r['decode_s']:.2f}",
              f"{r['tokens_per_s']:.1f}", f"{r['cores_busy']:.2f} of {cpus}", dash(r["forwards"]),
              dash(r["steps"]), dash(forwards_per_step(r), ".2f"),
              dash(engines_per_step(results, r) if "shared" in r["mode"] else None, ".2f")] for r in rows)
    ratio = {(a, b): find(rows, a, 1)["tokens_per_s"] / find(rows, b, 1)["tokens_per_s"]
             for a, b in (("tier_tp2", "tier"), ("native_tier", "native_vllm"))}
    k, idle = ENGINES[0], {m: find(rows, m, 2) for m in ("idle_vllm", "idle_tier")}
    own = {m: find(rows, f"{m}shared", k, CORE_OWN_PROCESS)["tokens_per_s"]
           / find(rows, f"{m}separate", k, CORE_OWN_PROCESS)["tokens_per_s"] for m in ("", "serve_")}
    lines = [head, "", *table("mode | engines | engine core | tokens | decode s | tokens/s | machine "
                              "cores busy | group forwards | group steps | forwards per step | engines per "
                              "group step", cells, "lrlrrrrrrrr"), "",
             f"- One engine on the tier: {results['tier_vs_in_process']:.2f}x the tokens/s of in-process.",
             "- Compiled / eager on the tier, median of the rounds: "
             f"{verdict_text(t['compiled_vs_eager'], unit='x')}.",
             f"- TP 2 / TP 1 engine tokens/s: {ratio['tier_tp2', 'tier']:.2f}x on {cpus} cores.",
             f"- native_tier / native_vllm tokens/s: {ratio['native_tier', 'native_vllm']:.2f}x.",
             f"- Each engine makes {engine_steps(results):.0f} model steps."]
    for k in ENGINES:
        lines.append(f"- {k} engines on one session: group forwards per step "
                     f"{verdict_text(t[f'forwards_per_step_{k}'])}; shared / separate tokens/s "
                     f"{verdict_text(t[f'shared_vs_separate_{k}'])}.")
    before, after = idle["idle_vllm"], idle["idle_tier"]
    lines += [f"- Engine core apart, 2 engines shared / separate tokens/s: `LLM` {own['']:.2f}x, "
              f"`vllm serve` {own['serve_']:.2f}x.",
              f"- Idle stall ({IDLE_STALL_S:g} s per wait): vLLM's scheduler {before['parked']} waits, "
              f"{stall_s(before):.2f} s (busy engine's decode {before['busy_engine_s']:.2f} s); the plugin's "
              f"{after['parked']} waits, {stall_s(after):.2f} s, {after['idled']} idle notices "
              f"({after['busy_engine_s']:.2f} s); stall removed "
              f"{verdict_text(t['idle_stall_removed'])}."]
    return "\n".join(lines)


def dash(value: float | None, spec: str = "") -> str:
    return "-" if value is None else format(value, spec)


def index_rows(results: dict[str, Any]) -> list[Target]:
    t, layers = targets_of(results), results["layers"]
    rows = []
    for k in ENGINES:
        rows.append(target(f"{k} engines, one session: group forwards per step (MoE layers {layers})",
                           t[f"forwards_per_step_{k}"]))
        rows.append(target(f"{k} engines: shared / separate sessions tokens/s", t[f"shared_vs_separate_{k}"],
                           unit="x"))
    rows.append(target("one engine on the tier: compiled / eager tokens/s (median of rounds)",
                       t["compiled_vs_eager"], unit="x"))
    rows.append(target("an engine out of requests: fraction of the others' idle stall removed",
                       t["idle_stall_removed"]))
    rows.append(target("every engine decoded", all(r["tokens"] > 0 for r in results["rows"])))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "vllm_engines")
    ap.add_argument("--tokens", type=int, default=64, help="tokens each prompt decodes (default 64)")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per engine (default 4)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of compiled / eager (default 3)")
    return measure(ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
