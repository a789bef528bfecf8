"""The front for seeded sampling (no SGLang): what a deterministic request with temperature > 0
may carry, what SGLang gets, n > 1 split into single samples, and system_fingerprint."""

import json

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from test_middleware import CHAT, NOOP, client, make_app  # noqa: F401 - client is a fixture

from mg_server.config import DETERMINISTIC_PARAM, MARK_PARAM, SEED_PARAM, TEMPERATURE_PARAM, FrontConfig
from mg_server.front.rules import BadRequest, rewrite_body

DET = {"X-Deterministic": "1"}


def test_seeded_request_moves_its_rule_into_custom_params_and_sglang_decodes_greedily():
    out = rewrite_body({**CHAT, "temperature": 0.8, "seed": 42}, "/v1/chat/completions", NOOP, "mark")
    assert out["temperature"] == 0.0 and out["seed"] == 42
    assert out["custom_params"] == {DETERMINISTIC_PARAM: True, MARK_PARAM: "mark", TEMPERATURE_PARAM: 0.8,
                                    SEED_PARAM: 42}
    out = rewrite_body({"text": "x", "sampling_params": {"temperature": 1, "sampling_seed": -1}}, "/generate", NOOP,
                       "mark")
    assert out["sampling_params"]["custom_params"][SEED_PARAM] == 2 ** 64 - 1  # seeds are taken mod 2**64
    # greedy stays greedy, and top_p/top_k/min_p are still fine at temperature 0
    out = rewrite_body({**CHAT, "temperature": 0, "top_p": 0.5, "seed": 3}, "/v1/chat/completions", NOOP, "mark")
    assert out["custom_params"] == {DETERMINISTIC_PARAM: True, MARK_PARAM: "mark"}


def test_plain_requests_keep_sglangs_own_sampling(client):  # noqa: F811 - the fixture
    r = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0.8, "seed": 42})
    assert r.json()["body"] == {**CHAT, "temperature": 0.8, "seed": 42}


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
        rewrite_body({**CHAT, "temperature": float("inf"), "seed": 1}, "/v1/chat/completions", NOOP, "m")


def test_a_list_of_prompts_is_one_completion_each_with_a_verdict_each(tmp_path, monkeypatch):
    """/v1/completions with several prompts (and seeded n): one request per completion, each asked
    for its own verdict (SGLang gave them ids mg never saw: `unknown`); prompt-major choices."""
    from mg_server.front.verdict import RuntimeView

    asked = []

    async def verdicts(self, rids, correct=False):
        asked.extend(rids)
        return [("verified", None)] * len(rids)

    monkeypatch.setattr(RuntimeView, "verdicts", verdicts)

    monkeypatch.setattr(RuntimeView, "problem", lambda self: "")  # a runtime that is up

    async def answer(request: Request):
        body = await request.json()
        seed = (body.get("custom_params") or {}).get(SEED_PARAM)
        n = 0 if body.get("max_tokens") == 0 else 2
        return JSONResponse({"choices": [{"index": 0, "text": f"{body['prompt']}:{seed}"}],
                             "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}})

    client = make_app(FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path), max_deterministic=4,  # noqa: F811
                                  controller_ipc=str(tmp_path / "c.sock")),
                      [Route("/v1/completions", answer, methods=["POST"])])
    r = client.post("/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 4}, headers=DET)
    assert r.status_code == 200 and r.headers["x-mg-verdict"] == "verified" and len(asked) == 3, r.text
    assert [c["text"] for c in r.json()["choices"]] == ["a:None", "b:None", "c:None"]
    assert r.json()["usage"] == {"prompt_tokens": 9, "completion_tokens": 6, "total_tokens": 15}
    r = client.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "temperature": 0.5, "seed": 1}, headers=DET)
    assert [c["text"] for c in r.json()["choices"]] == ["a:1", "a:2", "b:1", "b:2"]
    assert r.json()["usage"]["prompt_tokens"] == 6  # each prompt once, whatever n
    r = client.post("/v1/completions", json={"prompt": [[1, 2], [3]], "max_tokens": 4}, headers=DET)
    assert len(r.json()["choices"]) == 2  # token-id prompts too; one list of ids is one prompt
    # asking for no token: settled per completion (the verdict was `unknown` for seeded n)
    asked.clear()
    r = client.post("/v1/completions", json={"prompt": "a", "n": 3, "temperature": 0.5, "seed": 1, "max_tokens": 0},
                    headers=DET)
    assert r.headers["x-mg-verdict"] == "verified" and asked == []
    r = client.post("/v1/completions", json={"prompt": ["a"] * 5}, headers=DET)  # more than the verifier holds
    assert r.status_code == 400 and r.json()["param"] == "prompt"
    r = client.post("/v1/completions", json={"prompt": ["a", "b"], "stream": True}, headers=DET)
    assert r.status_code == 400 and r.json()["param"] == "prompt"


def test_a_client_that_leaves_cancels_every_part():
    """The parts of a fanned-out request see the client's disconnect (SGLang then aborts them):
    before, `n: 64` samples ran on for minutes after the client had gone."""
    import asyncio

    from mg_server.front.samples import run_parts

    seen = []

    async def app(scope, receive, send):
        await receive()  # the body
        seen.append((await receive())["type"])  # SGLang's disconnect check

    async def client_receive():
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    asyncio.run(asyncio.wait_for(run_parts(app, {"headers": []}, [b"{}"] * 3, client_receive), 5))
    assert seen == ["http.disconnect"] * 3
