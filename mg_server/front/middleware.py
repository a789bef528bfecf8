"""ASGI middleware in front of SGLang's FastAPI app (the outermost layer of the HTTP server).

- `X-Deterministic` (front.rules): a bad value, an endpoint mg does not handle, or a
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
- Every POST/PUT body, with the header or not, passes front.surface first (mg's own fields,
  JSON objects only, one length limit, the served model, token ids); a body must arrive within
  `body_timeout_s` (408). Errors get short messages without mg's injected fields and server
  info loses its secrets (front.redact). With `--api-key`, mg checks the key of requests that
  carry X-Deterministic and of /health_generate itself (the front is the outermost layer, so
  its refusals carry the verdict headers).
- A plain answer of a generation route says `X-MG-Verdict: unverified`. A header name that is
  X-Deterministic misspelt with an underscore is a 400 (it would be served plain).
- Several completions (front.samples): seeded /generate n becomes a batch of single samples;
  an OpenAI request with seeded n or a list of prompts is sent to SGLang as single
  completions, concurrently, and answered as one.
- `system_fingerprint` (wire.fingerprint) on deterministic answers: the JSON field of an
  OpenAI answer and of each chunk of its stream, the `X-MG-System-Fingerprint` header on every one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, Awaitable, Callable

from prometheus_client import CONTENT_TYPE_LATEST

from mg_server import metrics
from mg_server.config import DETERMINISTIC_PARAM, INSTANCE_PARAM, FrontConfig, instance_key
from mg_server.front import admission, surface
from mg_server.front.admission import Admission, Guard, Refused, refusal_body
from mg_server.front.rules import (GENERATE_ROUTES, OPENAI_PATHS, BadRequest, empty_answer_rids, parse_flag,
                                    rewrite_body, route)
from mg_server.front.redact import INFO_PATHS, bearer_ok, cleaning_sender
from mg_server.front.samples import completions_per_prompt, expand_generate, merge_openai, run_parts, split_openai
from mg_server.front.verdict import RuntimeView, answer_tokens, check_empty, verdict_sender
from mg_server.wire.protocol import VerdictState

HEADER = b"x-deterministic"
HEALTH_PATHS = ("/health", "/health_generate")
# SGLang's endpoints that replace, release or reload the weights in place: with mg on, the verifier
# computes on those very tensors (seam/export.py), so the reference would change under running requests
WEIGHT_PATHS = ("/update_weights", "/release_memory_occupation", "/resume_memory_occupation",
                "/init_weights_update_group", "/update_weight_version", "/begin_weight_update", "/end_weight_update")
UNVERIFIED = (b"x-mg-verdict", VerdictState.UNVERIFIED.encode())

log = logging.getLogger(__name__)
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


def error_body(message: str, status: int = 400, param: str = "X-Deterministic", code: str = "") -> bytes:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError", 404: "NotFoundError",
            408: "BadRequestError",
            413: "BadRequestError", 415: "BadRequestError"}.get(status, "ServiceUnavailableError")
    return json.dumps({"object": "error", "message": message, "type": kind, "param": param,
                       "code": code or status}).encode()


def _misspelt(headers: list[tuple[bytes, bytes]]) -> bool:
    """X-Deterministic with an underscore (`X_Deterministic`): served plain, it would look served."""
    return any(k != HEADER and k.replace(b"_", b"-") == HEADER for k, _ in headers)


def _with_length(scope: Scope, body: bytes) -> Scope:
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
    return {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}


def _adding(send: Send, *extra: tuple[bytes, bytes]) -> Send:
    async def send_with(message: dict) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": list(message.get("headers", [])) + list(extra)}
        await send(message)

    return send_with


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
        path, method, cfg = scope["path"], scope["method"], self.config
        send = cleaning_sender(send, info=method == "GET" and path in INFO_PATHS,
                               secrets=(cfg.request_mark, cfg.noop_processor))  # front.redact
        raws = [v for k, v in scope["headers"] if k == HEADER]
        refused = _refusal_headers(raws) if raws else []  # on every refusal of mg's own

        async def refuse(e: Exception, status: int = 400, param: str = "X-Deterministic", code: str = "") -> None:
            param = getattr(e, "param", param)
            await _respond(send, status, error_body(str(e), status, param, code), b"application/json", refused)

        if _misspelt(scope["headers"]):
            return await refuse(BadRequest("send the header as X-Deterministic (with a dash; an underscore is "
                                           "not read)"), param="X_Deterministic")
        keyed = not cfg.api_key or bearer_ok(scope["headers"], cfg.api_key)
        if path == "/metrics" and method == "GET":
            if not keyed:
                return await refuse(PermissionError("/metrics needs the server's API key"), 401, "Authorization")
            return await _respond(send, 200, metrics.render(cfg.metrics_dir), CONTENT_TYPE_LATEST.encode())
        if not keyed and (raws or path == "/health_generate"):  # (SGLang leaves its health paths open)
            return await refuse(PermissionError("this request needs the server's API key (Authorization: Bearer)"),
                                401, "Authorization")
        if cfg.controller_ipc and path.startswith(WEIGHT_PATHS):
            return await refuse(PermissionError(f"{path} is refused while mg serves deterministic requests: its "
                                                "verifier computes on SGLang's weights (serve with --mg-mode off to "
                                                "update them)"), 403, "path")
        if path in HEALTH_PATHS and method == "GET":
            problem = "the server is shutting down" if self.admission and self.admission.stopping else \
                self.runtime.problem()
            if problem:
                return await _respond(send, 503, error_body(problem, 503, "mg"), b"application/json")

        parsed = None
        if method in ("POST", "PUT"):
            limit = cfg.max_body_bytes
            length = dict(scope["headers"]).get(b"content-length", b"")
            too_big = RuntimeError(f"the request body is larger than {limit} bytes")
            if limit and length.isdigit() and int(length) > limit:  # refused before a byte of it is read
                return await refuse(too_big, 413, "body")
            try:
                body = await asyncio.wait_for(_read_body(receive, limit), cfg.body_timeout_s or None)
            except ConnectionError:
                return
            except BodyTooLarge:  # (a chunked body names no length)
                return await refuse(too_big, 413, "body")
            except asyncio.TimeoutError:
                return await refuse(RuntimeError(f"the request body did not arrive within {cfg.body_timeout_s:g} s"),
                                    408, "body")
            try:
                parsed, new = surface.inspect(path, body, scope["headers"], cfg)
            except surface.Refusal as e:
                return await refuse(e, e.status, e.param, e.code)
            if new is not body:
                scope, body = _with_length(scope, new), new
            receive = _replay(body, receive)
        generating = (method, path) in GENERATE_ROUTES
        if not raws:
            return await self.app(scope, receive, _adding(send, UNVERIFIED) if generating else send)
        try:
            if len(raws) > 1:  # (two header lines would otherwise be read as the last one)
                raise BadRequest(f"X-Deterministic was sent {len(raws)} times; send it once")
            flag = parse_flag(raws[0])
            kind = route(method, path)
        except BadRequest as e:
            return await refuse(e)
        echo = (HEADER, b"1" if flag else b"0")
        if kind == "pass" or not flag:
            return await self.app(scope, receive, _adding(send, echo, *([UNVERIFIED] if generating else [])))
        if not isinstance(parsed, dict):
            return await refuse(BadRequest("the request body must be a JSON object", param="body"))
        if problem := self.runtime.problem():  # (a worker down or restarting: fail now, not after decoding)
            return await refuse(RuntimeError(f"deterministic decoding is unavailable: {problem}"), 503, "mg")
        what = "batch"  # what the request asks for several of (a 400 names it when it asks too many)
        try:
            parts = split_openai(parsed, path) if path in OPENAI_PATHS else None
            if parts is not None:
                parts = [rewrite_body(p, path, cfg.noop_processor, cfg.request_mark) for p in parts]
            else:
                if (expanded := expand_generate(parsed)) is not parsed:
                    parsed, what = expanded, "sampling_params.n"
                parsed = rewrite_body(parsed, path, cfg.noop_processor, cfg.request_mark)
        except BadRequest as e:
            return await refuse(e)
        except (TypeError, ValueError, AttributeError, KeyError, IndexError) as e:  # a shape no check above foresaw
            log.warning("mg: a deterministic request's body could not be read: %r", e)
            return await refuse(BadRequest(f"the request body has a field of the wrong type ({type(e).__name__}); "
                                           "see the OpenAI or SGLang request schema", param="body"))
        if parts is not None:
            what = "n" if completions_per_prompt(parsed) > 1 else "prompt"
            return await self._admitted(len(parts), what, refused, send,
                                        lambda s: self._fan_out(scope, parts, s, echo, receive, parsed))
        rid = parsed["rid"]
        rids = [rid] if isinstance(rid, str) else list(rid)
        if bad := next((r for r in rids if not _utf8(r)), None):
            return await refuse(BadRequest(f"rid {bad!r} is not valid UTF-8 text", param="rid"))
        empty = empty_answer_rids(parsed, rids)
        if cfg.controller_ipc:  # verdicts are asked per request instance
            inst = _stamp_instance(parsed)
            empty = {instance_key(r, inst) for r in empty}
            rids = [instance_key(r, inst) for r in rids]
        settled = dict.fromkeys(empty, VerdictState.VERIFIED)
        body = json.dumps(parsed).encode()
        scope, receive = _with_length(scope, body), _replay(body, receive)
        await self._admitted(len(rids), what, refused, send, lambda s: self.app(scope, receive, verdict_sender(
            s, echo, rids, self.runtime, cfg.kernel_config_id, settled, path=path,
            fingerprint=cfg.system_fingerprint)))

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

    async def _fan_out(self, scope: Scope, bodies: list[dict], send: Send, echo, receive: Receive,
                       original: dict) -> None:
        """Several completions (front.samples): each body is one; one merged answer, whose verdict
        covers every part (the first error answer, if any, is the response)."""
        rids, settled = [], {}
        for b in bodies:
            key = instance_key(b["rid"], _stamp_instance(b)) if self.config.controller_ipc else b["rid"]
            rids.append(key)
            if empty_answer_rids(b, [key]):
                settled[key] = VerdictState.VERIFIED
        gone = asyncio.Event()
        answers = await run_parts(self.app, scope, [json.dumps(b).encode() for b in bodies], receive, gone)
        if gone.is_set():  # nobody to answer: no verdicts to wait for, the slots come back now
            return
        for key, (status, _, body) in zip(rids, answers):
            settled = check_empty(settled, [key], answer_tokens(body, 1)) if key in settled else settled
        status, body = next(((s, b) for s, _, b in answers if s >= 400), (200, b""))
        if status < 400:
            try:
                merged = merge_openai([json.loads(b) for _, _, b in answers], completions_per_prompt(original))
                body = json.dumps(merged).encode()
            except (ValueError, KeyError, IndexError, TypeError) as e:
                status, body = 500, error_body(f"mg could not merge the {len(bodies)} completions: {e!r}", 500, "n")
        out = verdict_sender(send, echo, rids, self.runtime, self.config.kernel_config_id, settled,
                             fingerprint=self.config.system_fingerprint, checked=True)
        await out({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await out({"type": "http.response.body", "body": body})
