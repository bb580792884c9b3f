"""The vLLM conformance lane's record and fault scripts, without vLLM (this CPU venv has none):
the summary parsing on captured pytest output, the record file, and the fault machinery on a
self-made check. scripts/conformance_lane.py and scripts/conformance_faults.py themselves run in
the lane's venv (docs/conformance.md)."""

from __future__ import annotations

import ast
import datetime as dt
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


lane = _script("conformance_lane")
faults = _script("conformance_faults")

# What `pytest -q -ra tests/conformance` printed in the lane (shape of the recorded 2026-12-03 run).
CAPTURED_PASS = """\
vllm 0.32.0 | torch 2.13.0+cpu
..........................................                               [100%]
42 passed in 18.20s
"""
CAPTURED_MIXED = """\
..F.....s.E
=================================== FAILURES ===================================
___________ test_situ_matches_vllm_situ_and_mul_native[4.0-25.0-dtype0] ________
E   assert False
=========================== short test summary info ============================
SKIPPED [1] tests/conformance/test_vllm_quark.py:12: quark not installed
FAILED tests/conformance/test_vllm_numerics.py::test_situ_matches_vllm_situ_and_mul_native[4.0-25.0-dtype0]
ERROR tests/conformance/test_vllm_tail.py::test_config_rule_matches_vllm_runner_built_like_k3 - boom
1 failed, 8 passed, 1 skipped, 1 warning, 1 error in 31.07s
"""


def test_summary_line_is_parsed_from_captured_pytest_output():
    assert lane.parse_summary(CAPTURED_PASS) == {
        "passed": 42, "failed": 0, "skipped": 0, "errors": 0, "xfailed": 0, "xpassed": 0, "deselected": 0,
        "warnings": 0, "seconds": 18.2,
    }
    mixed = lane.parse_summary(CAPTURED_MIXED)
    assert (mixed["passed"], mixed["failed"], mixed["skipped"], mixed["errors"], mixed["warnings"]) == (8, 1, 1, 1, 1)
    # Without -q pytest frames the line; a skipped-only lane (no vLLM) and an empty one parse too.
    assert lane.parse_summary("===== 2 failed, 40 passed in 20.01s (0:00:20) =====")["failed"] == 2
    assert lane.parse_summary("sss\n9 skipped in 0.50s\n")["skipped"] == 9
    assert lane.parse_summary("no tests ran in 0.01s")["passed"] == 0
    with pytest.raises(ValueError, match="no pytest summary line"):
        lane.parse_summary("Traceback (most recent call last):\nImportError: vllm\n")
    with pytest.raises(ValueError, match="unknown pytest outcome 'exploded'"):
        lane.parse_summary("1 exploded in 1.00s")


def test_record_holds_counts_date_and_versions(tmp_path):
    path = tmp_path / "docs" / "lane.json"
    found = {"python": "3.11.7", "vllm": "0.32.0", "torch": "2.13.0+cpu"}
    when = dt.datetime(2026, 12, 3, 9, 30, tzinfo=dt.UTC)
    data = lane.record(lane.parse_summary(CAPTURED_MIXED), 1, found, path, now=when)
    assert json.loads(path.read_text()) == data
    assert data["date"] == "2026-12-03 09:30 UTC" and data["result"] == "failed" and data["returncode"] == 1
    assert (data["passed"], data["failed"], data["skipped"], data["errors"]) == (8, 1, 1, 1)
    assert data["versions"] == found
    ok = lane.record(lane.parse_summary(CAPTURED_PASS), 0, found, path, now=when)
    assert ok["result"] == "passed" and ok["passed"] == 42
    # The versions of this interpreter: vLLM is not importable here, and the record says so.
    assert lane.versions()["vllm"].startswith("not importable")


def test_the_docs_cite_the_record_where_the_lane_writes_it():
    assert lane.RECORD.relative_to(ROOT).as_posix() in (ROOT / "docs" / "conformance.md").read_text()


def _conformance_tests() -> set[str]:
    names = set()
    for path in (ROOT / "tests" / "conformance").glob("test_*.py"):
        tree = ast.parse(path.read_text())
        names |= {f"{path.relative_to(ROOT)}::{n.name}" for n in tree.body
                  if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    return names


def test_every_conformance_check_has_a_deliberate_fault():
    """A new check in tests/conformance fails here until scripts/conformance_faults.py gets a fault
    that it must catch."""
    covered = {t for f in faults.FAULTS for t in f.tests}
    assert covered == _conformance_tests(), "add a Fault for every conformance check (and no stale ones)"
    assert len({f.name for f in faults.FAULTS}) == len(faults.FAULTS)
    for f in faults.FAULTS:  # each target exists and each factory builds a replacement
        module, _, path = f.target.partition(":")
        owner = importlib.import_module(module)
        for part in path.split("."):
            owner = getattr(owner, part)
        assert callable(getattr(faults, f.make)(owner)), f.name


CHECKS = '''
import pytest
import torch

from moe_runtime import mxfp4


BLOCK = torch.tensor([[1] + [0] * 15], dtype=torch.uint8)  # one 32-value block; scale 2**0
SCALE = torch.tensor([[127]], dtype=torch.uint8)


def test_values():  # byte 0x01 holds code 1 (0.5) in its low nibble: element 0
    assert mxfp4.decode(BLOCK, SCALE)[0, :2].tolist() == [0.5, 0.0]


def test_unfaulted_decoder_passes_the_check():
    test_values()


def test_shape_only():
    assert mxfp4.decode(BLOCK, SCALE).shape == (1, 32)


def test_needs_a_missing_package():
    pytest.importorskip("a_package_that_is_not_installed")
'''


@pytest.mark.slow  # two fresh Python processes
def test_fault_machinery_reports_caught_missed_and_not_run(tmp_path):
    (tmp_path / "test_checks.py").write_text(CHECKS)
    # One faulted run of three checks: each check's outcome, and the verdict each alone gets.
    checks = ["test_values", "test_shape_only", "test_needs_a_missing_package"]
    run = faults.run_fault("moe_runtime.mxfp4:decode", "swap_nibbles", [f"test_checks.py::{t}" for t in checks],
                           cwd=tmp_path)
    outcomes = {name.removeprefix("test_checks.py::"): o for name, o in run["outcomes"].items()}
    assert outcomes == {"test_values": "failed", "test_shape_only": "passed", "test_needs_a_missing_package": "skipped"}
    assert run["verdict"] == "caught"
    alone = {t: faults.verdict({t: o}) for t, o in outcomes.items()}
    # A check blind to the fault is reported; one that cannot run is no verdict either way.
    assert alone == {"test_values": "caught", "test_shape_only": "MISSED", "test_needs_a_missing_package": "not run"}
    # The same checks without the fault pass (they fail for the fault, not for themselves).
    plain = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_checks.py"],
                           cwd=tmp_path, capture_output=True, text=True)
    assert "3 passed, 1 skipped" in plain.stdout, plain.stdout
    assert faults.verdict({"a": "passed", "b": "failed"}) == "caught" and faults.verdict({}) == "not run"
