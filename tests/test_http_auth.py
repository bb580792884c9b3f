"""The HTTP door: an optional bearer token on the ingress, and the ingress fuzzed from its own
OpenAPI schema (schemathesis) against a real Serve app on the tiny checkpoint.

One local Ray instance for the module (TP 1 on CPU bundles, one ingress replica): its processes
inherit ``LMS_HTTP_TOKEN`` from this process, which sets it before Ray starts, exactly as an
ingress on a cluster node reads it from the node's environment.
"""

from __future__ import annotations

import json
import os
import secrets
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from safetensors.torch import save as st_save

from deployments.client import HTTPMoEClient, MoERequestError
from deployments.client.http_client import auth_headers
from deployments.config.spec import AppArgs
from deployments.serve.http import BearerToken, token_from_env

APP = "moe_auth_test"
H = 128  # tiny preset
# A request that has not answered within this is a hang (the fuzz's only time bound).
CLIENT_TIMEOUT_S = 60.0
FUZZ_EXAMPLES = 25  # per route, with the token; a few more without it
SECRET = "lms-test-" + secrets.token_hex(16)
WRONG = "lms-wrong-" + secrets.token_hex(16)


# -- units: the token never shows, and is compared as a whole ---------------------------------


def test_token_is_compared_whole_and_never_shown(monkeypatch):
    token = BearerToken("s3cret")
    assert token.matches("Bearer s3cret") and token.matches("bearer s3cret")
    for header in (None, "", "s3cret", "Bearer", "Bearer s3cre", "Bearer s3cretX", "Basic s3cret", "Bearer  x"):
        assert not token.matches(header), header
    assert "s3cret" not in repr(token) and "s3cret" not in str(token) and "s3cret" not in f"{token!r} {token}"
    monkeypatch.delenv("LMS_TEST_TOKEN", raising=False)
    assert token_from_env("LMS_TEST_TOKEN") is None  # unset: open
    with pytest.raises(ValueError, match=r"http_token_required is set but \$LMS_TEST_TOKEN is empty or unset"):
        token_from_env("LMS_TEST_TOKEN", required=True)
    monkeypatch.setenv("LMS_TEST_TOKEN", " padded ")
    with pytest.raises(ValueError, match="surrounding whitespace") as err:
        token_from_env("LMS_TEST_TOKEN")
    assert "padded" not in str(err.value)  # the value is never in a message
    monkeypatch.setenv("LMS_TEST_TOKEN", "fine")
    assert token_from_env("LMS_TEST_TOKEN").matches("Bearer fine")
    # The app's arguments hold the variable's name only; a bad name is refused with the value.
    args = AppArgs.model_validate({"checkpoint": "x", "http_token_env": "MY_TOKEN"})
    assert args.http_token_env == "MY_TOKEN" and not args.http_token_required
    with pytest.raises(ValueError, match="http_token_env"):
        AppArgs.model_validate({"checkpoint": "x", "http_token_env": "not a name"})
    assert auth_headers("abc") == {"Authorization": "Bearer abc"} and auth_headers(None) == {}
    with pytest.raises(ValueError, match="token must be a non-empty printable string"):
        auth_headers(" abc")


# -- a real app ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(tiny_ckpt):
    from conftest import own_serve
    from ray import serve

    from deployments.app import build_app

    before = os.environ.get("LMS_HTTP_TOKEN")
    os.environ["LMS_HTTP_TOKEN"] = SECRET  # before Ray starts: its processes inherit it
    try:
        with own_serve(num_cpus=4, num_gpus=0) as port:
            args = {"checkpoint": str(tiny_ckpt), "tp_size": 1, "dtype": "float32", "accelerator": "cpu",
                    "ingress_replicas": 1, "max_tokens_per_request": 64, "http_token_required": True,
                    "collective_timeout_s": 10.0, "call_margin_s": 10.0, "auto_tune_tokens": "none"}
            serve.run(build_app(args), name=APP, route_prefix="/")
            yield SimpleNamespace(url=f"http://127.0.0.1:{port}", logs=_ray_logs_dir())
    finally:
        if before is None:
            os.environ.pop("LMS_HTTP_TOKEN", None)
        else:
            os.environ["LMS_HTTP_TOKEN"] = before


def _ray_logs_dir() -> Path:
    from deployments.common.private_api import ray_logs_dir

    return Path(ray_logs_dir())


def _body(T: int = 3) -> bytes:
    return st_save({"hidden_states": torch.randn(T, H, generator=torch.Generator().manual_seed(T))})


@pytest.mark.ray
@pytest.mark.slow
def test_forward_and_status_need_the_token_healthz_does_not(app):
    forward = f"{app.url}/v1/layers/1/forward"
    octet = {"content-type": "application/octet-stream"}
    for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": f"Basic {SECRET}"},
                    {"Authorization": SECRET}):
        for method, url, content in (("POST", forward, _body()), ("POST", f"{app.url}/v1/moe/layers/1/forward",
                                                                   _body()), ("GET", f"{app.url}/v1/status", None)):
            r = httpx.request(method, url, content=content, headers={**octet, **headers}, timeout=CLIENT_TIMEOUT_S)
            assert r.status_code == 401, (method, url, headers, r.text)
            assert r.json() == {"error": r.json()["error"], "type": "Unauthorized", "status": 401}
            assert "LMS_HTTP_TOKEN" in r.json()["error"] and r.headers["www-authenticate"] == "Bearer"
            assert SECRET not in r.text and WRONG not in r.text
    # Open: the health check (load balancers) and the schema (no data in either).
    assert httpx.get(f"{app.url}/healthz", timeout=CLIENT_TIMEOUT_S).status_code == 200
    assert "/v1/layers/{layer}/forward" in httpx.get(f"{app.url}/openapi.json", timeout=CLIENT_TIMEOUT_S).json()["paths"]
    # The right token: 200, through the clients as a user would call them.
    with HTTPMoEClient(app.url, token=SECRET, timeout_s=CLIENT_TIMEOUT_S) as http:
        out = http.forward(torch.randn(3, H), layer=1)
        assert out.shape == (3, H) and torch.isfinite(out).all()
        status = http.status()
    with HTTPMoEClient(app.url, token=WRONG, timeout_s=CLIENT_TIMEOUT_S) as http, \
            pytest.raises(MoERequestError, match="missing or wrong bearer token") as err:
        http.forward(torch.randn(3, H), layer=1)
    assert err.value.status == 401
    assert status["http_auth"] == {"mode": "bearer token from $LMS_HTTP_TOKEN", "token_env": "LMS_HTTP_TOKEN",
                                   "required": True}
    assert SECRET not in json.dumps(status)
    # Nor in any log of the session (driver, controller, proxy, ingress, replica, workers).
    leaked = [p.name for p in app.logs.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert leaked == []


@pytest.mark.ray
@pytest.mark.slow
def test_fuzz_every_route_from_its_openapi_schema(app):
    """schemathesis draws requests for every route of /openapi.json (path parameters, binary
    bodies, headers) and sends them to the running app: no 5xx, no hang (client timeout), every
    error a JSON body with ``error``. With the token (the routes' real work) and without (401s)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings

    schema = schemathesis.openapi.from_url(f"{app.url}/openapi.json", timeout=CLIENT_TIMEOUT_S)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert sorted(f"{op.method.upper()} {op.path}" for op in operations) == [
        "GET /healthz", "GET /v1/status", "POST /v1/layers/{layer}/forward", "POST /v1/sessions/move",
        "POST /v1/{deployment}/layers/{layer}/forward",
    ]
    forward = next(op for op in operations if op.path == "/v1/layers/{layer}/forward")
    assert "application/octet-stream" in json.dumps(forward.definition.raw["requestBody"])  # the body is declared
    seen: dict[str, set[int]] = {}

    def check(op, headers: dict[str, str], examples: int) -> None:
        @settings(max_examples=examples, deadline=timedelta(seconds=CLIENT_TIMEOUT_S), database=None,
                  derandomize=True, phases=[Phase.explicit, Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def one(case) -> None:
            response = case.call(base_url=app.url, headers=headers, timeout=CLIENT_TIMEOUT_S)
            where = f"{case.method} {case.formatted_path} -> {response.status_code}: {response.content[:300]!r}"
            seen.setdefault(op.path, set()).add(response.status_code)
            assert response.status_code < 500 or (op.path == "/healthz" and response.status_code == 503), where
            if response.status_code >= 400:
                body = json.loads(response.content)
                assert isinstance(body, dict) and isinstance(body.get("error"), str), where
            assert SECRET.encode() not in response.content, where

        one()

    for op in operations:
        check(op, {"Authorization": f"Bearer {SECRET}"}, FUZZ_EXAMPLES)
        check(op, {}, 5)
    # Both doors were exercised: requests the app refused as bad input and, without the token, 401.
    forward_codes = seen["/v1/layers/{layer}/forward"]
    assert 401 in forward_codes and forward_codes & {400, 404, 413}, seen
