"""``python -m moe_runtime forward``: run one MoE layer on a safetensors input, on one
device or on P local gloo ranks."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .checkpoint import CheckpointReader, resolve_expert_formats
from .config import LatentMoEConfig
from .experts import DEFAULT_SCRATCH_BYTES, mxfp4_cpu, select_backend
from .inputs import not_floating
from .layer import check_input
from .planning import memory
from .planning.budget import DEFAULT_MEMORY_FRACTION, MI300X_MEMORY_GB, cpu_budget, gpu_budget
from .tp.collectives import Collectives
from .tp.local_group import run_local_group
from .tp.plan import REQUESTABLE_TAILS, TailPlan, resolve_tail, shardability_for
from .tp.routed_input import ACTIVATION_QUANT_MODES, REQUESTABLE_QUANT_MODES, RoutedInputConfig
from .tp.runner import build_rank_runners, check_activation_quant
from .units import (
    ACTIVATION_SCALE_RULE,
    EXPERT_FORMATS,
    GB,
    SCALE_RULES,
    check_mxfp4_scale_rule,
    gb,
    torch_dtype,
)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m moe_runtime", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    fw = sub.add_parser("forward", help="run one MoE layer")
    fw.add_argument("--checkpoint", required=True, type=Path)
    fw.add_argument("--layer", required=True, type=int)
    source = fw.add_mutually_exclusive_group()
    source.add_argument("--input", type=Path, help="safetensors with hidden_states [T, H] (+ router_logits)")
    source.add_argument(
        "--random-input", type=int, metavar="T",
        help="instead of --input: T tokens of seeded standard-normal hidden_states [T, H] in --dtype",
    )
    fw.add_argument("--seed", type=int, default=0, help="--random-input: the generator's seed")
    fw.add_argument("--output", type=Path, help="safetensors to write with output [T, H]")
    fw.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    fw.add_argument("--backend", default="auto", help="experts backend: auto, torch, grouped, aiter")
    fw.add_argument("--tp", type=int, default=1, help="TP size: local gloo ranks")
    fw.add_argument("--tail", choices=REQUESTABLE_TAILS, default="auto")
    fw.add_argument("--sequence-parallel", action="store_true")
    fw.add_argument("--preshard-up-proj", action="store_true", help="each rank stores H/P rows of Wup")
    fw.add_argument(
        "--routed-input-quant", choices=REQUESTABLE_QUANT_MODES,
        help="token-shard the routed input; what the all-gather carries (*-approx: lossy, batch-dependent)",
    )
    fw.add_argument(
        "--experts-activation-quant", choices=ACTIVATION_QUANT_MODES, default="none",
        help="mxfp4: W4A4 emulation of MXFP4 experts (what ROCm production runs)",
    )
    fw.add_argument(
        "--mxfp4-scale-rule", choices=SCALE_RULES, default=ACTIVATION_SCALE_RULE,
        help="block exponent of MXFP4 activations: even (AMD Quark's default, what vLLM's emulation and "
        "aiter's Triton quantiser use) or floor (the plain OCP rule, for comparison)",
    )
    fw.add_argument("--min-sharded-tokens", type=int, default=1)
    fw.add_argument("--repeat", type=int, default=1,
                    help="run the forward N times after loading; prints the first and the median time")
    fw.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    fw.add_argument(
        "--run-timeout", type=float, default=3600.0, help="whole TP run (load included), seconds"
    )
    fw.add_argument("--explain", action="store_true", help="print the tail decision and memory plan, exit")
    fw.add_argument("--device-memory-gb", type=float,
                    help="--explain: per-rank device memory in GB (default: this machine's GPU, or on "
                         "CPU its memory / --tp)")
    _memory_options(fw)
    pl = sub.add_parser("plan", help="split the MoE layers over TP groups that fit a device (memory)")
    pl.add_argument("--checkpoint", required=True, type=Path)
    pl.add_argument("--tp", type=int, default=8, help="TP size of each group")
    pl.add_argument("--dtype", choices=("float32", "bfloat16"), default="bfloat16")
    pl.add_argument("--preshard-up-proj", action="store_true")
    pl.add_argument("--device-memory-gb", type=float, default=MI300X_MEMORY_GB, help="per GPU, GB")
    pl.add_argument("--backend", default="auto",
                    help="experts backend the groups serve with (its own copies are planned; auto: the "
                         "largest of those it may pick on a GPU)")
    _memory_options(pl)
    return ap


def _memory_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--scratch-mb", type=float, default=DEFAULT_SCRATCH_BYTES / 2**20,
        help="per-rank budget for decoding the active MXFP4 experts, MiB",
    )
    p.add_argument("--memory-fraction", type=float, default=DEFAULT_MEMORY_FRACTION)
    p.add_argument("--experts-format", choices=EXPERT_FORMATS,
                   help="experts format of a config-only checkpoint (else read from its tensor names)")
    p.add_argument("--max-tokens", type=int, default=2048, help="memory: tokens of the largest forward")


def _rank_forward(
    comm: Collectives,
    ckpt: str,
    layer: int,
    plan: TailPlan,
    dtype_name: str,
    backend: str,
    preshard: bool,
    routed_input: RoutedInputConfig | None,
    scratch_bytes: int,
    experts_activation_quant: str,
    mxfp4_scale_rule: str,
    x,
    logits,
    repeat: int = 1,
) -> tuple[torch.Tensor, dict]:
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    runner = build_rank_runners(
        ckpt,
        cfg,
        [layer],
        comm,
        plan,
        dtype=torch_dtype(dtype_name),
        backend=backend,
        preshard_up_proj=preshard,
        routed_input=routed_input,
        scratch_bytes=scratch_bytes,
        progress=None if comm.rank == 0 else False,  # one bar, and only on a terminal
        experts_activation_quant=experts_activation_quant,
        mxfp4_scale_rule=mxfp4_scale_rule,
    )[layer]
    comm.loaded()  # wait for the slowest rank's load; only then does the collective timeout apply
    stats = {
        "load_s": runner.load_s,
        "bytes_read": runner.load_bytes_read,
        "resident_by_part": runner.resident_bytes_by_part(),
        "rss_after_load": process_rss(),
    }
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        out = runner.forward(x, logits)
        times.append(time.perf_counter() - start)
    stats["forward_s"], stats["forward_times_s"] = times[0], times
    stats["experts_path"] = f"{runner.experts_path} ({runner.experts_path_reason})"
    return out, stats


def process_rss(pid: int | str = "self") -> dict[str, int]:
    """This process's resident bytes from /proc: anonymous + shared memory (what loading
    costs; mapped checkpoint pages are reclaimable page cache) and the peak of all RSS."""
    fields = {"RssAnon": "anon", "RssShmem": "shmem", "VmHWM": "peak_total"}
    out = dict.fromkeys(fields.values(), 0)
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in fields:
                    out[fields[key]] = int(value.split()[0]) * 1024
    except OSError:  # not Linux: nothing to report
        pass
    return out


def _load_summary(rank: int, stats: dict) -> str:
    gb = 1e9
    parts = ", ".join(f"{k} {v / gb:.3f}" for k, v in stats["resident_by_part"].items() if v)
    rss = stats["rss_after_load"]
    return (
        f"rank {rank}: loaded in {stats['load_s']:.1f} s, read {stats['bytes_read'] / gb:.3f} GB "
        f"({stats['bytes_read'] / gb / max(stats['load_s'], 1e-9):.2f} GB/s), resident "
        f"{sum(stats['resident_by_part'].values()) / gb:.3f} GB ({parts}), RSS anon+shmem "
        f"{(rss['anon'] + rss['shmem']) / gb:.3f} GB, forward {stats['forward_s'] * 1e3:.1f} ms"
    )


def _read_input(path: Path, cfg: LatentMoEConfig, dtype: torch.dtype):
    if not path.is_file():
        raise ValueError(f"input file {path} does not exist")
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path} is not a readable safetensors file: {exc}") from exc
    if "hidden_states" not in tensors:
        raise ValueError(f"{path} has no tensor 'hidden_states' (found: {sorted(tensors)})")
    x = tensors["hidden_states"]
    if not x.is_floating_point():
        raise ValueError(not_floating("hidden_states", str(x.dtype)))
    x = x.to(dtype)
    logits = tensors.get("router_logits")
    check_input(x, cfg, dtype, logits)
    return x, logits


def random_input(tokens: int, cfg: LatentMoEConfig, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """``--random-input``: seeded standard-normal ``hidden_states [T, H]`` in ``dtype`` (drawn
    in float32, so a seed gives the same numbers, rounded, in every dtype)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"--random-input needs a positive token count, got {tokens!r}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cfg.hidden_size, generator=gen).to(dtype)
    check_input(x, cfg, dtype, None)
    return x


def explain_memory(args: argparse.Namespace, cfg: LatentMoEConfig) -> list[str]:
    """``--explain`` lines: the planner's bytes per rank by part for the layer, and headroom."""
    compute = "gpu"
    if args.device_memory_gb is not None:
        budget = gpu_budget(args.device_memory_gb, args.memory_fraction)
    elif torch.cuda.is_available():
        total_gb = torch.cuda.get_device_properties(0).total_memory / GB
        budget = gpu_budget(total_gb, args.memory_fraction)
    else:
        budget, compute = cpu_budget(args.tp, args.memory_fraction), "cpu"
    if resolve_expert_formats(cfg, [args.layer], args.checkpoint, args.experts_format) is None:
        return ["memory: not planned: the checkpoint holds no weights; give --experts-format"]
    plan = memory.plan_checkpoint(
        args.checkpoint, cfg, [args.layer], args.dtype, args.tp, args.preshard_up_proj, args.experts_format,
        max_tokens=args.max_tokens, scratch_bytes=int(args.scratch_mb * 2**20), budget=budget,
        experts_path=cli_experts_path(), backend=args.backend, compute=compute,
    )
    parts = ", ".join(f"{name} {gb(n)}" for name, n in plan.by_part.items() if n)
    return [
        f"memory per rank ({plan.formats[args.layer]} experts): {parts}",
        f"memory: {plan.arithmetic()}",
        f"memory fits: {plan.fits}",
    ]


def cli_experts_path() -> str:
    """How this process's ranks run packed experts: CPU ranks take the fused kernel when it builds."""
    if torch.cuda.is_available():
        return "decode"
    return "fused" if mxfp4_cpu.unavailable_reason() is None else "decode"


def plan_layers(args: argparse.Namespace) -> int:
    """``plan``: the planner's split of every MoE layer over TP groups of one device kind."""
    cfg = LatentMoEConfig.from_pretrained(args.checkpoint)
    formats = resolve_expert_formats(cfg, cfg.moe_layers, args.checkpoint, args.experts_format)
    if formats is None:
        raise ValueError(f"{args.checkpoint} holds no weights (config only): give --experts-format")
    split = memory.propose_split(
        cfg, formats, args.dtype, args.tp, gpu_budget(args.device_memory_gb, args.memory_fraction),
        args.preshard_up_proj, args.max_tokens, int(args.scratch_mb * 2**20), args.backend, "gpu",
    )
    print(split.describe())
    for plan in split.plans:
        print(f"  {plan.arithmetic()}")
    return 0


def forward(args: argparse.Namespace) -> int:
    cfg = LatentMoEConfig.from_pretrained(args.checkpoint)
    cfg.check_moe_layer(args.layer)
    dtype = torch_dtype(args.dtype)
    plan = resolve_tail(args.tail, cfg, args.tp, args.preshard_up_proj, args.sequence_parallel)
    routed_input, routed_quant = None, "none"
    if args.routed_input_quant is not None:
        routed_input = RoutedInputConfig(True, args.routed_input_quant, args.min_sharded_tokens)
        resolved = routed_input.resolve(args.experts_activation_quant, cfg.routed_expert_hidden_size)
        routed_quant = resolved.quant  # fail early
    check_mxfp4_scale_rule(args.mxfp4_scale_rule, args.experts_activation_quant, routed_quant)
    backend, backend_reason = select_backend(args.backend)
    scratch_bytes = int(args.scratch_mb * 2**20)
    if scratch_bytes < 1:
        raise ValueError(f"--scratch-mb must be positive, got {args.scratch_mb}")
    if args.explain:
        rule = shardability_for(cfg, args.tp, args.preshard_up_proj, args.sequence_parallel)
        print(f"TP size: {args.tp}")
        print(f"sharded tail legal: {rule.shardable} ({rule.reason})")
        print(f"tail plan: {plan.describe()}")
        print(f"reason: {plan.reason}")
        print(f"experts backend: {backend} ({backend_reason}; non-torch backends are probed at load)")
        print("\n".join(explain_memory(args, cfg)))
        return 0
    if args.repeat < 1:
        raise ValueError(f"--repeat must be at least 1, got {args.repeat}")
    if (args.input is None and args.random_input is None) or args.output is None:
        raise ValueError("forward needs --input (or --random-input T) and --output (or --explain)")
    reader = CheckpointReader(args.checkpoint)
    reader.layer_prefix(args.layer)  # fail before spawning ranks
    check_activation_quant(args.experts_activation_quant, cfg, args.tp, reader, [args.layer])
    if args.random_input is not None:
        x, logits = random_input(args.random_input, cfg, dtype, args.seed), None
    else:
        x, logits = _read_input(args.input, cfg, dtype)
    start = time.perf_counter()
    rank_args = (
        str(args.checkpoint),
        args.layer,
        plan,
        args.dtype,
        args.backend,  # as requested: each rank probes non-torch backends at load (auto falls back)
        args.preshard_up_proj,
        routed_input,
        scratch_bytes,
        args.experts_activation_quant,
        args.mxfp4_scale_rule,
        x,
        logits,
        args.repeat,
    )
    if args.tp == 1:
        results = [_rank_forward(Collectives(), *rank_args)]
        how = "single device"
    else:
        results = run_local_group(
            args.tp, _rank_forward, *rank_args, timeout_s=args.run_timeout, collective_timeout_s=args.timeout
        )
        how = f"TP {args.tp}, {plan.describe()}"
    outs = [out for out, _ in results]
    out = torch.cat(outs) if plan.tails == ("sequence_parallel",) else outs[0]
    elapsed = time.perf_counter() - start
    args.output.parent.mkdir(parents=True, exist_ok=True)
    save_file({"output": out.contiguous()}, args.output)
    print(
        f"layer {args.layer}: {x.shape[0]} tokens x {cfg.hidden_size} -> {args.output} "
        f"({how}; {elapsed * 1e3:.1f} ms including load)"
    )
    for rank, (_, stats) in enumerate(results):
        print(_load_summary(rank, stats))
    print(f"experts path: {results[0][1]['experts_path']}")
    print(forward_times_line(results[0][1]["forward_times_s"]))
    return 0


def forward_times_line(times_s: list[float]) -> str:
    """``forward ms: first F, median M over N`` (rank 0's forwards; the ranks run in lockstep)."""
    ms = sorted(t * 1e3 for t in times_s)
    n = len(ms)
    median = ms[n // 2] if n % 2 else (ms[n // 2 - 1] + ms[n // 2]) / 2
    return f"forward ms: first {times_s[0] * 1e3:.2f}, median {median:.2f} over {n}"


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return forward(args) if args.command == "forward" else plan_layers(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
