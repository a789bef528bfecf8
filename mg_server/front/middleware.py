"""ASGI middleware in front of SGLang's FastAPI app.

- Maps the `X-Deterministic` request header (1/0/true/false, case-insensitive) onto the body's
  `custom_params` of the generation endpoints, so SGLang carries the flag to mg's forward hook.
  SGLang only forwards `custom_params` of requests that name a custom logit processor, so a
  deterministic request also gets mg's no-op processor.
- Answers any other header value, or a request that cannot be served greedily, with HTTP 400
  and an OpenAI-style JSON error; the server keeps serving.
- Echoes `X-Deterministic` on every response to a request that carried it. A deterministic
  request gets a request id from mg (unless it brought one), and its response says whether
  every emitted token was checked against the verifier: `X-Deterministic-Verified: true|false`
  plus `X-MG-Verdict` (verified, mismatch, failed, unverified, ...) and the verifier's
  `X-MG-Kernel-Config`. A non-streamed response waits for the request's final audit; a stream
  sends the verdict as an SSE comment line (`: mg-verdict {...}`) before `data: [DONE]`, since
  its headers left before the tokens existed.
- Serves `GET /metrics` from the prometheus multiprocess folder (mg's and SGLang's metrics).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
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


def _assign_rids(body: dict, path: str) -> list[str]:
    """Deterministic requests carry an id mg knows, to ask the controller for their verdict."""
    rid = body.get("rid")
    if isinstance(rid, str) and rid:
        return [rid]
    if isinstance(rid, list) and rid and all(isinstance(r, str) and r for r in rid):
        return rid
    if rid is not None:
        raise BadRequest("rid must be a non-empty string or a list of them")
    batch = None  # /generate takes a list of prompts; then SGLang wants a list of rids
    if path in NATIVE_PATHS:
        for key in ("text", "input_ids"):
            value = body.get(key)
            if isinstance(value, list) and value and (key == "text" or isinstance(value[0], list)):
                batch = len(value)
    rids = [f"mg-{uuid.uuid4().hex}" for _ in range(batch or 1)]
    body["rid"] = rids if batch else rids[0]
    return rids


def rewrite_body(body: dict, path: str, flag: bool, noop_processor: str) -> dict:
    """The request body as SGLang must see it for a request with X-Deterministic: flag."""
    if flag:
        existing = body.get("custom_logit_processor")
        if existing not in (None, noop_processor):
            raise BadRequest("X-Deterministic: 1 cannot be combined with a custom_logit_processor")
        n = body.get("n", (body.get("sampling_params") or {}).get("n", 1) if isinstance(body.get("sampling_params"), dict) else 1)
        if n not in (None, 1):
            raise BadRequest("X-Deterministic: 1 serves one greedy completion per prompt; n must be 1")
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
        _assign_rids(out, path)
    return out


def verdict_headers(states: list[str], kernel_config_id: str) -> list[tuple[bytes, bytes]]:
    ok = bool(states) and all(s == "verified" for s in states)
    worst = next((s for s in states if s != "verified"), "verified") if states else "unknown"
    headers = [(b"x-deterministic-verified", b"true" if ok else b"false"), (b"x-mg-verdict", worst.encode())]
    if kernel_config_id:
        headers.append((b"x-mg-kernel-config", kernel_config_id.encode()))
    return headers


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
        self._local = threading.local()  # one controller client per executor thread

    def _verdicts_blocking(self, rids: list[str]) -> list[str]:
        if not self.config.controller_ipc:
            return ["unverified"] * len(rids)  # mode off: nothing checks the tokens
        from mg_server.runtime.controller.client import ControllerClient

        client = getattr(self._local, "client", None)
        if client is None:
            # the verdict may first run the request's tail audit: allow the whole wait for it
            client = self._local.client = ControllerClient(self.config.controller_ipc,
                                                           timeout_s=self.config.verdict_wait_s, client_name="front")
        deadline = time.monotonic() + self.config.verdict_wait_s
        states = []
        for rid in rids:
            while True:
                try:
                    state = client.verdict(rid).state
                except Exception:  # noqa: BLE001 - no answer is no verification
                    state = "controller-unreachable"
                if state != "running" or time.monotonic() > deadline:
                    break
                time.sleep(0.01)
            states.append("audit-timeout" if state == "running" else state)
        return states

    async def verdicts(self, rids: list[str]) -> list[str]:
        return await asyncio.to_thread(self._verdicts_blocking, rids)

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
        rids: list[str] = []

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
                if flag:
                    rid = parsed["rid"]
                    rids = [rid] if isinstance(rid, str) else list(rid)
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
        await self.app(scope, receive, self._verdict_sender(send, echo, rids))

    def _verdict_sender(self, send: Send, echo, rids: list[str]) -> Send:
        held: dict | None = None  # the response start of a non-streamed answer, until its verdict
        streaming = False

        async def send_with_verdict(message: dict) -> None:
            nonlocal held, streaming
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", [])) + [echo]
                streaming = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                for k, v in headers)
                if streaming:
                    headers.append((b"x-deterministic-verified", b"in-stream"))
                    return await send({**message, "headers": headers})
                held = {**message, "headers": headers}
                return None
            if message["type"] != "http.response.body":
                return await send(message)
            body = message.get("body", b"")
            if streaming:
                marker = body.find(b"data: [DONE]")
                if marker >= 0:
                    states = await self.verdicts(rids)
                    comment = b": mg-verdict " + json.dumps({"rids": rids, "states": states}).encode() + b"\n\n"
                    message = {**message, "body": body[:marker] + comment + body[marker:]}
                return await send(message)
            if held is not None and not message.get("more_body", False):
                states = await self.verdicts(rids)
                held["headers"] = held["headers"] + verdict_headers(states, self.config.kernel_config_id)
                await send(held)
                held = None
            elif held is not None:  # a multi-part non-streamed body: headers go now, unverdicted
                held["headers"].append((b"x-deterministic-verified", b"false"))
                await send(held)
                held = None
            await send(message)

        return send_with_verdict
