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

from .checkpoint import CheckpointReader, torch_dtype
from .collectives import Collectives
from .config import LatentMoEConfig
from .experts import DEFAULT_SCRATCH_BYTES, select_backend
from .layer import check_input
from .local_group import run_local_group
from .plan import REQUESTABLE_TAILS, TailPlan, resolve_tail, shardability_for
from .routed_input import ACTIVATION_QUANT_MODES, REQUESTABLE_QUANT_MODES, RoutedInputConfig
from .runner import build_rank_runners, check_activation_quant


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m moe_runtime", description=__doc__)
    sub = ap.add_subparsers(dest="command", required=True)
    fw = sub.add_parser("forward", help="run one MoE layer")
    fw.add_argument("--checkpoint", required=True, type=Path)
    fw.add_argument("--layer", required=True, type=int)
    fw.add_argument("--input", type=Path, help="safetensors with hidden_states [T, H] (+ router_logits)")
    fw.add_argument("--output", type=Path, help="safetensors to write with output [T, H]")
    fw.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    fw.add_argument("--backend", default="auto", help="experts backend: auto, torch, aiter")
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
    fw.add_argument("--min-sharded-tokens", type=int, default=1)
    fw.add_argument(
        "--scratch-mb", type=float, default=DEFAULT_SCRATCH_BYTES / 2**20,
        help="per-rank budget for decoding the active MXFP4 experts, MiB",
    )
    fw.add_argument("--timeout", type=float, default=60.0, help="collective timeout, seconds")
    fw.add_argument("--explain", action="store_true", help="print the tail decision and exit")
    return ap


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
    x,
    logits,
) -> torch.Tensor:
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
        experts_activation_quant=experts_activation_quant,
    )[layer]
    return runner.forward(x, logits)


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
        raise ValueError(f"hidden_states must be floating point, got {x.dtype}")
    x = x.to(dtype)
    logits = tensors.get("router_logits")
    check_input(x, cfg, dtype, logits)
    return x, logits


def forward(args: argparse.Namespace) -> int:
    cfg = LatentMoEConfig.from_pretrained(args.checkpoint)
    cfg.check_moe_layer(args.layer)
    dtype = torch_dtype(args.dtype)
    plan = resolve_tail(args.tail, cfg, args.tp, args.preshard_up_proj, args.sequence_parallel)
    routed_input = None
    if args.routed_input_quant is not None:
        routed_input = RoutedInputConfig(True, args.routed_input_quant, args.min_sharded_tokens)
        routed_input.resolve(args.experts_activation_quant, cfg.routed_expert_hidden_size)  # fail early
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
        print(f"experts backend: {backend} ({backend_reason})")
        return 0
    if args.input is None or args.output is None:
        raise ValueError("forward needs --input and --output (or --explain)")
    reader = CheckpointReader(args.checkpoint)
    reader.layer_prefix(args.layer)  # fail before spawning ranks
    check_activation_quant(args.experts_activation_quant, cfg, args.tp, reader, [args.layer])
    x, logits = _read_input(args.input, cfg, dtype)
    start = time.perf_counter()
    rank_args = (
        str(args.checkpoint),
        args.layer,
        plan,
        args.dtype,
        backend,
        args.preshard_up_proj,
        routed_input,
        scratch_bytes,
        args.experts_activation_quant,
        x,
        logits,
    )
    if args.tp == 1:
        out = _rank_forward(Collectives(), *rank_args)
        how = "single device"
    else:
        outs = run_local_group(args.tp, _rank_forward, *rank_args, collective_timeout_s=args.timeout)
        out = torch.cat(outs) if plan.tails == ("sequence_parallel",) else outs[0]
        how = f"TP {args.tp}, {plan.describe()}"
    elapsed = time.perf_counter() - start
    args.output.parent.mkdir(parents=True, exist_ok=True)
    save_file({"output": out.contiguous()}, args.output)
    print(
        f"layer {args.layer}: {x.shape[0]} tokens x {cfg.hidden_size} -> {args.output} "
        f"({how}; {elapsed * 1e3:.1f} ms including load)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return forward(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
