"""What the front never lets out: tracebacks, server paths and mg's
internal state in error bodies, secrets in server info, /metrics without the API key. Driven
through the real middleware on a small ASGI app (no SGLang)."""

import json

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from mg_server.config import FrontConfig
from mg_server.front.middleware import DeterministicMiddleware
from mg_server.front.redact import MAX_MESSAGE, short_message

TRACE = ("1 validation error: bad text\n\n  File \"/work/x/.venv/lib/python3.11/site-packages/sglang/srt/entrypoints/"
         "http_server.py\", line 657, in generate_request\n    raise ValueError")


async def validation(request):
    return JSONResponse({"object": "error", "message": TRACE, "code": 400}, status_code=400)


async def internal(request):
    return PlainTextResponse("Traceback (most recent call last):\n  File \"/usr/lib/x.py\"", status_code=500)


async def failed(request):
    return JSONResponse({"error": {"message": "verifier failed to load '/root/.cache/mg_server/models/M': "
                                              + "x" * 1000}}, status_code=503)


async def info(request):
    return JSONResponse({"api_key": "sekret", "admin_api_key": None, "ssl_keyfile_password": "pw",
                         "model_path": "/root/m", "max_total_tokens": 65536, "tokenizer_path": "/root/m",
                         "internal_states": [{"hf_token": "hf_abc"}]})


async def stream(request):
    async def events():
        yield b"data: {\"text\": \"/root/x/y.py\"}\n\n"
    return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture()
def client(tmp_path):
    app = Starlette(routes=[Route("/generate", validation, methods=["POST"]), Route("/boom", internal),
                            Route("/v1/completions", failed, methods=["POST"]), Route("/get_server_info", info),
                            Route("/server_info", info), Route("/s", stream)])
    app.add_middleware(DeterministicMiddleware, config=FrontConfig(noop_processor="{}", metrics_dir=str(tmp_path),
                                                                   api_key="sekret"))
    return TestClient(app)


def test_error_bodies_are_short_without_tracebacks_or_paths(client):
    r = client.post("/generate", json={"text": 5})
    assert r.status_code == 400 and r.json()["message"] == "1 validation error: bad text"
    assert int(r.headers["content-length"]) == len(r.content)
    r = client.get("/boom")
    assert r.status_code == 500 and "File" not in r.text and "/usr" not in r.text
    r = client.post("/v1/completions", json={})
    msg = r.json()["error"]["message"]
    assert r.status_code == 503 and "/root" not in msg and "<path>" in msg and len(msg) <= MAX_MESSAGE


def test_successful_streams_and_url_paths_are_untouched(client):
    assert client.get("/s").text == "data: {\"text\": \"/root/x/y.py\"}\n\n"
    assert short_message("use POST /v1/chat/completions or POST|PUT /generate") == \
        "use POST /v1/chat/completions or POST|PUT /generate"


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info"])
def test_server_info_never_returns_secrets(client, path):
    body = client.get(path).json()
    assert "sekret" not in str(body) and "pw" not in str(body.values()) and "hf_abc" not in str(body)
    assert body["api_key"] == "<redacted>" and body["admin_api_key"] is None
    assert body["max_total_tokens"] == 65536 and body["tokenizer_path"] == "/root/m"  # not secrets


def test_metrics_need_the_api_key(client):
    assert client.get("/metrics").status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert client.get("/metrics", headers={"Authorization": "Bearer sekret"}).status_code == 200


def test_bodies_sglang_does_not_survive_are_refused():
    from mg_server.front.tokens import bad_token_ids

    assert "input_ids" in bad_token_ids({"input_ids": [[1, 100]]}, "/generate", 100)
    assert "input_ids" in bad_token_ids({"input_ids": [1, -1]}, "/generate", 100)
    assert "prompt" in bad_token_ids({"prompt": [100]}, "/v1/completions", 100)
    assert "max_new_tokens" in bad_token_ids({"text": "a", "sampling_params": {"max_new_tokens": "many"}},
                                             "/generate", 100)
    assert "[1].top_k" in bad_token_ids({"text": ["a", "b"], "sampling_params": [{}, {"top_k": 1.5}]},
                                        "/generate", 100)
    for ok in ({"input_ids": [[0, 99]], "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
               {"text": "ids in text: 500", "sampling_params": None}, {"prompt": "text"}, {"prompt": ["a", "b"]}):
        assert bad_token_ids(ok, "/generate" if "prompt" not in ok else "/v1/completions", 100) == ""


def test_a_validation_error_echoes_no_input_and_no_secret():
    """SGLang's 400 for a deterministic request echoed the body it got: mg's processor string, its
    mark and instance id. The front keeps each error's place and message, and OpenAI's type name."""
    from mg_server.front.redact import clean_error

    body = {"object": "error", "type": "Bad Request", "param": None, "code": 400, "message": (
        "2 validation errors:\n  {'type': 'int_parsing', 'loc': ('body', 'max_tokens'), 'msg': 'Input should be a "
        "valid integer', 'input': {'custom_params': {'mg_mark': 'SECRET', 'mg_instance': 'i'}, "
        "'custom_logit_processor': 'PROC'}}\n  {'type': 'x', 'loc': ('body', 'messages', 0, 'function-after[v()]', "
        "'role'), 'msg': 'bad role', 'input': 'SECRET'}")}
    mark, proc = "S" * 32, '{"callable": "8004' + "0" * 20 + '"}'
    body["message"] = body["message"].replace("SECRET", mark).replace("PROC", proc)
    out = json.loads(clean_error(json.dumps(body).encode(), secrets=(mark, proc)))
    assert out["type"] == "BadRequestError"
    assert out["message"] == "2 validation errors:\n  max_tokens: Input should be a valid integer\n" \
                             "  messages.0.role: bad role"
    text = json.dumps({"message": f"the mark {mark} and {proc}", "type": "Not Found"}).encode()
    plain = json.loads(clean_error(text, (mark, proc)))
    assert plain == {"message": "the mark <mg> and <mg>", "type": "NotFoundError"}
