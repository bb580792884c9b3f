"""Numerics benchmark (issue 11): what each routed-input mode, the W4A4 emulation and the bf16
collectives do to the layer output, measured on a real TP group.

For every case it reports the error against the single-device fp32 layer (``max |out - ref|
/ max |ref|`` and the relative RMS) and, for the routed-input modes, **batch dependence**: a
16-token request computed alone (below ``min_sharded_tokens``, so never token-sharded) against
the same 16 rows inside a large batch. The exact modes give 0 there by design; the
``*-approx`` modes do not. Writes JSON + PNG under ``--out``; the table goes to
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from moe_runtime import mxfp4  # noqa: E402
from moe_runtime.checkpoint import load_layer_weights  # noqa: E402
from moe_runtime.config import LatentMoEConfig  # noqa: E402
from moe_runtime.layer import moe_forward  # noqa: E402
from moe_runtime.synthetic import preset_config, write_checkpoint  # noqa: E402
from moe_runtime.tp.collectives import Collectives  # noqa: E402
from moe_runtime.tp.local_group import run_local_group  # noqa: E402
from moe_runtime.tp.plan import TailPlan  # noqa: E402
from moe_runtime.tp.routed_input import RoutedInputConfig  # noqa: E402
from moe_runtime.tp.runner import build_rank_runners  # noqa: E402

LAYER = 1
REQUEST = 16  # the request whose batch dependence is measured
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_input(T: int, H: int) -> torch.Tensor:
    return torch.randn(T, H, generator=torch.Generator().manual_seed(11))


def _rank(comm: Collectives, dense: str, packed: str, batch: int, tail: str) -> dict:
    cfg = LatentMoEConfig.from_pretrained(dense)
    x = make_input(batch, cfg.hidden_size)
    plan = TailPlan.single(tail, "bench")
    out = {}
    # min_sharded_tokens between the request and the batch: the batch is token-sharded, the
    # request alone is not.
    for dname, dtype in DTYPES.items():
        for mode in ("off", "none", "fp8-approx", "mxfp4-approx"):
            ri = None if mode == "off" else RoutedInputConfig(True, mode, REQUEST + 1)
            r = build_rank_runners(dense, cfg, [LAYER], comm, plan, dtype=dtype, routed_input=ri)[LAYER]
            out[(dname, "dense", mode, "batch")] = r.forward(x.to(dtype))
            out[(dname, "dense", mode, "request")] = r.forward(x[:REQUEST].to(dtype))
        for act, mode in (("none", "off"), ("mxfp4", "off"), ("mxfp4", "mxfp4")):
            ri = None if mode == "off" else RoutedInputConfig(True, mode, REQUEST + 1)
            r = build_rank_runners(
                packed, cfg, [LAYER], comm, plan, dtype=dtype, routed_input=ri, experts_activation_quant=act
            )[LAYER]
            key = "w4a16" if act == "none" else "w4a4"
            out[(dname, key, mode, "batch")] = r.forward(x.to(dtype))
            out[(dname, key, mode, "request")] = r.forward(x[:REQUEST].to(dtype))
    return out


def _err(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    d = got.float() - ref.float()
    return {
        "max_rel": d.abs().max().item() / ref.abs().max().item(),
        "rms_rel": (d.pow(2).mean().sqrt() / ref.float().pow(2).mean().sqrt()).item(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--tail", default="sharded")
    ap.add_argument("--out", type=Path, default=Path("artifacts/bench_numerics"))
    args = ap.parse_args(argv)
    ckpts = {}
    for kind in ("dense", "mxfp4"):
        path = Path(f"artifacts/checkpoints/{args.preset}" + ("" if kind == "dense" else "-mxfp4"))
        if not (path / "config.json").is_file():
            write_checkpoint(path, preset_config(args.preset), use_mxfp4=kind == "mxfp4", progress=True)
        ckpts[kind] = str(path)
    cfg = LatentMoEConfig.from_pretrained(ckpts["dense"])
    load_before = os.getloadavg()
    print(f"TP {args.tp}, batch {args.batch}, request {REQUEST}, tail {args.tail} ...", flush=True)
    got = run_local_group(
        args.tp, _rank, ckpts["dense"], ckpts["mxfp4"], args.batch, args.tail, timeout_s=3600
    )[0]
    x = make_input(args.batch, cfg.hidden_size)
    truth = {}  # single-device fp32 layers: the dense one, W4A16 and W4A4 on the MXFP4 weights
    for kind, path in ckpts.items():
        w = load_layer_weights(path, cfg, LAYER, torch.float32)
        truth["dense" if kind == "dense" else "w4a16"] = moe_forward(x, w, cfg)
        if kind == "mxfp4":
            truth["w4a4"] = moe_forward(x, w, cfg, act_quant=mxfp4.quantize_dequantize)
    rows = []
    for dname, dtype in DTYPES.items():
        w = load_layer_weights(ckpts["dense"], cfg, LAYER, dtype)
        rows.append(
            {
                "dtype": dname,
                "experts": "dense",
                "case": "single device",
                "routed_input": "off",
                **_err(moe_forward(x.to(dtype), w, cfg), truth["dense"]),
                "batch_dependence": None,
            }
        )
        for (dn, experts, mode, which), out in got.items():
            if dn != dname or which != "batch":
                continue
            alone = got[(dn, experts, mode, "request")]
            dep = (
                out[:REQUEST].float() - alone.float()
            ).abs().max().item() / alone.float().abs().max().item()
            rows.append(
                {
                    "dtype": dname,
                    "experts": experts,
                    "case": f"TP {args.tp}",
                    "routed_input": mode,
                    **_err(out, truth[experts]),
                    "batch_dependence": dep,
                }
            )
    w4a4_vs_w4a16 = _err(truth["w4a4"], truth["w4a16"])
    result = {
        "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "preset": args.preset,
        "tp": args.tp,
        "batch": args.batch,
        "request": REQUEST,
        "tail": args.tail,
        "rows": rows,
        "w4a4_vs_w4a16_fp32": w4a4_vs_w4a16,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_numerics.json").write_text(json.dumps(result, indent=1))
    _plot(rows, args.out / "bench_numerics.png")
    print(
        f"\n{'dtype':<9} {'experts':<6} {'case':<14} {'routed input':<13} {'max rel':>9} {'rms rel':>9} "
        f"{'batch dep.':>10}"
    )
    for r in rows:
        dep = "-" if r["batch_dependence"] is None else f"{r['batch_dependence']:.2e}"
        print(
            f"{r['dtype']:<9} {r['experts']:<6} {r['case']:<14} {r['routed_input']:<13} "
            f"{r['max_rel']:>9.2e} {r['rms_rel']:>9.2e} {dep:>10}"
        )
    print(
        f"W4A4 vs W4A16 (fp32, single device): max rel {w4a4_vs_w4a16['max_rel']:.3e}, "
        f"rms rel {w4a4_vs_w4a16['rms_rel']:.3e}"
    )
    print(f"load average before {load_before}, after {result['machine']['loadavg_after']}")
    print(f"wrote {args.out / 'bench_numerics.json'} and {args.out / 'bench_numerics.png'}")
    return 0


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for ax, key, title in (
        (axes[0], "max_rel", "error vs fp32 single device"),
        (axes[1], "batch_dependence", "16-token request: alone vs in the batch"),
    ):
        sel = [r for r in rows if r[key] is not None]
        labels = [f"{r['dtype'][:4]} {r['experts']} {r['routed_input']}" for r in sel]
        ax.barh(labels, [max(r[key], 1e-9) for r in sel])
        ax.set(xscale="log", title=title, xlabel="max |diff| / max |ref|")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
