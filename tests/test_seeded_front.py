"""The front for seeded sampling (no SGLang): what a deterministic request with temperature > 0
may carry, what SGLang gets, n > 1 split into single samples, and system_fingerprint."""

import json

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from test_middleware import CHAT, NOOP, client, make_app  # noqa: F401 - client is a fixture

from mg_server.config import DETERMINISTIC_PARAM, SEED_PARAM, TEMPERATURE_PARAM, FrontConfig
from mg_server.front.policy import BadRequest, rewrite_body

DET = {"X-Deterministic": "1"}


def test_seeded_request_moves_its_rule_into_custom_params_and_sglang_decodes_greedily():
    out = rewrite_body({**CHAT, "temperature": 0.8, "seed": 42}, "/v1/chat/completions", True, NOOP)
    assert out["temperature"] == 0.0 and out["seed"] == 42
    assert out["custom_params"] == {DETERMINISTIC_PARAM: True, TEMPERATURE_PARAM: 0.8, SEED_PARAM: 42}
    out = rewrite_body({"text": "x", "sampling_params": {"temperature": 1, "sampling_seed": -1}}, "/generate", True,
                       NOOP)
    assert out["sampling_params"]["custom_params"][SEED_PARAM] == 2 ** 64 - 1  # seeds are taken mod 2**64
    # greedy stays greedy, and top_p/top_k/min_p are still fine at temperature 0; a client's own
    # mg sampling keys never pass unchecked
    out = rewrite_body({**CHAT, "temperature": 0, "top_p": 0.5, "seed": 3,
                        "custom_params": {TEMPERATURE_PARAM: 2.0, SEED_PARAM: 1, "x": 1}}, "/v1/chat/completions", True,
                       NOOP)
    assert out["custom_params"] == {DETERMINISTIC_PARAM: True, "x": 1}
    # plain requests keep SGLang's own sampling untouched
    out = rewrite_body({**CHAT, "temperature": 0.8, "seed": 42}, "/v1/chat/completions", False, NOOP)
    assert out["temperature"] == 0.8 and out["custom_params"] == {DETERMINISTIC_PARAM: False}


@pytest.mark.parametrize("params,param", [
    ({"temperature": 0.8}, "seed"),
    ({"temperature": 0.8, "seed": "7"}, "seed"),
    ({"temperature": 0.8, "seed": True}, "seed"),
    ({"temperature": -0.5, "seed": 1}, "temperature"),
    ({"temperature": "hot", "seed": 1}, "temperature"),
    ({"temperature": 0.8, "seed": 1, "top_p": 0.9}, "top_p"),
    ({"temperature": 0.8, "seed": 1, "top_k": 40}, "top_k"),
    ({"temperature": 0.8, "seed": 1, "min_p": 0.1}, "min_p"),
    ({"temperature": 0.8, "seed": 1, "n": 2, "stream": True}, "n"),
    ({"temperature": 0.8, "n": 2}, "n"),  # no seed: n > 1 stays refused
    ({"temperature": 0.8, "seed": 1, "best_of": 2}, "best_of"),
])
def test_refusals_name_the_parameter(client, params, param):  # noqa: F811 - the fixture
    r = client.post("/v1/chat/completions", json={**CHAT, **params}, headers=DET)
    assert r.status_code == 400 and r.json()["param"] == param, r.json()
    assert param in r.json()["message"]


def test_generate_n_becomes_a_batch_of_single_samples(client):  # noqa: F811 - the fixture
    r = client.post("/generate", json={"text": "x", "rid": "r", "sampling_params": {
        "temperature": 0.8, "sampling_seed": 10, "n": 3, "max_new_tokens": 4}}, headers=DET)
    sent = json.loads(r.json()["raw"])
    assert sent["text"] == ["x"] * 3 and sent["rid"] == ["r-0", "r-1", "r-2"]
    assert [p["custom_params"][SEED_PARAM] for p in sent["sampling_params"]] == [10, 11, 12]
    assert all(p["n"] == 1 and p["temperature"] == 0 for p in sent["sampling_params"])
    r = client.post("/generate", json={"text": ["x", "y"], "sampling_params": {
        "temperature": 0.8, "sampling_seed": 10, "n": 3}}, headers=DET)
    assert r.status_code == 400 and r.json()["param"] == "sampling_params.n"


async def fake_completion(request: Request):
    body = await request.json()
    seed = (body.get("custom_params") or {}).get(SEED_PARAM)
    if seed == 666:
        return JSONResponse({"object": "error", "message": "boom"}, status_code=503)
    return JSONResponse({"id": "c", "object": "text_completion", "choices": [
        {"index": 0, "text": f"seed={seed} n={body.get('n')}", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})


def test_openai_n_is_fanned_out_merged_and_fingerprinted(tmp_path):
    client = make_app(FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path), system_fingerprint="fp_abc"),  # noqa: F811
                      [Route("/v1/completions", fake_completion, methods=["POST"])])
    req = {"model": "m", "prompt": "hi", "temperature": 0.8, "seed": 5, "n": 3}
    r = client.post("/v1/completions", json=req, headers=DET)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["text"] for c in body["choices"]] == ["seed=5 n=1", "seed=6 n=1", "seed=7 n=1"]
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}
    assert body["system_fingerprint"] == "fp_abc" and r.headers["x-mg-system-fingerprint"] == "fp_abc"
    assert r.headers["x-mg-verdict"] == "unverified"  # no controller here: nothing checked the tokens
    # a single request gets the field too; a plain one does not
    single = client.post("/v1/completions", json={**req, "n": 1}, headers=DET)
    assert single.json()["system_fingerprint"] == "fp_abc" and single.json()["choices"][0]["text"] == "seed=5 n=1"
    plain = client.post("/v1/completions", json=req)
    assert "system_fingerprint" not in plain.json() and "x-mg-system-fingerprint" not in plain.headers
    # one failed sample fails the whole answer
    r = client.post("/v1/completions", json={**req, "seed": 665}, headers=DET)
    assert r.status_code == 503 and r.headers["x-mg-verdict"] == "failed"


def test_policy_helpers_raise_bad_request():
    with pytest.raises(BadRequest):
        rewrite_body({**CHAT, "temperature": float("inf"), "seed": 1}, "/v1/chat/completions", True, NOOP)
