"""Write a deterministic Kimi-K3-format checkpoint: tiny (tests), small (benchmarks), kimi-k3."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_runtime.synthetic import PRESETS, preset_config, write_checkpoint  # noqa: E402
from moe_runtime.synthetic_decoder import write_decoder  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--mxfp4", action="store_true", help="store routed experts as MXFP4")
    ap.add_argument("--layers", type=int, help="num_hidden_layers (layer 0 stays dense)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config-only", action="store_true", help="write only config.json")
    ap.add_argument("--single-file", action="store_true", help="one model.safetensors, no index")
    ap.add_argument("--text-only", action="store_true", help="text-only layout (model.layers.*)")
    ap.add_argument("--decoder", action="store_true",
                    help="also write the client-side decoder (embedding, attention, dense layer, LM head) "
                         "for scripts/afd_demo.py; see moe_runtime/synthetic_decoder.py")
    args = ap.parse_args(argv)
    if args.decoder and args.config_only:
        ap.error("--decoder writes weights; it cannot go with --config-only")
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    try:
        raw = preset_config(args.preset, **overrides)
    except ValueError as exc:
        ap.error(str(exc))
    out = write_checkpoint(
        args.out,
        raw,
        use_mxfp4=args.mxfp4,
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
