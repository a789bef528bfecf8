"""The X-Deterministic middleware, driven through a real ASGI app (no SGLang)."""

import json

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from mg_server.config import DETERMINISTIC_PARAM, FrontConfig
from mg_server.front.middleware import DeterministicMiddleware, parse_flag, BadRequest

NOOP = '{"callable": "00"}'


async def echo(request: Request):
    return JSONResponse({"body": await request.json()})


async def raw(request: Request):
    return JSONResponse({"raw": (await request.body()).decode()})


@pytest.fixture()
def client(tmp_path):
    app = Starlette(routes=[Route(p, echo, methods=["POST"]) for p in
                            ("/v1/chat/completions", "/v1/completions", "/other")]
                 + [Route("/generate", raw, methods=["POST"])])
    app.add_middleware(DeterministicMiddleware, config=FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path)))
    return TestClient(app)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("value,flag", [("1", True), ("true", True), ("TRUE", True), ("0", False), ("false", False)])
def test_flag_values_reach_custom_params(client, value, flag):
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Deterministic": value})
    assert r.status_code == 200
    assert r.headers["x-deterministic"] == ("1" if flag else "0")
    body = r.json()["body"]
    assert body["custom_params"] == {DETERMINISTIC_PARAM: flag}
    assert body.get("custom_logit_processor") == (NOOP if flag else None)
    assert body["messages"] == CHAT["messages"]


def test_no_header_passes_body_through_untouched(client):
    r = client.post("/v1/completions", json={"prompt": "x", "custom_params": {"a": 1}})
    assert r.json()["body"] == {"prompt": "x", "custom_params": {"a": 1}}
    assert "x-deterministic" not in r.headers


def test_existing_custom_params_are_kept(client):
    r = client.post("/v1/completions", json={"prompt": "x", "custom_params": {"a": 1}}, headers={"X-Deterministic": "1"})
    assert r.json()["body"]["custom_params"] == {"a": 1, DETERMINISTIC_PARAM: True}


def test_native_generate_single_and_batch(client):
    r = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 4}}, headers={"X-Deterministic": "1"})
    sent = json.loads(r.json()["raw"])
    sp = sent["sampling_params"]
    assert isinstance(sent["rid"], str) and sent["rid"].startswith("mg-")
    assert sp["custom_params"] == {DETERMINISTIC_PARAM: True} and sp["temperature"] == 0.0 and sp["max_new_tokens"] == 4
    r = client.post("/generate", json={"text": ["a", "b"], "sampling_params": [{}, {"temperature": 0}]}, headers={"X-Deterministic": "1"})
    sent = json.loads(r.json()["raw"])
    assert isinstance(sent["rid"], list) and len(sent["rid"]) == 2
    sps = sent["sampling_params"]
    assert [p["custom_params"][DETERMINISTIC_PARAM] for p in sps] == [True, True]


@pytest.mark.parametrize("value", ["maybe", "2", "", "yes"])
def test_bad_header_value_is_400_with_message(client, value):
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Deterministic": value})
    assert r.status_code == 400
    assert "X-Deterministic" in r.json()["message"]
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200  # still serving


def test_sampling_is_refused_and_unset_temperature_pinned_to_zero(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0.7}, headers={"X-Deterministic": "1"})
    assert r.status_code == 400 and "greedy" in r.json()["message"]
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Deterministic": "1"})
    assert r.json()["body"]["temperature"] == 0.0
    # not deterministic: sampling allowed and temperature untouched
    r = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0.7}, headers={"X-Deterministic": "0"})
    assert r.status_code == 200 and r.json()["body"]["temperature"] == 0.7


def test_conflicting_custom_processor_and_bad_params_are_400(client):
    r = client.post("/v1/completions", json={"prompt": "x", "custom_logit_processor": "other"}, headers={"X-Deterministic": "1"})
    assert r.status_code == 400
    r = client.post("/v1/completions", json={"prompt": "x", "custom_params": [1]}, headers={"X-Deterministic": "1"})
    assert r.status_code == 400


def test_non_json_body_is_left_to_the_app(client):
    # passed on byte for byte, for SGLang to answer with its own error; no crash, no hang
    r = client.post("/generate", content=b"not json", headers={"X-Deterministic": "1"})
    assert r.json()["raw"] == "not json" and r.headers["x-deterministic"] == "1"


def test_parse_flag():
    assert parse_flag(b" 1 ") is True
    with pytest.raises(BadRequest):
        parse_flag(b"on")


def test_metrics_endpoint_renders_multiprocess_dir(client):
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
