"""One vLLM engine in its own process (the vLLM lane's tests and scripts/bench_vllm.py run it).

    python tests/vllm_lane/engine.py SPEC.json OUT.json

SPEC: {"model": dir, "latent_moe": additional_config["latent_moe"], "prompts": [[token ids]...],
"max_tokens": n, "start_after": path or null, "engine": {LLM arguments over ENGINE} or absent,
"logprobs": k or absent (then it also writes "logprobs": per prompt and position, {token id:
log-probability} of the top k and the pick), "bursts": n and "pause_s": s or absent (then it
decodes the prompts n times, idle for s seconds after each)}.
Builds ``vllm.LLM`` (CPU, float32, vLLM's default compilation unless "engine" says otherwise),
waits for ``start_after`` to exist when given (so several engines decode at once), greedy-decodes
every prompt and writes {"tokens": [[ids]...], "seconds": decode time (pauses not counted), "tier_stats": the engine's
tier calls per layer ({layer: {"calls", "rows", "seconds", "p50_ms", "p99_ms"}}, from
``deployments.vllm_plugin.tier_stats``; {} for a model without tier blocks)}.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ENGINE = {"dtype": "float32", "max_model_len": 128, "max_num_batched_tokens": 64,
          "max_num_seqs": 8, "skip_tokenizer_init": True, "seed": 0}


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    from deployments.vllm_plugin import tier_stats

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(model=spec["model"], additional_config={"latent_moe": spec["latent_moe"]},
              **{**ENGINE, **spec.get("engine", {})})
    if spec.get("start_after"):
        Path(spec_path + ".ready").write_text("")
        while not Path(spec["start_after"]).exists():
            time.sleep(0.01)
    params = SamplingParams(temperature=0, max_tokens=spec["max_tokens"], ignore_eos=True,
                            logprobs=spec.get("logprobs"))
    seconds, outs = 0.0, []
    for burst in range(spec.get("bursts", 1)):
        if burst:
            time.sleep(spec.get("pause_s", 0))
        start = time.perf_counter()
        outs += llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
        seconds += time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    out = {"tokens": tokens, "seconds": seconds, "tier_stats": tier_stats(llm)}
    if spec.get("logprobs"):
        out["logprobs"] = [[{str(t): lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs]
                           for o in outs]
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:3])
