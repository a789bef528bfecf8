"""The X-Deterministic middleware, driven through a real ASGI app (no SGLang)."""

import json
import time
from pathlib import Path

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from mg_server.config import DETERMINISTIC_PARAM, MARK_PARAM, FrontConfig
from mg_server.front.middleware import DeterministicMiddleware
from mg_server.front.rules import BadRequest, parse_flag

NOOP = '{"callable": "00"}'


async def echo(request: Request):
    return JSONResponse({"body": await request.json()})


async def raw(request: Request):
    return JSONResponse({"raw": (await request.body()).decode()})


async def ok(request: Request):
    return JSONResponse({"ok": True})


def make_app(config: FrontConfig, extra_routes=()) -> TestClient:
    app = Starlette(routes=list(extra_routes) + [Route(p, echo, methods=["POST"]) for p in
                            ("/v1/chat/completions", "/v1/completions", "/other")]
                    + [Route("/generate", raw, methods=["POST", "PUT"])]
                    + [Route(p, ok, methods=["GET", "POST", "PUT"]) for p in
                       ("/health", "/v1/models", "/v1/responses", "/v1/messages", "/invocations", "/api/generate",
                        "/abort_request", "/v1/some_future_endpoint")])
    app.add_middleware(DeterministicMiddleware, config=config)
    return TestClient(app)


MARK = "m4rk"
FLAGGED = {DETERMINISTIC_PARAM: True, MARK_PARAM: MARK}  # what the front writes into custom_params


@pytest.fixture()
def client(tmp_path):
    return make_app(FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path), request_mark=MARK))


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("value,flag", [("1", True), ("true", True), ("TRUE", True), ("0", False), ("false", False)])
def test_flag_values_reach_custom_params(client, value, flag):
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Deterministic": value})
    assert r.status_code == 200
    assert r.headers["x-deterministic"] == ("1" if flag else "0")
    body = r.json()["body"]
    assert body.get("custom_params") == (FLAGGED if flag else None)  # a plain request is not rewritten
    assert body.get("custom_logit_processor") == (NOOP if flag else None)
    assert body["messages"] == CHAT["messages"]


def test_no_header_passes_body_through_untouched(client):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3})
    assert r.json()["body"] == {"prompt": "x", "max_tokens": 3}
    assert "x-deterministic" not in r.headers and r.headers["x-mg-verdict"] == "unverified"


def test_native_generate_single_and_batch(client):
    r = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 4}}, headers={"X-Deterministic": "1"})
    sent = json.loads(r.json()["raw"])
    sp = sent["sampling_params"]
    assert isinstance(sent["rid"], str) and sent["rid"].startswith("mg-")
    assert sp["custom_params"] == FLAGGED and sp["temperature"] == 0.0 and sp["max_new_tokens"] == 4
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


def test_sampling_without_seed_is_refused_and_unset_temperature_pinned_to_zero(client):
    r = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0.7}, headers={"X-Deterministic": "1"})
    assert r.status_code == 400 and "add an integer seed" in r.json()["message"] and r.json()["param"] == "seed"
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Deterministic": "1"})
    assert r.json()["body"]["temperature"] == 0.0
    # not deterministic: sampling allowed and temperature untouched
    r = client.post("/v1/chat/completions", json={**CHAT, "temperature": 0.7}, headers={"X-Deterministic": "0"})
    assert r.status_code == 200 and r.json()["body"]["temperature"] == 0.7


@pytest.mark.parametrize("header", [{}, {"X-Deterministic": "0"}, {"X-Deterministic": "1"}])
@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "x", "custom_logit_processor": "other"}),
    ("/v1/chat/completions", {**CHAT, "custom_params": {DETERMINISTIC_PARAM: True}}),
    ("/generate", {"text": "x", "sampling_params": {"custom_params": {MARK_PARAM: "guess"}}}),
    ("/generate", {"text": ["a", "b"], "custom_logit_processor": [None, "x"]}),
    ("/v1/responses", {"input": "x", "custom_logit_processor": "x"}),  # any route: SGLang's later ones too
    ("/other", {"instances": [{"text": "x"}], "parameters": {"custom_logit_processor": "x"}}),  # at any depth
])
def test_mgs_own_fields_are_refused_on_every_route_with_or_without_the_header(client, header, path, body):
    r = client.post(path, json=body, headers=header)
    assert r.status_code == 400 and "not accepted by this server" in r.json()["message"], r.text
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200  # still serving


@pytest.mark.parametrize("header", [{}, {"X-Deterministic": "0"}])
@pytest.mark.parametrize("body,words", [
    (b"not json", "is not valid JSON"), (b"[]", "must be a JSON object"), (b'"str"', "must be a JSON object"),
    (b"null", "must be a JSON object"), (b"[" * 1000 + b"]" * 1000, "nested too deeply")])
def test_a_plain_requests_malformed_body_is_a_400(client, header, body, words):
    for path in ("/generate", "/v1/chat/completions", "/other"):
        r = client.post(path, content=body, headers=header)
        assert r.status_code == 400 and words in r.json()["message"], (path, r.text)
        assert r.json()["type"] == "BadRequestError"


def test_a_compressed_body_is_refused_and_a_form_passes(client):
    r = client.post("/generate", content=b"\x1f\x8b...", headers={"Content-Encoding": "gzip"})
    assert r.status_code == 415 and "uncompressed" in r.json()["message"]
    r = client.post("/generate", files={"file": ("a.wav", b"RIFF")})
    assert r.status_code == 200 and "RIFF" in r.json()["raw"]


@pytest.mark.parametrize("header", [{}, {"X-Deterministic": "1"}])
def test_one_length_limit_reaches_sglang_and_the_newer_name_wins(client, header):
    for sent, got in [({"max_completion_tokens": 0, "max_tokens": 12}, 0), ({"max_completion_tokens": 5}, 5),
                      ({"max_tokens": 7}, 7), ({"max_completion_tokens": None, "max_tokens": 3}, 3)]:
        body = client.post("/v1/chat/completions", json={**CHAT, **sent}, headers=header).json()["body"]
        assert body.get("max_tokens") == got and "max_completion_tokens" not in body, (sent, body)
    for bad in ("0", 1.0, -1, True, [3]):
        r = client.post("/v1/completions", json={"prompt": "x", "max_completion_tokens": bad}, headers=header)
        assert r.status_code == 400 and r.json()["param"] == "max_completion_tokens", (bad, r.text)


def test_an_unknown_model_is_a_404(tmp_path):
    client = make_app(FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path), served_models=("/models/x",)))
    for model in ("default", "/models/x", None):
        assert client.post("/v1/chat/completions", json={**CHAT, "model": model}).status_code == 200
    r = client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4o"}, headers={"X-Deterministic": "1"})
    assert r.status_code == 404 and r.json()["code"] == "model_not_found" and "gpt-4o" in r.json()["message"]
    assert r.headers["x-mg-verdict"] == "failed"


def test_the_header_spelt_with_an_underscore_is_refused(client):
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X_Deterministic": "1"})
    assert r.status_code == 400 and "dash" in r.json()["message"]


def test_a_body_that_trickles_in_is_a_408(tmp_path):
    import asyncio

    app = DeterministicMiddleware(None, FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path),
                                                    body_timeout_s=0.2))
    sent = []

    async def receive():
        await asyncio.sleep(10)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/generate", "method": "POST", "headers": []}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 5))
    assert sent[0]["status"] == 408


def _refused_as_failed(r, words: str) -> None:
    assert r.status_code == 400 and words in r.json()["message"], (r.status_code, r.text)
    assert r.headers["x-mg-verdict"] == "failed" and r.headers["x-deterministic-verified"] == "false"


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions"])
@pytest.mark.parametrize("body,words", [
    (b"not json", "is not valid JSON"),
    (b"[" * 1000 + b"]" * 1000, "nested too deeply"),  # (json's recursion limit: a 500 before)
    (b"[]", "must be a JSON object"), (b'"str"', "must be a JSON object"), (b"123", "must be a JSON object"),
    (b"null", "must be a JSON object"), (b"", "must be a JSON object")])
def test_a_deterministic_requests_malformed_body_is_a_400_with_verdict_failed(client, path, body, words):
    _refused_as_failed(client.post(path, content=body, headers={"X-Deterministic": "1"}), words)


def test_deep_nesting_in_a_plain_token_path_body_is_no_500(tmp_path):
    client = make_app(FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path), vocab_size=100))
    r = client.post("/generate", content=b"[" * 1000 + b"]" * 1000)
    assert r.status_code < 500  # left to the app (SGLang answers a 400)


def test_a_body_over_the_size_limit_is_a_413_before_it_is_read(tmp_path):
    client = make_app(FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path), max_body_bytes=1000, vocab_size=100))
    big = {"input_ids": list(range(50)) * 40}
    r = client.post("/generate", json=big, headers={"X-Deterministic": "1"})
    assert r.status_code == 413 and "larger than 1000 bytes" in r.json()["message"]
    assert r.headers["x-mg-verdict"] == "failed"
    r = client.post("/v1/chat/completions", content=(b"x" * 600 for _ in range(2)))  # chunked: no length
    assert r.status_code == 413 and "x-mg-verdict" not in r.headers
    assert client.post("/generate", json={"input_ids": [1, 2]}).status_code == 200  # under it: served


def test_a_rid_that_is_not_utf8_text_is_a_400(client):
    # a lone surrogate survives JSON but no encoder: an encoding error, not an outage (a 503 before)
    body = b'{"text": "x", "rid": "a\\ud800b"}'
    _refused_as_failed(client.post("/generate", content=body, headers={"X-Deterministic": "1"}), "UTF-8")
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "rid": "\\udfff"}'
    _refused_as_failed(client.post("/v1/chat/completions", content=body, headers={"X-Deterministic": "1"}), "UTF-8")


def test_a_header_sent_twice_is_a_400(client):
    for values in (["1", "0"], ["0", "1"], ["1", "1"]):
        r = client.post("/v1/chat/completions", json=CHAT, headers=[("X-Deterministic", v) for v in values])
        _refused_as_failed(r, "sent 2 times")


def test_every_refusal_of_a_deterministic_request_says_failed(client, tmp_path):
    cases = [({**CHAT, "temperature": 0.8}, "seed"), ({**CHAT, "logprobs": True, "top_logprobs": 2}, "logprobs"),
             ({**CHAT, "frequency_penalty": 0.5}, "frequency_penalty")]
    for body, words in cases:
        _refused_as_failed(client.post("/v1/chat/completions", json=body, headers={"X-Deterministic": "1"}), words)
    _refused_as_failed(client.post("/abort_request", json={}, headers={"X-Deterministic": "1"}), "served on")
    tokens = make_app(FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path), vocab_size=100))
    _refused_as_failed(tokens.post("/generate", json={"input_ids": [5, 100]}, headers={"X-Deterministic": "1"}),
                       "not in the model's vocabulary")
    _refused_as_failed(client.post("/v1/chat/completions", json=CHAT, headers={"X-Deterministic": "yes"}), "one of")
    # a refusal of a request that asked for a plain answer has no deterministic verdict
    r = client.post("/abort_request", json={}, headers={"X-Deterministic": "0"})
    assert r.status_code == 400 and "x-mg-verdict" not in r.headers and r.headers["x-deterministic"] == "0"


def test_parse_flag():
    assert parse_flag(b" 1 ") is True
    with pytest.raises(BadRequest):
        parse_flag(b"on")


def test_metrics_endpoint_renders_multiprocess_dir(client):
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")


# ---- endpoints: deny by default --------------------------------------------------------------

@pytest.mark.parametrize("method,path", [("POST", "/v1/responses"), ("POST", "/v1/messages"), ("POST", "/invocations"),
                                         ("POST", "/api/generate"), ("POST", "/abort_request"),
                                         ("POST", "/v1/some_future_endpoint"), ("GET", "/v1/responses")])
@pytest.mark.parametrize("value", ["1", "0"])
def test_the_header_on_an_endpoint_mg_does_not_handle_is_400(client, method, path, value):
    r = client.request(method, path, json={"model": "m", "input": "hi", "temperature": 0.9},
                       headers={"X-Deterministic": value})
    assert r.status_code == 400, r.text
    msg = r.json()["message"]
    assert path in msg and "/v1/chat/completions" in msg and "/generate" in msg
    assert client.request(method, path, json={"input": "hi"}).status_code == 200  # without it: untouched


def test_the_header_passes_on_read_only_endpoints_and_put_generate_is_served(client):
    for path in ("/health", "/v1/models"):
        r = client.get(path, headers={"X-Deterministic": "1"})
        assert r.status_code == 200 and r.headers["x-deterministic"] == "1"
    r = client.put("/generate", json={"text": "x", "sampling_params": {"temperature": 0.9}}, headers={"X-Deterministic": "1"})
    assert r.status_code == 400 and "sampling_seed" in r.json()["message"]  # the same checks as POST
    r = client.put("/generate", json={"text": "x"}, headers={"X-Deterministic": "1"})
    sent = json.loads(r.json()["raw"])
    assert sent["sampling_params"]["custom_params"] == FLAGGED
    assert r.headers["x-mg-verdict"] == "unverified"  # mode off here: a verdict, never silence


# ---- parameters the verifier does not model ---------------------------------------------------

SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("path,extra,param", [
    ("/v1/chat/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"presence_penalty": -1}, "presence_penalty"),
    ("/v1/chat/completions", {"repetition_penalty": 1.3}, "repetition_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"42": 100}}, "logit_bias"),
    ("/v1/chat/completions", {"logprobs": True}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"min_tokens": 5}, "min_tokens"),
    ("/v1/chat/completions", {"regex": "[0-9]+"}, "regex"),
    ("/v1/chat/completions", {"ebnf": "root ::= 'a'"}, "ebnf"),
    ("/v1/chat/completions", {"response_format": SCHEMA}, "response_format"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"tools": [TOOL], "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"tools": [{**TOOL, "function": {**TOOL["function"], "strict": True}}]},
     "tools[0].function.strict"),
    ("/v1/chat/completions", {"lora_path": "adapter"}, "lora_path"),
    ("/v1/chat/completions", {"n": 2}, "n"),
    ("/v1/completions", {"logprobs": 0}, "logprobs"),
    ("/v1/completions", {"json_schema": "{}"}, "json_schema"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/generate", {"return_logprob": True}, "return_logprob"),
    ("/generate", {"return_hidden_states": True}, "return_hidden_states"),
    ("/generate", {"return_routed_experts": True}, "return_routed_experts"),
    ("/v1/chat/completions", {"return_hidden_states": True}, "return_hidden_states"),
    ("/generate", {"sampling_params": {"frequency_penalty": 0.2}}, "sampling_params.frequency_penalty"),
    ("/generate", {"sampling_params": {"min_new_tokens": 3}}, "sampling_params.min_new_tokens"),
    ("/generate", {"sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema"),
    ("/generate", {"sampling_params": {"structural_tag": "{}"}}, "sampling_params.structural_tag"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"n": 2}]}, "sampling_params[1].n"),
    ("/generate", {"text": ["a", "b"], "sampling_params": [{}, {"logit_bias": {"1": 5}}]},
     "sampling_params[1].logit_bias"),
    ("/generate", {"input_embeds": [[0.0]]}, "input_embeds"),
    ("/v1/chat/completions", {"watermark": {"enabled": True}}, "watermark"),
    ("/generate", {"watermark": {"enabled": True}}, "watermark"),
    ("/generate", {"sampling_params": {"watermark": {"enabled": True}}}, "sampling_params.watermark"),
    ("/generate", {"max_thinking_tokens": 64}, "max_thinking_tokens"),
    ("/generate", {"sampling_params": {"beam_width": 4}}, "sampling_params.beam_width"),
])
def test_parameters_the_verifier_does_not_model_are_400_naming_them(client, path, extra, param):
    base = {"/v1/chat/completions": CHAT, "/v1/completions": {"prompt": "x"}, "/generate": {"text": "x"}}[path]
    r = client.post(path, json={**base, **extra}, headers={"X-Deterministic": "1"})
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["param"] == param and param in body["message"]
    assert client.post(path, json={**base, **extra}).status_code == 200  # plain requests: SGLang's business


def test_neutral_values_and_greedy_invariant_options_are_accepted(client):
    # at temperature 0 SGLang samples with top_k = 1: top_p, top_k, min_p and seed cannot change the token
    extra = {"frequency_penalty": 0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "logprobs": False,
             "top_logprobs": 0, "n": 1, "top_p": 0.5, "top_k": 5, "min_p": 0.2, "seed": 7,
             "response_format": {"type": "text"}, "tools": [TOOL], "tool_choice": "auto"}
    r = client.post("/v1/chat/completions", json={**CHAT, **extra}, headers={"X-Deterministic": "1"})
    assert r.status_code == 200, r.text


# ---- verdicts: an error never carries `verified` ----------------------------------------------

@pytest.fixture()
def verified_client(tmp_path, monkeypatch):
    """A front whose controller would say `verified` for any rid it is asked about."""
    from mg_server.front.verdict import RuntimeView

    asked = []

    async def verdicts(self, rids, correct=False):
        asked.extend(rids)
        return [("verified", None)] * len(rids)

    monkeypatch.setattr(RuntimeView, "verdicts", verdicts)

    async def dup(request: Request):  # SGLang's answer to a rid another request is using
        return JSONResponse({"object": "error", "message": "Duplicate request IDs detected"}, status_code=400)

    async def stream_error(request: Request):
        async def events():
            yield b'data: {"error": {"message": "deterministic decoding failed"}}\n\n'
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    async def stream_ok(request: Request):
        async def events():
            yield b'data: {"choices": [{"delta": {"content": "data: {\\"error\\""}}]}\n\n'
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [Route("/v1/completions", dup, methods=["POST"]), Route("/v1/chat/completions", stream_error, methods=["POST"]),
              Route("/generate", stream_ok, methods=["POST"])]
    client = make_app(FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path)), routes)
    return client, asked


def test_error_responses_are_failed_without_asking_the_controller(verified_client):
    client, asked = verified_client
    r = client.post("/v1/completions", json={"prompt": "x", "rid": "someone-elses"}, headers={"X-Deterministic": "1"})
    assert r.status_code == 400
    assert r.headers["x-deterministic-verified"] == "false" and r.headers["x-mg-verdict"] == "failed"
    r = client.post("/v1/chat/completions", json=CHAT, headers={"X-Deterministic": "1"})
    assert '"mg_verdict": {"verified": false, "verdict": "failed"' in r.text and '"states": ["failed"]' in r.text
    assert asked == []
    # a token that merely spells the marker is not an error event
    r = client.post("/generate", json={"text": "x"}, headers={"X-Deterministic": "1"})
    assert '"states": ["verified"]' in r.text and len(asked) == 1


def test_an_empty_answer_is_verified_without_the_controller_only_if_it_is_empty(monkeypatch, tmp_path):
    """max_tokens 0 (either name, on every endpoint): mg sees no step, so the front settles the
    verdict; it says `verified` only for an answer that has no token (a length limit SGLang did not
    honour was a false `verified`)."""
    from mg_server.front.verdict import RuntimeView

    async def never(self, rids, correct=False):
        raise AssertionError("asked the controller")

    monkeypatch.setattr(RuntimeView, "verdicts", never)
    tokens = {"n": 0}  # how many tokens the fake SGLang answers with

    async def openai(request: Request):
        n = tokens["n"]
        return JSONResponse({"choices": [{"index": 0, "text": "x" * n}], "usage": {
            "prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}})

    async def generate(request: Request):
        body = await request.json()
        one = {"text": "x" * tokens["n"], "meta_info": {"completion_tokens": tokens["n"]}}
        return JSONResponse([one] * len(body["text"]) if isinstance(body["text"], list) else one)

    async def stream(request: Request):
        async def events():
            yield b'data: {"choices": [{"index": 0, "delta": {"content": "' + b"x" * tokens["n"] + b'"}}]}\n\n'
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    routes = [Route("/v1/completions", openai, methods=["POST"]), Route("/generate", generate, methods=["POST"]),
              Route("/v1/chat/completions", stream, methods=["POST"])]
    client = make_app(FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path)), routes)
    det = {"X-Deterministic": "1"}
    for n, verdict in ((0, "verified"), (4, "failed")):
        tokens["n"] = n
        r = client.post("/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 0}}, headers=det)
        assert r.headers["x-mg-verdict"] == verdict
        r = client.post("/generate", json={"text": ["x", "y"], "sampling_params": {"max_new_tokens": 0}}, headers=det)
        assert r.headers["x-mg-verdict"] == verdict
        for limit in ({"max_tokens": 0}, {"max_completion_tokens": 0}, {"max_tokens": 5, "max_completion_tokens": 0}):
            r = client.post("/v1/completions", json={"prompt": "x", **limit}, headers=det)
            assert r.headers["x-mg-verdict"] == verdict, (limit, r.text)
        r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 0, "stream": True}, headers=det)
        assert f'"verdict": "{verdict}"' in r.text


# ---- health -----------------------------------------------------------------------------------

def test_health_is_503_while_mg_cannot_serve_deterministic_requests(tmp_path):
    from mg_server.wire.liveness import beat_path

    ipc = str(tmp_path / "controller.sock")
    client = make_app(FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path), controller_ipc=ipc))
    beat = Path(beat_path(ipc))
    beat.write_text(f"{time.monotonic():.3f} verifier up")
    assert client.get("/health").status_code == 200
    beat.write_text(f"{time.monotonic():.3f} verifier down: the verifier process exited (code -9)")
    r = client.get("/health")
    assert r.status_code == 503 and "verifier down" in r.json()["message"]
    beat.write_text(f"{time.monotonic() - 60:.3f} verifier up")  # a controller that stopped beating
    r = client.get("/health", headers={"X-Deterministic": "1"})
    assert r.status_code == 503 and "controller is not responding" in r.json()["message"]
    assert client.post("/v1/completions", json={"prompt": "x"}).status_code == 200  # plain traffic goes on
    # a deterministic request while a worker is down or restarting: a 503 with the reason at once
    beat.write_text(f"{time.monotonic():.3f} verifier down: restarting after: the verifier process exited")
    r = client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Deterministic": "1"})
    assert r.status_code == 503 and "restarting after" in r.json()["message"]
    assert r.headers["x-mg-verdict"] == "failed"


def test_weight_updates_are_refused_while_mg_is_on(tmp_path):
    on = make_app(FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path), controller_ipc=str(tmp_path / "c")))
    for path in ("/update_weights_from_disk", "/update_weights_from_tensor", "/release_memory_occupation"):
        r = on.post(path, json={})
        assert r.status_code == 403 and "--mg-mode off" in r.json()["message"], r.text
    off = make_app(FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path)))  # mode off: SGLang's
    assert off.post("/update_weights_from_disk", json={}).status_code == 404  # (no such route in this app)
