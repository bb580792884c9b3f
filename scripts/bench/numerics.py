"""Numerics: what each routed-input mode, the W4A4 emulation under both MXFP4 scale rules and the bf16
collectives do to the layer output on a real TP group (error against the single-device fp32 layer,
and a request's dependence on its batch), and where the two scale rules quantise a block differently.
The page says more. Target: W4A4 with the routed input off or exact MXFP4: no batch dependence.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from moe_runtime import mxfp4
from moe_runtime.checkpoint import load_layer_weights
from moe_runtime.config import LatentMoEConfig
from moe_runtime.layer import moe_forward
from moe_runtime.tp.collectives import Collectives
from moe_runtime.tp.local_group import run_local_group
from moe_runtime.tp.plan import TailPlan
from moe_runtime.tp.routed_input import RoutedInputConfig
from moe_runtime.tp.runner import build_rank_runners
from moe_runtime.units import SCALE_RULES, SERVED_DTYPES, torch_dtype

from . import harness
from .docs import Target, model_text, section_start, table, target, target_lines, verdict

SECTION = ("# Numerics: routed-input modes and W4A4 under both MXFP4 scale rules "
           "(`scripts/bench/numerics.py`)")
LAYER = 1
REQUEST = 16  # the request whose batch dependence is measured
DTYPES = {name: torch_dtype(name) for name in SERVED_DTYPES}
RULES = SCALE_RULES  # ("even", "floor"): even first, the default
RANDOM_BLOCKS = 8228  # as many random-normal blocks as the first measurement of the two rules had
SEED = 11  # of the input rows


def _rank(comm: Collectives, dense: str, packed: str, batch: int, tail: str) -> dict:
    cfg = LatentMoEConfig.from_pretrained(dense)
    x = harness.seeded_randn(batch, cfg.hidden_size, SEED)
    plan = TailPlan.single(tail, "bench")
    out = {}

    def run(key, dtype, path, act="none", rule="even"):  # key: dtype, experts, routed-input mode, rule
        ri = None if key[2] == "off" else RoutedInputConfig(True, key[2], REQUEST + 1)
        r = build_rank_runners(path, cfg, [LAYER], comm, plan, dtype=dtype, routed_input=ri,
                               experts_activation_quant=act, mxfp4_scale_rule=rule)[LAYER]
        out[(*key, "batch")] = r.forward(x.to(dtype))
        out[(*key, "request")] = r.forward(x[:REQUEST].to(dtype))

    # min_sharded_tokens between the request and the batch: the batch is token-sharded, the
    # request alone is not.
    for dname, dtype in DTYPES.items():
        for mode in ("off", "none", "fp8-approx", "mxfp4-approx"):
            for rule in RULES if mode == "mxfp4-approx" else ("-",):
                run((dname, "dense", mode, rule), dtype, dense, rule="even" if rule == "-" else rule)
        run((dname, "w4a16", "off", "-"), dtype, packed)
        for mode in ("off", "mxfp4"):
            for rule in RULES:
                run((dname, f"w4a4-{rule}", mode, rule), dtype, packed, "mxfp4", rule)
    return out


def _err(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    d, ref = got.float() - ref.float(), ref.float()
    return {"max_rel": d.abs().max().item() / ref.abs().max().item(),
            "rms_rel": (d.pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()}


def _block_stats(tensors: list[torch.Tensor]) -> dict[str, Any]:
    """Over every non-zero 32-block of ``tensors`` (fp32): how many the two rules quantise differently,
    and each rule's error (the worst block's, the RMS over all; the page says which)."""
    flat = torch.cat([t.float().reshape(-1, mxfp4.BLOCK) for t in tensors])
    flat = flat[flat.abs().amax(-1) > 0]
    q = {rule: mxfp4.quantize_dequantize(flat, rule) for rule in RULES}
    return {"blocks": flat.shape[0], "differ": int((q["even"] != q["floor"]).any(-1).sum()),
            **{rule: {"worst_block": ((flat - q[rule]).abs().amax(-1) / flat.abs().amax(-1)).max().item(),
                      "rms_rel": ((flat - q[rule]).pow(2).mean().sqrt() / flat.pow(2).mean().sqrt()).item()}
               for rule in RULES}}


class Recording:
    """An ``act_quant`` that quantises by ``rule`` and keeps every tensor it was given."""

    def __init__(self, rule: str):
        self.rule, self.seen = rule, []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.seen.append(t.detach().clone())
        return mxfp4.quantize_dequantize(t, self.rule)


def single_device(ckpts: dict[str, str], cfg: LatentMoEConfig, x: torch.Tensor) -> tuple[dict, dict]:
    """fp32 one-device truths (dense, W4A16, W4A4 per rule) and the block statistics."""
    truth = {"dense": moe_forward(x, load_layer_weights(ckpts["dense"], cfg, LAYER, torch.float32), cfg)}
    w = load_layer_weights(ckpts["mxfp4"], cfg, LAYER, torch.float32)
    truth["w4a16"] = moe_forward(x, w, cfg)
    seen = {}
    for rule in RULES:
        rec = Recording(rule)
        truth[f"w4a4-{rule}"] = moe_forward(x, w, cfg, act_quant=rec)
        seen[rule] = rec.seen
    # The experts quantise h first, then each active expert's gated activation (experts/base.py);
    # the rule changes the activations after h, so the statistics take the even run's tensors.
    rand = torch.randn(RANDOM_BLOCKS, mxfp4.BLOCK, generator=torch.Generator().manual_seed(0))
    return truth, {"random normal": _block_stats([rand]), "latent h": _block_stats(seen["even"][:1]),
                   "gated activations": _block_stats(seen["even"][1:])}


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "numerics", tp=2)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--tail", default="sharded")
    args = ap.parse_args(argv)
    ckpts = {kind: str(harness.preset_checkpoint(args.preset, mxfp4=kind == "mxfp4"))
             for kind in ("dense", "mxfp4")}
    cfg = LatentMoEConfig.from_pretrained(ckpts["dense"])
    machine, start = harness.machine_record(), time.perf_counter()
    print(f"TP {args.tp}, batch {args.batch}, request {REQUEST}, tail {args.tail} ...", flush=True)
    got = run_local_group(args.tp, _rank, ckpts["dense"], ckpts["mxfp4"], args.batch, args.tail,
                          timeout_s=3600)[0]
    x = harness.seeded_randn(args.batch, cfg.hidden_size, SEED)
    truth, blocks = single_device(ckpts, cfg, x)
    rows = []
    for dname, dtype in DTYPES.items():
        w = load_layer_weights(ckpts["dense"], cfg, LAYER, dtype)
        rows.append({"dtype": dname, "experts": "dense", "case": "single device", "routed_input": "off",
                     "rule": "-", **_err(moe_forward(x.to(dtype), w, cfg), truth["dense"]),
                     "batch_dependence": None})
        for (dn, experts, mode, rule, which), out in got.items():
            if (dn, which) == (dname, "batch"):
                alone = got[(dn, experts, mode, rule, "request")].float()
                dep = (out[:REQUEST].float() - alone).abs().max().item() / alone.abs().max().item()
                rows.append({"dtype": dname, "experts": experts.split("-")[0], "case": f"TP {args.tp}",
                             "routed_input": mode, "rule": rule, **_err(out, truth[experts]),
                             "batch_dependence": dep})
    machine["seconds"] = round(time.perf_counter() - start, 1)
    results = {"model": harness.model_record(cfg), "preset": args.preset, "tp": args.tp, "batch": args.batch,
               "request": REQUEST, "tail": args.tail, "blocks": blocks, "rows": rows, "single_device_fp32": {
                   **{f"w4a4 {rule} vs w4a16": _err(truth[f"w4a4-{rule}"], truth["w4a16"]) for rule in RULES},
                   "w4a4 even vs w4a4 floor": _err(truth["w4a4-even"], truth["w4a4-floor"]),
                   "w4a16 vs dense": _err(truth["w4a16"], truth["dense"])}}
    return harness.report(args, results, machine, markdown, index_rows)


def index_rows(results: dict[str, Any]) -> list[Target]:
    """A request's output never depends on its batch under W4A4 with the exact MXFP4 routed input."""
    return [target(f"W4A4 batch dependence (routed input off or exact MXFP4), rule {rule}",
                   verdict(max(r["batch_dependence"] for r in results["rows"]
                               if r["experts"] == "w4a4" and r["rule"] == rule), "<=", 0.0), ".1e")
            for rule in RULES]


def markdown(results: dict[str, Any], json_path: str, png_path: str) -> str:
    env, m, b, sd = results["machine"], results["model"], results["blocks"], results["single_device_fp32"]
    what = (f"{env['seconds']} s (the numbers below are exact and deterministic, load changes only the "
            f"time); `{results['preset']}` preset ({model_text(m)}, random weights), layer {LAYER}, batch "
            f"{results['batch']}")
    even, floor = sd["w4a4 even vs w4a16"]["rms_rel"], sd["w4a4 floor vs w4a16"]["rms_rel"]
    return "\n".join([
        section_start(SECTION, "numerics", results["argv"], env, what, json_path), "",
        "**Where the two MXFP4 scale rules differ**, per non-zero 32-block:", "",
        *table("tensor (fp32) | blocks | quantised differently | worst block, even | floor "
               "| rms rel error, even | floor",
               ([name, s["blocks"], f"{s['differ']} ({s['differ'] / s['blocks']:.1%})",
                 f"{s['even']['worst_block']:.3f}", f"{s['floor']['worst_block']:.3f}",
                 f"{s['even']['rms_rel']:.4f}", f"{s['floor']['rms_rel']:.4f}"] for name, s in b.items()),
               "lrrrrrr"), "",
        "**W4A4 against W4A16, one device, fp32**:", "",
        *table("comparison | max rel | rms rel",
               ([name, f"{e['max_rel']:.2e}", f"{e['rms_rel']:.2e}"] for name, e in sd.items()), "lrr"), "",
        f"**On a TP {results['tp']} gloo group** (tail `{results['tail']}`, min_sharded_tokens "
        f"{results['request'] + 1}; batch dependence: a {results['request']}-token request alone against the "
        "same rows inside the batch):", "",
        *table("dtype | experts | MXFP4 rule | routed input | max rel error | rms rel error "
               "| batch dependence", map(case_cells, results["rows"]), "llllrrr"), "",
        *target_lines(index_rows(results)),
        f"- W4A4 is {'closer to' if even < floor else 'further from'} W4A16 under the production rule `even` "
        f"than under `floor`: rms {even:.1%} against {floor:.1%}."])


def case_cells(r: dict[str, Any]) -> list[Any]:
    mode = "mxfp4 (exact, deferred)" if r["routed_input"] == "mxfp4" else r["routed_input"]
    mode, dep = "off, single device" if r["case"] == "single device" else mode, r["batch_dependence"]
    return [r["dtype"], r["experts"], r["rule"], mode, f"{r['max_rel']:.1e}", f"{r['rms_rel']:.1e}",
            "-" if dep is None else "0" if dep == 0 else f"{dep:.1e}" if dep < 1e-3 else f"**{dep:.1e}**"]


if __name__ == "__main__":
    raise SystemExit(main())
