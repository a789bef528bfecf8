"""ASGI middleware in front of SGLang's FastAPI app (the outermost layer of the HTTP server).

- `X-Deterministic` (front.policy): a bad value, an endpoint mg does not handle, or a
  parameter the verifier does not model is a 400 with an OpenAI-style JSON error naming what to
  change; the server keeps serving. On the generation endpoints the flag goes into the body's
  `custom_params` (SGLang forwards those only for requests that name a custom logit processor,
  so a deterministic request also gets mg's no-op processor) and a deterministic request gets
  a request id from mg unless it brought one.
- Echoes `X-Deterministic` on every response to a request that carried it; a deterministic
  response carries its verdict (front.verdict): `X-Deterministic-Verified: true|false`,
  `X-MG-Verdict` and the verifier's `X-MG-Kernel-Config`. A non-streamed response waits for the
  request's final audit; a stream sends the verdict as an SSE comment line (`: mg-verdict {...}`)
  before `data: [DONE]`, since its headers left before the tokens existed.
- `GET /health` (and `/health_generate`) is a 503 with a JSON reason while mg's runtime cannot
  serve deterministic requests (controller not beating, verifier down); otherwise SGLang answers.
- Serves `GET /metrics` from the prometheus multiprocess folder (mg's and SGLang's metrics),
  behind the server's `--api-key` when it has one.
- Errors get short messages and server info loses its secrets (front.redact); token ids
  outside the vocabulary are a 400 for every request (front.tokens: one stopped the server).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST

from mg_server import metrics
from mg_server.config import DETERMINISTIC_PARAM, INSTANCE_PARAM, FrontConfig, instance_key
from mg_server.front.policy import BadRequest, empty_answer_rids, parse_flag, rewrite_body, route
from mg_server.front.redact import INFO_PATHS, bearer_ok, cleaning_sender
from mg_server.front.tokens import TOKEN_PATHS, bad_token_ids
from mg_server.front.verdict import RuntimeView, verdict_sender
from mg_server.runtime.protocol import VerdictState

HEADER = b"x-deterministic"
HEALTH_PATHS = ("/health", "/health_generate")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


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


def _stamp_instance(body: dict) -> str:
    """Give this request's flagged parameter sets a fresh instance id (see config.INSTANCE_PARAM)."""
    inst = uuid.uuid4().hex[:16]
    params = body.get("sampling_params", body)  # /generate: one dict or a list; OpenAI: the body
    for p in params if isinstance(params, list) else [params]:
        custom = p.get("custom_params") if isinstance(p, dict) else None
        if isinstance(custom, dict) and custom.get(DETERMINISTIC_PARAM):
            custom[INSTANCE_PARAM] = inst
    return inst


def error_body(message: str, status: int = 400, param: str = "X-Deterministic") -> bytes:
    kind = {400: "BadRequestError", 401: "AuthenticationError"}.get(status, "ServiceUnavailableError")
    return json.dumps({"object": "error", "message": message, "type": kind, "param": param, "code": status}).encode()


class DeterministicMiddleware:
    def __init__(self, app, config: FrontConfig):
        self.app = app
        self.config = config
        self.runtime = RuntimeView(config)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, method = scope["path"], scope["method"]
        send = cleaning_sender(send, info=method == "GET" and path in INFO_PATHS)  # front.redact
        if path == "/metrics" and method == "GET":
            if self.config.api_key and not bearer_ok(scope["headers"], self.config.api_key):
                return await _respond(send, 401, error_body("/metrics needs the server's API key", 401,
                                                            "Authorization"), b"application/json")
            data = metrics.render(self.config.metrics_dir)
            return await _respond(send, 200, data, CONTENT_TYPE_LATEST.encode())
        if path in HEALTH_PATHS and method == "GET":
            problem = self.runtime.problem()
            if problem:
                return await _respond(send, 503, error_body(problem, 503, "mg"), b"application/json")

        if path in TOKEN_PATHS and method in ("POST", "PUT") and self.config.vocab_size:
            try:
                body = await _read_body(receive)
            except ConnectionError:
                return
            try:
                problem = bad_token_ids(json.loads(body), path, self.config.vocab_size)
            except ValueError:
                problem = ""  # not JSON: SGLang answers it
            if problem:
                return await _respond(send, 400, error_body(problem, param=problem.partition(":")[0]),
                                      b"application/json")
            receive = _replay(body, receive)
        raw = dict(scope["headers"]).get(HEADER)
        if raw is None:
            return await self.app(scope, receive, send)
        try:
            flag = parse_flag(raw)
            kind = route(method, path)
        except BadRequest as e:
            return await _respond(send, 400, error_body(str(e), param=e.param), b"application/json")
        echo = (HEADER, b"1" if flag else b"0")
        rids: list[str] = []
        settled: dict[str, str] = {}

        if kind == "rewrite":
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
                    return await _respond(send, 400, error_body(str(e), param=e.param), b"application/json", [echo])
                if flag:
                    rid = parsed["rid"]
                    rids = [rid] if isinstance(rid, str) else list(rid)
                    empty = empty_answer_rids(parsed, rids)
                    if self.config.controller_ipc:  # verdicts are asked per request instance
                        inst = _stamp_instance(parsed)
                        empty = {instance_key(r, inst) for r in empty}
                        rids = [instance_key(r, inst) for r in rids]
                    settled = dict.fromkeys(empty, VerdictState.VERIFIED)
                body = json.dumps(parsed).encode()
                headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
                scope = {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}
            receive = _replay(body, receive)

        if not rids:
            async def send_with_echo(message: dict) -> None:
                if message["type"] == "http.response.start":
                    message = {**message, "headers": list(message.get("headers", [])) + [echo]}
                await send(message)

            return await self.app(scope, receive, send_with_echo)
        await self.app(scope, receive,
                       verdict_sender(send, echo, rids, self.runtime, self.config.kernel_config_id, settled))
