"""ASGI middleware in front of SGLang's FastAPI app (the outermost layer of the HTTP server).

- `X-Deterministic` (front.policy): a bad value, an endpoint mg does not handle, or a
  parameter the verifier does not model is a 400 with an OpenAI-style JSON error naming what to
  change; the server keeps serving. On the generation endpoints the flag goes into the body's
  `custom_params` (SGLang forwards those only for requests that name a custom logit processor,
  so a deterministic request also gets mg's no-op processor) and a deterministic request gets
  a request id from mg unless it brought one.
- Echoes `X-Deterministic` on every response to a request that carried it; a deterministic
  response carries its verdict (front.verdict): `X-Deterministic-Verified: true|false`,
  `X-MG-Verdict` and the verifier's `X-MG-Kernel-Config`, and the same as the JSON field
  `mg_verdict`. A non-streamed response waits for the request's final audit; a stream
  (`X-Deterministic-Verified: in-stream`) sends its verdict as its last `data:` event before
  `data: [DONE]` (front.stream), since its headers left before the tokens existed.
- `GET /health` (and `/health_generate`) is a 503 with a JSON reason while mg's runtime cannot
  serve deterministic requests (controller not beating, verifier down); otherwise SGLang answers.
- Serves `GET /metrics` from the prometheus multiprocess folder (mg's and SGLang's metrics),
  behind the server's `--api-key` when it has one.
- Errors get short messages and server info loses its secrets (front.redact); token ids
  outside the vocabulary are a 400 for every request (front.tokens: one stopped the server).
- Seeded n > 1 (front.samples): /generate bodies become a batch of single samples; an OpenAI
  request is sent to SGLang as n single-sample requests, concurrently, and answered as one.
- `system_fingerprint` (wire.fingerprint) on deterministic answers: the JSON field of an
  OpenAI answer and of each chunk of its stream, the `X-MG-System-Fingerprint` header on every one.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any, Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST

from mg_server import metrics
from mg_server.config import DETERMINISTIC_PARAM, INSTANCE_PARAM, FrontConfig, instance_key
from mg_server.front import admission
from mg_server.front.admission import Admission, Guard, Refused, refusal_body
from mg_server.front.policy import OPENAI_PATHS, BadRequest, empty_answer_rids, parse_flag, rewrite_body, route
from mg_server.front.redact import INFO_PATHS, bearer_ok, cleaning_sender
from mg_server.front.samples import expand_generate, merge_openai, split_openai
from mg_server.front.tokens import TOKEN_PATHS, bad_token_ids
from mg_server.front.verdict import RuntimeView, verdict_sender
from mg_server.wire.protocol import VerdictState

HEADER = b"x-deterministic"
HEALTH_PATHS = ("/health", "/health_generate")

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]


class BodyTooLarge(Exception):
    pass


async def _read_body(receive: Receive, limit: int = 0) -> bytes:
    """The whole request body; BodyTooLarge once it passes `limit` bytes (0: no limit)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ConnectionError("client disconnected")
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if limit and size > limit:
            raise BodyTooLarge
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


def _utf8(text: object) -> bool:
    """A request id mg can pass on: text without lone surrogates (JSON's \\ud800 decodes to one)."""
    if not isinstance(text, str):
        return True  # (the body's other checks own its types)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _stamp_instance(body: dict) -> str:
    """Give this request's flagged parameter sets a fresh instance id (see config.INSTANCE_PARAM)."""
    inst = uuid.uuid4().hex[:16]
    params = body.get("sampling_params", body)  # /generate: one dict or a list; OpenAI: the body
    for p in params if isinstance(params, list) else [params]:
        custom = p.get("custom_params") if isinstance(p, dict) else None
        if isinstance(custom, dict) and custom.get(DETERMINISTIC_PARAM):
            custom[INSTANCE_PARAM] = inst
    return inst


def _refusal_headers(raws: list[bytes]) -> list[tuple[bytes, bytes]]:
    """What mg's own refusal of a request that carried X-Deterministic says: the echo and, unless
    the request asked for a plain answer, the verdict `failed` (every error response has one)."""
    try:
        flag = parse_flag(raws[0]) if len(raws) == 1 else None
    except BadRequest:
        flag = None  # an unreadable flag: the client may have meant 1
    if flag is False:
        return [(HEADER, b"0")]
    return ([(HEADER, b"1")] if flag else []) + [(b"x-deterministic-verified", b"false"), (b"x-mg-verdict", b"failed")]


def error_body(message: str, status: int = 400, param: str = "X-Deterministic") -> bytes:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 413: "BadRequestError"}.get(
        status, "ServiceUnavailableError")
    return json.dumps({"object": "error", "message": message, "type": kind, "param": param, "code": status}).encode()


class DeterministicMiddleware:
    def __init__(self, app, config: FrontConfig):
        self.app = app
        self.config = config
        self.runtime = RuntimeView(config)
        # deterministic requests in SGLang at once, and a queue (front.admission); mode off: none
        self.admission = Admission(config.max_deterministic, config.queue_size) \
            if config.controller_ipc and config.max_deterministic else None
        admission.register(self.admission)

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
            problem = "the server is shutting down" if self.admission and self.admission.stopping else \
                self.runtime.problem()
            if problem:
                return await _respond(send, 503, error_body(problem, 503, "mg"), b"application/json")

        raws = [v for k, v in scope["headers"] if k == HEADER]
        refused = _refusal_headers(raws) if raws else []  # on every refusal of mg's own
        limit = self.config.max_body_bytes
        if method in ("POST", "PUT") and limit:
            async def too_big() -> None:
                await _respond(send, 413, error_body(f"the request body is larger than {limit} bytes", 413, "body"),
                               b"application/json", refused)

            length = dict(scope["headers"]).get(b"content-length", b"")
            if length.isdigit() and int(length) > limit:  # refused before a byte of it is read
                return await too_big()
            try:
                body = await _read_body(receive, limit)
            except ConnectionError:
                return
            except BodyTooLarge:  # (a chunked body names no length)
                return await too_big()
            receive = _replay(body, receive)
        if path in TOKEN_PATHS and method in ("POST", "PUT") and self.config.vocab_size:
            try:
                body = await _read_body(receive)
            except ConnectionError:
                return
            try:
                problem = bad_token_ids(json.loads(body), path, self.config.vocab_size)
            except (ValueError, RecursionError):
                problem = ""  # not JSON, or too deep for it: the checks below or SGLang answer it
            if problem:
                return await _respond(send, 400, error_body(problem, param=problem.partition(":")[0]),
                                      b"application/json", refused)
            receive = _replay(body, receive)
        if not raws:
            return await self.app(scope, receive, send)

        async def refuse(e: BadRequest) -> None:
            await _respond(send, 400, error_body(str(e), param=e.param), b"application/json", refused)

        try:
            if len(raws) > 1:  # (two header lines would otherwise be read as the last one)
                raise BadRequest(f"X-Deterministic was sent {len(raws)} times; send it once")
            flag = parse_flag(raws[0])
            kind = route(method, path)
        except BadRequest as e:
            return await refuse(e)
        echo = (HEADER, b"1" if flag else b"0")
        rids: list[str] = []
        what = "batch"  # what the request asks for several of (a 400 names it when it asks too many)
        settled: dict[str, str] = {}

        if kind == "rewrite":
            try:
                body = await _read_body(receive)
            except ConnectionError:
                return
            try:
                parsed = json.loads(body) if body else None
            except (ValueError, RecursionError) as e:
                if flag:  # a deterministic request's refusal carries its verdict: mg answers it
                    why = "is nested too deeply" if isinstance(e, RecursionError) else "is not valid JSON"
                    return await refuse(BadRequest(f"the request body {why}", param="body"))
                parsed = None  # a plain request: SGLang answers it with its own error
            if flag and not isinstance(parsed, dict):
                return await refuse(BadRequest("the request body must be a JSON object", param="body"))
            if isinstance(parsed, dict):
                parts = None
                try:
                    parts = split_openai(parsed) if flag and path in OPENAI_PATHS else None
                    if parts is not None:
                        parts = [rewrite_body(p, path, flag, self.config.noop_processor) for p in parts]
                    else:
                        if flag and (expanded := expand_generate(parsed)) is not parsed:
                            parsed, what = expanded, "sampling_params.n"
                        parsed = rewrite_body(parsed, path, flag, self.config.noop_processor)
                except BadRequest as e:
                    return await refuse(e)
                if parts is not None:
                    return await self._admitted(len(parts), "n", refused, send,
                                                lambda s: self._fan_out(scope, parts, s, echo))
                if flag:
                    rid = parsed["rid"]
                    rids = [rid] if isinstance(rid, str) else list(rid)
                    if bad := next((r for r in rids if not _utf8(r)), None):
                        return await refuse(BadRequest(f"rid {bad!r} is not valid UTF-8 text", param="rid"))
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
        await self._admitted(len(rids), what, refused, send, lambda s: self.app(scope, receive, verdict_sender(
            s, echo, rids, self.runtime, self.config.kernel_config_id, settled, path=path,
            fingerprint=self.config.system_fingerprint)))

    async def _admitted(self, slots: int, what: str, refused, send: Send, call) -> None:
        """Run `call(send)` once the verifier has room for `slots` more completions (front.admission):
        refused with 400 / 429 / 503 and verdict failed, or cut at the end of a shutdown's drain."""
        if self.admission is None:
            return await call(send)
        try:
            ticket = await self.admission.enter(slots, what)
        except Refused as e:
            extra = [(b"retry-after", str(e.retry_after).encode())] if e.retry_after else []
            return await _respond(send, e.status, refusal_body(e), b"application/json", refused + extra)
        left = False

        def leave() -> None:  # at the response's last message, else when the call ends (cut, error)
            nonlocal left
            if not left:
                left = True
                self.admission.leave(ticket, slots)

        guard = Guard(send, refused, on_end=leave)
        self.admission.on_cut(ticket, guard.cut)
        try:
            await guard.run(call(guard.tracked))
        finally:
            leave()

    async def _fan_out(self, scope: Scope, bodies: list[dict], send: Send, echo) -> None:
        """Seeded n > 1 (front.samples): each body is one sample; one merged answer, whose
        verdict covers every sample (the first error answer, if any, is the response)."""
        answers = await asyncio.gather(*(_capture(self.app, scope, json.dumps(b).encode()) for b in bodies))
        status, body = next(((s, b) for s, _, b in answers if s >= 400), (200, b""))
        if status < 400:
            try:
                body = json.dumps(merge_openai([json.loads(b) for _, _, b in answers])).encode()
            except (ValueError, KeyError, IndexError, TypeError) as e:
                status, body = 500, error_body(f"mg could not merge the {len(bodies)} samples: {e!r}", 500, "n")
        out = verdict_sender(send, echo, [b["rid"] for b in bodies], self.runtime, self.config.kernel_config_id,
                             None, fingerprint=self.config.system_fingerprint)
        await out({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await out({"type": "http.response.body", "body": body})


async def _capture(app, scope: Scope, body: bytes) -> tuple[int, list, bytes]:
    """Run one request through the app in-process -> (status, headers, body). Its receive never
    reports a disconnect (the sub-request outlives nothing: the client waits for the answer)."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
    sub = {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}
    sent, status, out_headers, chunks = False, [500], [], []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # never set: cancelled by whoever polls for a disconnect
        raise AssertionError("unreachable")

    async def capture(message: dict) -> None:
        if message["type"] == "http.response.start":
            status[0] = message.get("status", 200)
            out_headers.extend((k.lower(), v) for k, v in message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(sub, receive, capture)
    return status[0], out_headers, b"".join(chunks)
