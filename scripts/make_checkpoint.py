"""Write a deterministic Kimi-K3-format checkpoint: tiny/medium (tests), small (benchmarks),
kimi-k3 (real size: ~15.7 GB per MoE layer as MXFP4; use --moe-layers to write only a few)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from examples.synthetic_decoder import write_decoder  # noqa: E402
from moe_runtime.synthetic import PRESETS, preset_config, write_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--mxfp4", action="store_true", help="store routed experts as MXFP4")
    ap.add_argument("--layers", type=int, help="num_hidden_layers (layer 0 stays dense)")
    ap.add_argument("--moe-layers", type=int, help="write only the first N MoE layers (config unchanged)")
    ap.add_argument(
        "--shard-gb", type=float,
        help="shard files of about this many GB (default: one file per layer; 2 for kimi-k3)",
    )
    ap.add_argument(
        "--random-codes", action=argparse.BooleanOptionalAction,
        help="MXFP4 experts as random codes + fan-in scales instead of encoded Gaussians "
        "(~10x faster; default on for kimi-k3 only, so small presets keep their numbers)",
    )
    ap.add_argument("--shared-mxfp4", action="store_true", help="store shared experts as MXFP4 too")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true", help="write only config.json")
    ap.add_argument("--single-file", action="store_true", help="one model.safetensors, no index")
    ap.add_argument("--text-only", action="store_true", help="text-only layout (model.layers.*)")
    ap.add_argument("--decoder", action="store_true",
                    help="also write the client-side decoder (embedding, attention, dense layer, LM head) "
                         "for examples/afd_demo.py; see examples/synthetic_decoder.py")
    args = ap.parse_args(argv)
    if args.decoder and args.config_only:
        ap.error("--decoder writes weights; it cannot go with --config-only")
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    try:
        raw = preset_config(args.preset, **overrides)
    except ValueError as exc:
        ap.error(str(exc))
    big = args.preset == "kimi-k3"
    shard_gb = args.shard_gb if args.shard_gb is not None else (2.0 if big else None)
    if shard_gb is not None and shard_gb <= 0:
        ap.error(f"--shard-gb must be positive, got {shard_gb}")
    if args.moe_layers is not None and args.moe_layers < 1:
        ap.error(f"--moe-layers must be >= 1, got {args.moe_layers}")
    out = write_checkpoint(
        args.out,
        raw,
        use_mxfp4=args.mxfp4,
        moe_layers=args.moe_layers,
        shard_bytes=None if shard_gb is None else int(shard_gb * 1e9),
        random_codes=big if args.random_codes is None else args.random_codes,
        shared_mxfp4=args.shared_mxfp4,
        seed=args.seed,
        single_file=args.single_file,
        text_only=args.text_only,
        config_only=args.config_only,
        progress=True,
    )
    if args.decoder:
        write_decoder(out, seed=args.seed)
    what = "config.json" if args.config_only else "checkpoint"
    print(f"wrote {args.preset} {what} to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
