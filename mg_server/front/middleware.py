"""ASGI middleware in front of SGLang's FastAPI app.

- Maps the `X-Deterministic` request header (1/0/true/false, case-insensitive) onto the body's
  `custom_params` of the generation endpoints, so SGLang carries the flag to mg's forward hook.
  SGLang only forwards `custom_params` of requests that name a custom logit processor, so a
  deterministic request also gets mg's no-op processor.
- Answers any other header value, or a request that cannot be served greedily, with HTTP 400
  and an OpenAI-style JSON error; the server keeps serving.
- Echoes `X-Deterministic` on every response to a request that carried it.
- Serves `GET /metrics` from the prometheus multiprocess folder (mg's and SGLang's metrics).
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST

from mg_server import metrics
from mg_server.config import DETERMINISTIC_PARAM, FrontConfig

HEADER = b"x-deterministic"
_VALUES = {"1": True, "true": True, "0": False, "false": False}
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions")
NATIVE_PATHS = ("/generate",)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class BadRequest(Exception):
    pass


def parse_flag(raw: bytes) -> bool:
    value = raw.decode("latin-1").strip().lower()
    if value not in _VALUES:
        raise BadRequest(f"X-Deterministic must be one of 1, 0, true, false; got {value!r}")
    return _VALUES[value]


def _mark_params(params: Any, flag: bool, where: str) -> dict:
    """Return a copy of a request's sampling parameters with the mg flag set."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest(f"{where} must be an object")
    custom = params.get("custom_params")
    if custom is None:
        custom = {}
    if not isinstance(custom, dict):
        raise BadRequest(f"{where}.custom_params must be an object")
    out = dict(params)
    out["custom_params"] = {**custom, DETERMINISTIC_PARAM: flag}
    if flag:
        # Greedy decoding is what MarginGate makes deterministic; an unset temperature would
        # default to sampling, so it is pinned to 0, and sampling is refused.
        temperature = out.get("temperature")
        if temperature is None:
            out["temperature"] = 0.0
        elif not isinstance(temperature, (int, float)) or temperature != 0:
            raise BadRequest(
                f"X-Deterministic: 1 serves greedy decoding only; {where}.temperature must be 0 "
                f"(got {temperature!r})"
            )
    return out


def rewrite_body(body: dict, path: str, flag: bool, noop_processor: str) -> dict:
    """The request body as SGLang must see it for a request with X-Deterministic: flag."""
    if flag:
        existing = body.get("custom_logit_processor")
        if existing not in (None, noop_processor):
            raise BadRequest("X-Deterministic: 1 cannot be combined with a custom_logit_processor")
    if path in OPENAI_PATHS:
        out = _mark_params(body, flag, "request")
    else:  # /generate: flags live in sampling_params, one dict or one per prompt
        out = dict(body)
        params = body.get("sampling_params")
        if isinstance(params, list):
            out["sampling_params"] = [
                _mark_params(p, flag, f"sampling_params[{i}]") for i, p in enumerate(params)
            ]
        else:
            out["sampling_params"] = _mark_params(params, flag, "sampling_params")
    if flag:
        out["custom_logit_processor"] = noop_processor
    return out


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client disconnected")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls wait for the disconnect, as the original would

    return replay


async def _respond(send: Send, status: int, body: bytes, content_type: bytes, extra=()) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + list(extra)})
    await send({"type": "http.response.body", "body": body})


def error_body(message: str, status: int = 400) -> bytes:
    return json.dumps(
        {"object": "error", "message": message, "type": "BadRequestError", "param": "X-Deterministic", "code": status}
    ).encode()


class DeterministicMiddleware:
    def __init__(self, app, config: FrontConfig):
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        if path == "/metrics" and method == "GET":
            data = metrics.render(self.config.metrics_dir)
            return await _respond(send, 200, data, CONTENT_TYPE_LATEST.encode())

        raw = dict(scope["headers"]).get(HEADER)
        if raw is None:
            return await self.app(scope, receive, send)
        try:
            flag = parse_flag(raw)
        except BadRequest as e:
            return await _respond(send, 400, error_body(str(e)), b"application/json")
        echo = (HEADER, b"1" if flag else b"0")

        if method == "POST" and path in OPENAI_PATHS + NATIVE_PATHS:
            try:
                body = await _read_body(receive)
            except ConnectionError:
                return
            try:
                parsed = json.loads(body) if body else None
            except ValueError:
                parsed = None  # not JSON: SGLang answers it with its own error
            if isinstance(parsed, dict):
                try:
                    parsed = rewrite_body(parsed, path, flag, self.config.noop_processor)
                except BadRequest as e:
                    return await _respond(send, 400, error_body(str(e)), b"application/json", [echo])
                body = json.dumps(parsed).encode()
                headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
                scope = {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}
            receive = _replay(body, receive)

        async def send_with_echo(message: dict) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": list(message.get("headers", [])) + [echo]}
            await send(message)

        await self.app(scope, receive, send_with_echo)
