"""Dtype rules have one home, ``moe_runtime.units``: every name it knows is a torch dtype that numpy
can hold (bfloat16 as its bits), and no other module keeps a table of its own."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from moe_runtime.units import (
    DTYPES,
    SAFETENSORS_CODES,
    SAFETENSORS_DTYPES,
    SAFETENSORS_FLOAT8,
    VIEW_AS,
    WIRE_DTYPES,
    dtype_name,
    torch_dtype,
)

ROOT = Path(__file__).resolve().parents[1]
# A table of dtype names of its own: a safetensors code as a string, a dtype looked up by name, or
# a name -> dtype dict.
OWN_TABLE = re.compile(r"""["'](BF16|F32|F8_E4M3)["']|getattr\(torch, [^"']|getattr\(sys\.modules\["torch"\]"""
                       r"""|["'](float32|bfloat16)["']: torch\.""")
# aiter's check asks whether this torch has the dtypes it needs (a presence check, not a name
# rule); the experts backends' benchmarks and test are other work's at the moment.
EXEMPT = {"moe_runtime/experts/aiter_fused.py", "scripts/bench/experts.py", "scripts/bench/real.py",
          "tests/test_grouped_experts.py", "tests/test_units.py"}


def test_every_name_is_the_torch_dtype_of_that_name():
    for name in [*DTYPES, *SAFETENSORS_CODES, *WIRE_DTYPES, *VIEW_AS.values()]:
        assert dtype_name(torch_dtype(name)) == name
    with pytest.raises(ValueError, match="unknown dtype 'float'"):
        torch_dtype("float")
    assert set(SAFETENSORS_CODES) == {*SAFETENSORS_DTYPES.values(), *SAFETENSORS_FLOAT8.values()}


def test_numpy_holds_what_files_and_the_wire_carry_at_the_same_width():
    for name in {*SAFETENSORS_DTYPES.values(), *WIRE_DTYPES}:
        assert np.dtype(VIEW_AS.get(name, name)).itemsize == torch.empty(0, dtype=torch_dtype(name)).element_size()


def test_no_other_module_keeps_a_dtype_table():
    found = [f"{path.relative_to(ROOT)}:{n}" for folder in ("deployments", "moe_runtime", "scripts", "tests", "examples")
             for path in (ROOT / folder).rglob("*.py")
             if path.name != "units.py" and str(path.relative_to(ROOT)) not in EXEMPT
             for n, line in enumerate(path.read_text().splitlines(), 1) if OWN_TABLE.search(line)]
    assert found == []
