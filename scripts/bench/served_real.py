"""One served layer end to end: ``serve run`` of a generated config, time to ready, one POST, its
error against the CLI (same seeded input, TP size and dtype) and both process trees' peak memory.

    python -m scripts.bench.served_real --preset tiny --tp 2            # seconds of compute, ~1-2 min
    python -m scripts.bench.served_real --checkpoint /work/ckpt/k3-1layer --tp 2 --dtype bfloat16 \\
        --tokens 4 --seed 11 --ready-timeout 1800                       # the real-size run: ~17 GB RSS
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors.torch import load_file, save_file

from moe_runtime.config import LatentMoEConfig
from moe_runtime.tp.collectives import free_port
from moe_runtime.units import torch_dtype

from . import ROOT, harness
from .docs import model_text, section_start, table
from .rss import TreeSampler, measure

SECTION = "# Served layer: `serve run`, one POST, vs the CLI (scripts/bench/served_real.py)"
APP = "served"


def post_once(client: Any, proc: subprocess.Popen, args: argparse.Namespace, x: torch.Tensor, layer: int,
              ref: torch.Tensor) -> dict[str, Any]:
    """Seconds until /healthz answers 200, then one POST: its time and error against the CLI's answer."""
    start = time.perf_counter()
    while time.perf_counter() - start < args.ready_timeout and proc.poll() is None:
        try:
            client.healthz()
            break
        except Exception:
            time.sleep(0.5)
    else:
        raise SystemExit(f"`serve run` was not ready within {args.ready_timeout} s (exit {proc.poll()})")
    t0 = time.perf_counter()
    ready_s = t0 - start
    got = client.forward(x, layer).double()
    answer_s = time.perf_counter() - t0
    status = client.status()  # after the first forward, which decides the group transport
    dep = next(iter(status.get("deployments", {}).values()), status)
    dep, ref = dep if isinstance(dep, dict) else {}, ref.double()
    return {"ready_s": round(ready_s, 2), "answer_s": round(answer_s, 3), "status": 200,  # else it raised
            "rel_frobenius": ((got - ref).norm() / ref.norm()).item(),
            "max_abs": (got - ref).abs().max().item(), "max_abs_ref": ref.abs().max().item(),
            "experts_backend": dep.get("experts_backend"), "group_transport": dep.get("group_transport")}


def serve_run(args: argparse.Namespace, ckpt: Path, layer: int, x: torch.Tensor, ref: torch.Tensor,
              work: Path, env: dict[str, str]) -> dict[str, Any]:
    """``serve run`` of a generated config as a child process, its tree sampled from launch to
    shutdown; one POST; then Ctrl-C (SIGKILL after 2 minutes)."""
    from deployments.client import HTTPMoEClient

    port, size = free_port(), max(args.tokens, 16)
    app_args = {"checkpoint": str(ckpt), "tp_size": args.tp, "dtype": args.dtype, "layers": [layer],
                "tail": args.tail, "max_tokens_per_request": size, "max_batch_tokens": size,
                "num_replicas": 1}
    (work / "serve.yaml").write_text(yaml.safe_dump({
        "proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [{"name": APP, "route_prefix": "/", "import_path": "deployments.app:build_app",
                          "args": app_args}]}))
    print(f"serve run (HTTP on 127.0.0.1:{port}) ...", flush=True)
    start = time.perf_counter()
    # Started in the background, this process has SIGINT ignored and `serve run` would inherit
    # that, ignoring the Ctrl-C that stops it below; a handler is reset to the default at exec.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with (work / "serve.log").open("w") as log:
        cmd = [str(Path(sys.executable).with_name("serve")), "run", str(work / "serve.yaml")]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        sampler = TreeSampler(proc.pid, args.interval).start()
        client = HTTPMoEClient(f"http://127.0.0.1:{port}", timeout_s=args.ready_timeout)
        try:
            served = post_once(client, proc, args, x, layer, ref)
        finally:
            client.close()
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
            sampler.stop()
    return {**served, **sampler.to_dict(), "seconds_total": round(time.perf_counter() - start, 2)}


def run(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    ckpt = args.checkpoint or harness.preset_checkpoint(args.preset)
    cfg = LatentMoEConfig.from_pretrained(ckpt)
    layer = args.layer or cfg.moe_layers[0]
    x = harness.seeded_randn(args.tokens, cfg.hidden_size, seed=args.seed, dtype=torch_dtype(args.dtype))
    save_file({"hidden_states": x.contiguous()}, str(work / "in.safetensors"))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    result: dict[str, Any] = {
        "machine": harness.machine_record(), "model": harness.model_record(cfg), "checkpoint": str(ckpt),
        "preset": None if args.checkpoint else args.preset, "tp": args.tp, "dtype": args.dtype,
        "layer": layer, "tokens": args.tokens, "seed": args.seed, "tail": args.tail}
    print("CLI reference ...", flush=True)
    cli = [sys.executable, "-m", "moe_runtime", "forward", "--checkpoint", str(ckpt), "--layer", str(layer),
           "--input", str(work / "in.safetensors"), "--output", str(work / "cli.safetensors"),
           "--tp", str(args.tp), "--dtype", args.dtype, "--tail", args.tail]
    rc, result["cli"] = measure(cli, args.interval, cwd=ROOT, env=env)
    if rc != 0:
        raise SystemExit(f"the CLI reference failed (exit {rc}): {' '.join(cli)}")
    ref = load_file(str(work / "cli.safetensors"))["output"]
    result["served"] = serve_run(args, ckpt, layer, x, ref, work, env)
    return result


def markdown(r: dict[str, Any], json_path: str, png_path: str) -> str:
    s, c = r["served"], r["cli"]
    what = (f"`{r['preset']}` preset" if r["preset"] else f"checkpoint `{r['checkpoint']}`") + (
        f" ({model_text(r['model'])}), layer {r['layer']}, TP {r['tp']}, tail {r['tail']}, {r['dtype']}, "
        f"{r['tokens']} tokens (seed {r['seed']})")
    return "\n".join([section_start(SECTION, "served_real", r["argv"], r["machine"], what, json_path), "",
                      *table("what | measured", [
        ["`serve run` to ready (launch until `GET /healthz` is 200)", f"{s['ready_s']:.1f} s"],
        [f"`POST /v1/layers/{r['layer']}/forward`, {r['tokens']} tokens",
         f"{s['status']} in {s['answer_s']:.3f} s"],
        ["answer vs the CLI (`python -m moe_runtime forward`, same input, TP, dtype)",
         f"relative (Frobenius) {s['rel_frobenius']:.2e}, max abs {s['max_abs']:.2e} (max abs output "
         f"{s['max_abs_ref']:.3g})"],
        ["experts backend, group transport (`GET /v1/status`)",
         f"{s.get('experts_backend')}, {s.get('group_transport')}"],
        ["peak anon + shmem RSS, `serve run` and all its processes", f"{s['peak_rss_gb']:.3f} GB (PSS "
         f"{s['peak_pss_gb']:.3f} GB; {s['samples']} samples, up to {s['max_processes']} processes)"],
        ["peak anon + shmem RSS, the CLI's process tree",
         f"{c['peak_rss_gb']:.3f} GB (PSS {c['peak_pss_gb']:.3f} GB; {c['seconds']:.1f} s)"]])])


def main(argv: list[str] | None = None) -> int:
    ap = harness.bench_parser(__doc__, "served_real", tp=2)
    ap.add_argument("--checkpoint", type=Path, help="default: the --preset checkpoint under checkpoints/")
    ap.add_argument("--preset", default="tiny", choices=("tiny", "medium", "small"))
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--layer", type=int, help="default: the first MoE layer")
    ap.add_argument("--tail", default="sharded", help="the same tail for the CLI and the deployment")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--interval", type=float, default=0.2, help="RSS sampling period, seconds")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="served_real_") as tmp:
        result = run(args, Path(tmp))
    return harness.report(args, result, result.pop("machine"), markdown, lambda _: [])


if __name__ == "__main__":
    raise SystemExit(main())
