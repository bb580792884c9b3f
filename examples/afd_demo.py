"""Attention-FFN disaggregation demo: a small K3-like decoder here, its MoE layers on the tier.

    python -m examples.afd_demo                       # tiny checkpoint, local Ray, layers split
                                                      # over two TP-group deployments
    python -m examples.afd_demo --connect default     # an app already running (serve run ...),
                                                      # whose checkpoint has the decoder tensors
    python -m examples.afd_demo --workers 1 2 4       # M decoders as the workers of one cohort

Greedy-decodes a batch of prompts with ``micro_batches`` groups in flight, then runs the same
model entirely in this process (``moe_forward`` as its MoE) and says whether the tokens match
and how far the logits are apart. With ``--workers``, for each M: M decoders (Ray actors, each
its own prompts and KV cache) decode together as one cohort, every MoE layer of a step one
forward of all their rows, and each one's tokens are checked against the in-process model.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from deployments.cluster.local import local_serve
from examples.afd import Decoder, DecoderWorker, LocalMoE, RemoteMoE
from examples.synthetic_decoder import DECODER_FILE, write_decoder
from moe_runtime.config import LatentMoEConfig
from moe_runtime.synthetic import preset_config, write_checkpoint

ROOT = Path(__file__).resolve().parents[1]


def demo(checkpoint: Path, app: str, batch: int, tokens: int, micro_batches: int) -> bool:
    gen = torch.Generator().manual_seed(0)
    tier = RemoteMoE.connect(app)
    model = Decoder(checkpoint, tier)
    vocab = model.cfg.vocab_size
    prompts = random_prompts(gen, vocab, batch)
    routes = tier.client.layer_routes().to_dict()["layers"]
    print(f"MoE layers -> deployments: {routes}")
    remote = model.generate(prompts, tokens, micro_batches)
    start = time.perf_counter()
    local = Decoder(checkpoint, LocalMoE(checkpoint)).generate(prompts, tokens)
    local_s = time.perf_counter() - start
    same = torch.equal(remote.tokens, local.tokens)
    for b in range(min(batch, 4)):
        print(f"prompt {prompts[b]} -> {remote.tokens[b].tolist()}")
    diff = (remote.logits - local.logits).abs().max().item()
    print(f"tier, m={micro_batches}: prefill {remote.prefill_s * 1e3:.0f} ms, "
          f"{remote.decode_s * 1e3 / max(1, remote.decode_steps):.1f} ms per decode step; "
          f"in process: {local_s * 1e3:.0f} ms for everything")
    print(f"tokens identical to the in-process model: {same}; max |logit difference| {diff:.2e}")
    return same


def random_prompts(gen: torch.Generator, vocab: int, batch: int) -> list[list[int]]:
    return [torch.randint(vocab, (int(n),), generator=gen).tolist()
            for n in torch.randint(2, 9, (batch,), generator=gen)]


def cohort_demo(checkpoint: Path, app: str, workers: list[int], batch: int, tokens: int) -> bool:
    """For each M: M decoders as one cohort, tokens checked against the in-process model."""
    import ray

    from deployments.client import MoEClient

    local = Decoder(checkpoint, LocalMoE(checkpoint))
    gen = torch.Generator().manual_seed(1)
    ok = True
    for M in workers:
        prompts = [random_prompts(gen, local.cfg.vocab_size, batch) for _ in range(M)]
        actors = [ray.remote(DecoderWorker).options(num_cpus=0).remote(str(checkpoint), p, tokens)
                  for p in prompts]
        prefill = max(sum(map(len, p)) for p in prompts)  # the most rows a worker sends in a step
        start = time.perf_counter()
        with MoEClient(app).cohort(actors, max_tokens=prefill, name=f"afd-{M}") as cohort:
            for _ in range(tokens):
                cohort.step([None] * M)
            status = cohort.status()
        seconds = time.perf_counter() - start
        made = ray.get([a.generation.remote() for a in actors])
        same = [torch.equal(g.tokens, local.generate(p, tokens).tokens)
                for g, p in zip(made, prompts, strict=True)]
        for a in actors:
            ray.kill(a)
        print(f"cohort of {M} decoder(s) x {batch} prompts, {tokens} steps in {seconds:.1f} s "
              f"({status['session_steps']} on the data plane, {status['serve_steps']} on the Serve path, "
              f"{status['reruns']} re-run); tokens identical to the in-process model: {all(same)}")
        ok &= all(same)
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", type=Path, default=ROOT / "checkpoints/tiny-afd")
    ap.add_argument("--preset", default="tiny", help="written to --checkpoint when it has no decoder yet")
    ap.add_argument("--connect", metavar="APP", help="use this running Serve app instead of starting one")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--workers", type=int, nargs="+", metavar="M",
                    help="instead: M decoders (each --batch prompts) as the workers of one cohort, per M")
    args = ap.parse_args(argv)
    if args.connect:
        import ray

        ray.init(address="auto", log_to_driver=False)
        if args.workers:
            ok = cohort_demo(args.checkpoint, args.connect, args.workers, args.batch, args.tokens)
        else:
            ok = demo(args.checkpoint, args.connect, args.batch, args.tokens, args.micro_batches)
        return 0 if ok else 1
    ckpt = args.checkpoint
    if not (ckpt / DECODER_FILE).is_file():  # what scripts/make_checkpoint.py --decoder writes
        print(f"writing the {args.preset} checkpoint with the decoder's tensors to {ckpt}", flush=True)
        write_checkpoint(ckpt, preset_config(args.preset), seed=0, progress=True)
        write_decoder(ckpt, seed=0)
    layers = LatentMoEConfig.from_pretrained(ckpt).moe_layers
    half = len(layers) // 2 or 1
    common = {"dtype": "float32", "tail": "replicated", "batch_wait_timeout_s": 0.0, "replica_cpus": 0.5}
    deployments = [{"name": "lower", "tp_size": 2, "layers": layers[:half], **common}]
    if layers[half:]:
        deployments.append({"name": "upper", "tp_size": 2, "layers": layers[half:], **common})
    with local_serve(num_cpus=4, num_gpus=4):
        from ray import serve

        from deployments.app import build_app

        serve.run(build_app({"checkpoint": str(ckpt), "deployments": deployments}), name="afd")
        ok = (cohort_demo(ckpt, "afd", args.workers, args.batch, args.tokens) if args.workers
              else demo(ckpt, "afd", args.batch, args.tokens, args.micro_batches))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
