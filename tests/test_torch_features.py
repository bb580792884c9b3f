"""The fast experts backends say which torch feature is missing instead of failing later.

``aiter`` views its MXFP4 operands as ``torch.float4_e2m1fn_x2`` / ``torch.float8_e8m0fnu`` and
``grouped`` calls torch's grouped GEMM op; torch 2.7 lacks the first and the last. Each test takes the
attribute away (as an older torch would have it) and checks the backend's reason names the torch
version and what is missing, through the backend module and through the registry that ``auto``
uses; building the backend anyway is a ValueError with that reason, not an AttributeError.
"""

from __future__ import annotations

import pytest
import torch

from moe_runtime import private_api as torch_api
from moe_runtime.experts import backend_candidates, get_backend, unavailable_reason
from moe_runtime.experts.aiter_fused import AiterExperts, aiter_unavailable_reason, torch_dtypes_reason
from moe_runtime.experts.grouped import grouped_mm_fails_on, grouped_unavailable_reason


def test_this_torch_has_every_dtype_aiter_needs() -> None:
    assert torch_dtypes_reason() is None
    reason = aiter_unavailable_reason()
    assert reason is None or "lacks torch." not in reason  # here: no ROCm GPU, a different reason


@pytest.mark.parametrize("missing", [["float4_e2m1fn_x2"], ["float8_e8m0fnu"],
                                     ["float4_e2m1fn_x2", "float8_e8m0fnu"]])
def test_aiter_reason_names_the_missing_dtypes(monkeypatch, missing: list[str]) -> None:
    for name in missing:
        monkeypatch.delattr(torch, name)
    for reason in (aiter_unavailable_reason(), unavailable_reason("aiter")):
        assert reason is not None
        assert f"torch {torch.__version__}" in reason and "torch >= 2.8" in reason
        for name in ("float4_e2m1fn_x2", "float8_e8m0fnu"):
            assert (f"torch.{name}" in reason) == (name in missing), reason
    with pytest.raises(ValueError, match="lacks torch.float"):
        AiterExperts()  # before it imports aiter: the reason, not an AttributeError or ImportError
    with pytest.raises(ValueError, match="lacks torch.float"):
        get_backend("aiter")
    order, why = backend_candidates("auto")
    assert order[-1] == "torch" and "aiter" not in order and "lacks torch.float" in why


def test_a_non_dtype_attribute_of_that_name_is_missing_too(monkeypatch) -> None:
    monkeypatch.setattr(torch, "float4_e2m1fn_x2", None, raising=False)
    assert "torch.float4_e2m1fn_x2" in torch_dtypes_reason()


def test_grouped_reason_names_the_torch_version(monkeypatch) -> None:
    assert grouped_unavailable_reason() is None  # torch 2.13 CPU: the op runs here
    monkeypatch.delattr(torch, "_grouped_mm")
    for reason in (grouped_unavailable_reason(), unavailable_reason("grouped")):
        assert reason == f"torch {torch.__version__} has no {torch_api.GROUPED_MM} (it needs torch >= 2.8)"
    with pytest.raises(ValueError, match=f"no {torch_api.GROUPED_MM}"):
        get_backend("grouped")


def test_grouped_op_present_but_without_a_kernel_is_a_reason(monkeypatch) -> None:
    """As on ROCm torch 2.8: the attribute exists, the call raises. The probe turns that into a
    reason (it is cached per device, so the test uses a device string of its own)."""

    def no_kernel(*args, **kwargs):
        raise RuntimeError("grouped gemm is not supported on ROCM")

    monkeypatch.setattr(torch, "_grouped_mm", no_kernel)
    grouped_mm_fails_on.cache_clear()
    try:
        reason = grouped_mm_fails_on("cpu")
        assert reason is not None and "does not run on cpu" in reason and "not supported on ROCM" in reason
    finally:
        grouped_mm_fails_on.cache_clear()
    monkeypatch.undo()
    assert grouped_mm_fails_on("cpu") is None
    grouped_mm_fails_on.cache_clear()
