"""Show that each vLLM conformance check fails on a deliberate fault in our code.

    python scripts/conformance_faults.py [--only NAME] [--json PATH]    # in the lane's venv

For every entry of ``FAULTS``: a fresh Python process replaces one function of ours (everywhere
it is bound: its module, classes, and any module that imported it by name) with a wrong variant,
runs the conformance check(s) it names under pytest, and reports ``caught`` (some case failed),
``MISSED`` (every case passed: the check cannot see that fault) or ``not run`` (every case
skipped: vLLM is not importable here). Exit status: 0 every fault caught; 1 one was missed;
3 none could run (no vLLM), unless ``--allow-not-run``.

tests/test_conformance_tools.py checks, without vLLM, that every conformance test function has
a fault here (a new check fails that test until it gets one) and that the machinery reports a
caught fault, a missed one and a skipped check correctly.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TAIL, NUMERICS = "tests/conformance/test_vllm_tail.py", "tests/conformance/test_vllm_numerics.py"
QUARK = "tests/conformance/test_quark_mxfp4.py"
HF_STANDARD = "tests/conformance/test_hf_standard_moe.py"


@dataclass(frozen=True)
class Fault:
    name: str
    tests: tuple[str, ...]  # pytest node ids (a function: every parametrised case)
    target: str  # "module:attr" or "module:Class.attr"
    what: str
    make: str  # name of the factory below: original -> wrong variant


# -- the wrong variants (each takes the original and returns the faulted replacement) ----------


def drop_sequence_parallel_condition(original: Callable) -> Callable:
    def wrong(**kw: Any) -> Any:
        return original(**{**kw, "sequence_parallel": False})

    return wrong


def _shardability_with(**wrong_fields: Any) -> Callable:
    """``shardability_for`` rebuilt from the config, with the given fields of the rule replaced
    by what a wrong variant would hand it (each a function of the config)."""
    from moe_runtime.tp import plan

    def wrong(cfg, tp_size, preshard_up_proj=False, sequence_parallel=False):
        fields = {"has_shared_experts": cfg.num_shared_experts > 0, "runner_scaling_factor": 1.0}
        fields.update({name: value(cfg) for name, value in wrong_fields.items()})
        return plan.sharded_tail_shardability(
            has_up_proj=True, tp_size=tp_size, up_proj_rows=cfg.hidden_size,
            preshard_up_proj=preshard_up_proj, sequence_parallel=sequence_parallel, **fields,
        )

    return wrong


def ignore_shared_experts(original: Callable) -> Callable:
    return _shardability_with(has_shared_experts=lambda cfg: True)


def hand_scaling_factor_to_runner(original: Callable) -> Callable:
    return _shardability_with(runner_scaling_factor=lambda cfg: cfg.routed_scaling_factor)


def scale_tail_output(original: Callable) -> Callable:
    def wrong(self, tail, *args, **kwargs):
        out = original(self, tail, *args, **kwargs)
        return out * 1.001 if tail == "sharded" else out

    return wrong


def swap_gate_and_up(original: Callable) -> Callable:
    def wrong(self, gate, up):
        return original(self, up, gate)

    return wrong


def swap_nibbles(original: Callable) -> Callable:
    def wrong(packed, scales, *args, **kwargs):
        return original((packed << 4) | (packed >> 4), scales, *args, **kwargs)

    return wrong


def swap_scale_rules(original: Callable) -> Callable:
    def wrong(amax, rule):
        return original(amax, {"even": "floor", "floor": "even"}[rule])

    return wrong


def scale_standard_output(original: Callable) -> Callable:
    def wrong(*args, **kwargs):
        return original(*args, **kwargs) * 1.001

    return wrong


def drop_correction_bias(original: Callable) -> Callable:
    import dataclasses

    def wrong(x_TH, w, *args, **kwargs):
        return original(x_TH, dataclasses.replace(w, bias_E=w.bias_E * 0), *args, **kwargs)

    return wrong


def default_to_floor(original: Callable) -> Callable:
    def wrong(x, scale_rule="floor"):
        return original(x, scale_rule)

    return wrong


FAULTS = (
    Fault("shardability-ignores-sequence-parallel",
          (f"{TAIL}::test_shardability_rule_matches_vllm_runner_on_every_condition",),
          "moe_runtime.tp.plan:sharded_tail_shardability", "the sequence-parallel condition dropped",
          "drop_sequence_parallel_condition"),
    Fault("config-rule-ignores-shared-experts",
          (f"{TAIL}::test_config_rule_matches_vllm_runner_built_like_k3",),
          "moe_runtime.tp.plan:shardability_for", "a config without shared experts treated as having them",
          "ignore_shared_experts"),
    Fault("router-does-not-fold-scaling",
          (f"{TAIL}::test_scaling_factor_is_folded_by_our_router_not_by_vllm_runner",),
          "moe_runtime.tp.plan:shardability_for", "the routed scaling factor handed to the runner",
          "hand_scaling_factor_to_runner"),
    Fault("sharded-tail-off-by-0.1%", (f"{TAIL}::test_sharded_tail_matches_vllm_shard_up_proj_tail",),
          "moe_runtime.tp.runner:LatentMoERunner.apply_tail", "the sharded tail's output scaled by 1.001",
          "scale_tail_output"),
    Fault("situ-gate-up-swapped", (f"{NUMERICS}::test_situ_matches_vllm_situ_and_mul_native",),
          "moe_runtime.activation:GatedActivation.__call__", "gate and up swapped", "swap_gate_and_up"),
    Fault("mxfp4-nibbles-swapped",
          (f"{NUMERICS}::test_mxfp4_decode_matches_vllm_moe_dequant_on_every_code_and_scale",
           f"{NUMERICS}::test_fp4_code_table_matches_vllm"),
          "moe_runtime.mxfp4:decode", "the two nibbles of each byte swapped", "swap_nibbles"),
    Fault("mxfp4-scale-rules-swapped",
          tuple(f"{QUARK}::{t}" for t in (
              "test_even_matches_quark_on_edge_blocks", "test_rules_differ_where_the_issue_measured",
              "test_floor_matches_quark_on_random_blocks", "test_floor_matches_quark_on_edge_blocks",
              "test_floor_known_differences_from_quark")),
          "moe_runtime.mxfp4:shared_exponent", "the even and floor rules swapped", "swap_scale_rules"),
    Fault("mxfp4-activations-default-to-floor",
          tuple(f"{QUARK}::{t}" for t in (
              "test_vllm_emulation_is_quark_even_mode", "test_even_matches_quark_on_random_blocks",
              "test_even_known_difference_at_the_top_of_fp32")),
          "moe_runtime.mxfp4:quantize_dequantize", "activations quantised by the plain OCP rule by default",
          "default_to_floor"),
    Fault("standard-moe-off-by-0.1%",
          (f"{HF_STANDARD}::test_qwen3_moe_matches_hf_sparse_moe_block",
           f"{HF_STANDARD}::test_deepseek_v3_moe_matches_hf_deepseek_v3_moe"),
          "moe_runtime.standard.layer:standard_moe_partial", "the standard layer's output scaled by 1.001",
          "scale_standard_output"),
    Fault("standard-router-without-correction-bias",
          (f"{HF_STANDARD}::test_deepseek_v3_moe_matches_hf_deepseek_v3_moe",),
          "moe_runtime.standard.layer:standard_moe_partial",
          "DeepSeek-V3 experts chosen without the correction bias", "drop_correction_bias"),
)


# -- applying one fault, in this process -------------------------------------------------------


def apply_fault(target: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``target`` ("module:attr" or "module:Class.attr") with ``make(original)``, also in
    every loaded module that bound the original by name (``from m import f``)."""
    module_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(module_name)
    *classes, attr = path.split(".")
    for name in classes:
        owner = getattr(owner, name)
    original = getattr(owner, attr)
    wrong = make(original)
    setattr(owner, attr, wrong)
    if not classes:
        for module in list(sys.modules.values()):
            for name, value in list(getattr(module, "__dict__", {}).items()):
                if value is original:
                    setattr(module, name, wrong)


class Outcomes:
    """pytest plugin: the call-phase outcome of every test (setup errors count as failures)."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or report.outcome != "passed":
            self.outcomes[report.nodeid] = report.outcome


def verdict(outcomes: dict[str, str]) -> str:
    if any(o == "failed" for o in outcomes.values()):
        return "caught"
    if any(o == "passed" for o in outcomes.values()):
        return "MISSED"
    return "not run"


def run_here(target: str, make: str, tests: list[str], factories: str | None = None) -> dict[str, Any]:
    """In this process: apply the fault, run ``tests`` under pytest, return the verdict."""
    import pytest

    module = importlib.import_module(factories) if factories else sys.modules[__name__]
    apply_fault(target, getattr(module, make))
    plugin = Outcomes()
    pytest.main(["-q", "-p", "no:cacheprovider", "-p", "no:randomly", *tests], plugins=[plugin])
    return {"verdict": verdict(plugin.outcomes), "outcomes": plugin.outcomes}


def run_fault(target: str, make: str, tests: list[str], factories: str | None = None,
              cwd: Path = ROOT) -> dict[str, Any]:
    """In a fresh process (test modules must import the faulted function), the verdict."""
    spec = json.dumps({"target": target, "make": make, "tests": tests, "factories": factories})
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", spec], cwd=cwd,
                          capture_output=True, text=True)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("FAULT-RESULT "):
            return json.loads(line.removeprefix("FAULT-RESULT "))
    return {"verdict": "not run", "outcomes": {}, "error": (proc.stdout + proc.stderr)[-2000:]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="run one fault by name")
    ap.add_argument("--json", type=Path, help="write the results as JSON")
    ap.add_argument("--allow-not-run", action="store_true", help="exit 0 when vLLM is missing here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        sys.path.insert(0, str(ROOT))
        result = run_here(spec["target"], spec["make"], spec["tests"], spec["factories"])
        print("FAULT-RESULT " + json.dumps(result))
        return 0
    faults = [f for f in FAULTS if args.only in (None, f.name)]
    if not faults:
        raise SystemExit(f"no fault named {args.only!r}; known: {[f.name for f in FAULTS]}")
    results = []
    for fault in faults:
        result = run_fault(fault.target, fault.make, list(fault.tests))
        failed = sum(o == "failed" for o in result["outcomes"].values())
        print(f"{result['verdict']:8} {fault.name}: {fault.what} ({fault.target}); "
              f"{failed} of {len(result['outcomes'])} case(s) failed")
        results.append({"fault": fault.name, "target": fault.target, "what": fault.what, **result})
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    verdicts = {r["verdict"] for r in results}
    if "MISSED" in verdicts:
        return 1
    if verdicts == {"not run"}:
        print("no check could run (vLLM not importable here: use the lane's venv, scripts/vllm_env.sh)")
        return 0 if args.allow_not_run else 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
