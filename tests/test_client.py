"""Client helpers and the HTTP body codec, without a cluster (httpx.MockTransport).

The same clients against a live app are exercised in tests/test_serve.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from deployments.client import HTTPMoEClient, MoERequestError, MoEServerError
from deployments.client.errors import raise_for
from deployments.client.http_client import encode_request, forward_path
from deployments.common.errors import (
    GroupUnavailableError,
    ServeInputError,
    TooLargeError,
    UnknownDeploymentError,
    UnknownLayerError,
    error_message,
    http_status,
    root_cause,
)
from deployments.common.layer_routing import LayerRoutes
from deployments.common.wire import WireTensor
from deployments.serve.http import decode_body, encode_body

ROOT = Path(__file__).resolve().parents[1]


def test_request_codec_round_trip():
    """The ingress reads bodies with numpy alone: F32 hidden states as an array (the handle API's
    numpy path), BF16 and router logits as WireTensors over the same bits; answers decode with
    safetensors' own torch loader (what the clients use) to the same values."""
    x = torch.randn(3, 8)
    logits = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    hidden, router = decode_body(encode_request(x, logits))
    assert isinstance(hidden, np.ndarray) and np.array_equal(hidden, x.numpy())
    assert router.dtype == "float32" and np.array_equal(router.array, logits)
    hidden, router = decode_body(encode_request(x.numpy()))
    assert router is None and hidden.dtype == np.float32
    xb = x.bfloat16()
    hidden, _ = decode_body(encode_request(xb))
    assert isinstance(hidden, WireTensor) and torch.equal(hidden.to_torch(), xb)
    out = np.ones((2, 3), np.float32)  # numpy answers (F32 requests) are encoded as F32
    assert torch.equal(st_load(encode_body({"output": out}))["output"], torch.ones(2, 3))
    bf16 = torch.randn(2, 3).bfloat16()  # answers to BF16 requests come back as WireTensors
    assert torch.equal(st_load(encode_body({"output": WireTensor.from_torch(bf16)}))["output"], bf16)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"", "empty body"),
        (b"\x00" * 7 + b"garbage", "not a valid safetensors"),
        (st_save({"router_logits": torch.zeros(1, 4)}), "missing tensor 'hidden_states'"),
        (st_save({"hidden_states": torch.zeros(1, 4), "extra": torch.zeros(1)}), "unexpected tensor"),
        (st_save({"hidden_states": torch.zeros(1, 4, dtype=torch.float8_e4m3fn)}), "dtype F8_E4M3"),
    ],
)
def test_decode_body_rejects_bad_bodies(body, message):
    with pytest.raises(ServeInputError, match=message):
        decode_body(body)


NO_TORCH = """
import sys

class NoTorch:  # `import torch` fails while this finder is first
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError(f"{name} is blocked: the ingress must not import torch")

sys.meta_path.insert(0, NoTorch())
from deployments.serve.http import decode_body, encode_body

hidden, logits = decode_body(sys.stdin.buffer.read())
sys.stdout.buffer.write(encode_body({"output": hidden, "router_logits": logits}))
"""


def test_the_ingress_reads_and_writes_bodies_without_torch(tmp_path):
    """An ingress replica never imports torch (~1.5 CPU-s and its memory per replica): a fresh
    interpreter that cannot import it decodes a BF16 body and encodes it back, bit for bit."""
    x, logits = torch.randn(3, 8).bfloat16(), torch.randn(3, 4)
    run = subprocess.run([sys.executable, "-c", NO_TORCH], input=encode_request(x, logits), cwd=ROOT,
                         capture_output=True, timeout=120)
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    back = st_load(run.stdout)
    assert torch.equal(back["output"], x) and torch.equal(back["router_logits"], logits)


def test_forward_paths_and_routing():
    assert forward_path(3) == "/v1/layers/3/forward"
    assert forward_path(3, "decode") == "/v1/decode/layers/3/forward"
    routes = LayerRoutes.from_dict({"default": "a", "layers": {"a": [1, 2], "b": [3, 4]}})
    assert routes.choose(2) == "a"
    assert routes.choose(4) == "b"  # layer-split apps route by layer
    assert routes.choose(9) == "a"  # the default explains the error
    assert routes.choose(1, "b") == "b"  # explicit names win (b then says no)
    with pytest.raises(UnknownDeploymentError, match="unknown deployment 'c'"):
        routes.choose(1, "c")
    assert LayerRoutes.from_dict(routes.to_dict()) == routes


class _Wrapped(Exception):
    """Stands in for Ray's RayTaskError: the original error under ``.cause``."""

    def __init__(self, cause: BaseException):
        super().__init__("Traceback ... noise")
        self.cause = cause


def test_error_helpers_unwrap_ray_wrappers():
    inner = TooLargeError("hidden_states has 9 tokens, more than max_tokens_per_request = 8")
    wrapped = _Wrapped(_Wrapped(inner))
    assert root_cause(wrapped) is inner
    assert error_message(wrapped) == inner.args[0]
    assert http_status(wrapped) == 413
    assert http_status(UnknownLayerError("x")) == 404
    assert http_status(ValueError("x")) == 400
    assert http_status(GroupUnavailableError("x")) == 503
    assert http_status(RuntimeError("x")) == 500


def test_raise_for_raises_client_or_server_errors():
    with pytest.raises(MoERequestError, match="layer 0 is not a MoE layer") as info:
        raise_for(_Wrapped(UnknownLayerError("layer 0 is not a MoE layer")))
    assert info.value.status == 404 and info.value.kind == "UnknownLayerError"
    assert isinstance(info.value, ValueError)
    with pytest.raises(MoEServerError, match="broken") as info:
        raise_for(_Wrapped(GroupUnavailableError("TP group broken")))
    assert info.value.status == 503


def _mock_client(handler) -> HTTPMoEClient:
    return HTTPMoEClient(client=httpx.Client(transport=httpx.MockTransport(handler), base_url="http://test"))


def test_http_client_success_keeps_the_input_kind():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen["path"] = request.url.path
        x, _ = decode_body(request.content)
        return httpx.Response(200, content=encode_body({"output": x * 2}))

    with _mock_client(handler) as client:
        out = client.forward(torch.ones(2, 4), 1)
        assert isinstance(out, torch.Tensor) and torch.equal(out, torch.full((2, 4), 2.0))
        out = client.forward(np.ones((2, 4), np.float32), 2, deployment="decode")
        assert isinstance(out, np.ndarray) and seen["path"] == "/v1/decode/layers/2/forward"


@pytest.mark.parametrize(
    ("status", "cls"), [(400, MoERequestError), (404, MoERequestError), (413, MoERequestError),
                        (503, MoEServerError), (500, MoEServerError)]
)
def test_http_client_errors_carry_the_server_message(status, cls):
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, json={"error": f"server says {status}", "type": "X", "status": status})

    with _mock_client(handler) as client, pytest.raises(cls, match=f"server says {status}") as info:
        client.forward(torch.ones(1, 4), 1)
    assert info.value.status == status and info.value.message == f"server says {status}"


def test_http_client_non_json_error_and_connection_failure():
    bad_gateway = _mock_client(lambda r: httpx.Response(502, text="bad gateway"))
    with bad_gateway as client, pytest.raises(MoEServerError, match="bad gateway"):
        client.status()

    def refuse(request):
        raise httpx.ConnectError("refused")

    with _mock_client(refuse) as client, pytest.raises(MoEServerError, match="HTTP request failed"):
        client.healthz()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_wire_tensor_round_trip(dtype):
    import pickle

    from deployments.common.wire import WireTensor

    x = torch.randn(5, 7).to(dtype)
    w = WireTensor.from_torch(x)
    assert isinstance(w.array, np.ndarray) and w.shape == (5, 7) and w.dtype == str(dtype).split(".")[1]
    back = pickle.loads(pickle.dumps(w, protocol=5)).to_torch()
    assert back.dtype == dtype and torch.equal(back, x)
    readonly = WireTensor(w.array.copy(), w.dtype)
    readonly.array.flags.writeable = False  # what Ray hands over: copied before torch sees it
    assert torch.equal(readonly.to_torch(), x)


def test_float32_rows_round_to_bfloat16_as_torch_does():
    """The group replica rounds numpy float32 input to bfloat16 without torch: bit for bit what
    ``Tensor.to(torch.bfloat16)`` gives, ties to even, subnormals, overflow to Inf and NaN
    included, and widens bfloat16 back exactly."""
    bits = np.array([0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001,  # ties (even / odd), below, above
                     0x00000001, 0x00008000, 0x00018000, 0x807FFFFF,  # subnormals
                     0x7F7FFFFF, 0xFF7F8000, 0x7F7F7FFF,  # max float rounds to Inf, the largest that does not
                     0x00000000, 0x80000000, 0x7F800000, 0xFF800000], dtype=np.uint32)
    rng = np.random.default_rng(0)
    values = np.concatenate([bits.view(np.float32), rng.standard_normal(4096).astype(np.float32) * 1e3,
                             rng.integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32).view(np.float32)])
    nan = np.isnan(values)  # any NaN will do there (torch may keep the sign and payload)
    ours = WireTensor.from_float32(values, "bfloat16")
    theirs = torch.from_numpy(values).bfloat16()
    assert ours.dtype == "bfloat16" and nan.any()
    assert np.array_equal(ours.array[~nan], theirs.view(torch.int16).numpy()[~nan])
    assert np.array_equal(ours.float32(), theirs.float().numpy(), equal_nan=True)  # widening is exact
    assert not ours.all_finite()
    assert WireTensor.from_float32(np.array([1.0, -2.5e38], np.float32), "bfloat16").all_finite()


def test_request_rows_take_every_input_kind_in_one_layout():
    """What the replica and the ranks accept: numpy float32 in any memory layout comes out in C
    order (the ranks' kernels see what a tensor's bytes would give); a torch tensor in another
    dtype, even one numpy cannot hold, is a 400 naming it; router logits of any floating dtype
    become float32."""
    from deployments.common.requests import as_logits, as_rows

    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    for view in (x.T.copy().T, x[::-1], x[:, ::2]):  # Fortran order, negative and gapped strides
        for dtype in ("float32", "bfloat16"):
            rows = as_rows(view, "hidden_states", dtype)
            assert rows.array.flags.c_contiguous and np.array_equal(rows.float32(), view)
    for bad in (torch.zeros(2, 6), torch.zeros(2, 6, dtype=torch.float8_e4m3fn)):
        with pytest.raises(ServeInputError, match=rf"dtype is {bad.dtype}, this layer runs in torch.bfloat16"):
            as_rows(bad, "hidden_states", "bfloat16")
    logits = torch.tensor([[1.0, -2.0]])
    for kind in (logits.to(torch.float8_e5m2), logits.bfloat16(), logits.double().numpy()):
        out = as_logits(kind)
        assert out.dtype == np.float32 and out.flags.c_contiguous and np.array_equal(out, [[1.0, -2.0]])
    with pytest.raises(ServeInputError, match="router_logits must be floating point"):
        as_logits(torch.ones(1, 2, dtype=torch.int64))


def test_the_session_holder_takes_a_failed_group_for_a_move_not_an_end():
    """A group whose rank died drops its sessions and says why in its snapshot; the holder of
    `python -m deployments.client session` must not end the session then (its peers move it: a
    holder that closed it left them a 404 on their move), but does when rank 0 ended it."""
    from deployments.client.__main__ import ended
    from deployments.client.session import gone_from

    class Held:
        def __init__(self, snapshot):
            self.snapshot = snapshot

        def state(self):
            return {"moe": gone_from(self.snapshot)}

    failed = {"sessions": {}, "failed": "rank 1 of the group is gone", "failure": "group_timeout"}
    assert ended(Held(failed)) is None
    assert ended(Held({"sessions": {}, "failed": "a forward failed", "failure": None})) is None
    assert ended(Held({"sessions": {}, "failed": None, "failure": None})) == "moe: ended: no longer open on rank 0"
