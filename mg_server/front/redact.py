"""What the HTTP front never lets out: secrets, tracebacks, server paths.

- Error responses (status >= 400, not streamed) get short messages: a traceback is cut off,
  absolute paths become `<path>`, and the message is capped at `MAX_MESSAGE` characters. The
  full detail stays in the server log.
- `GET /get_server_info` and `/server_info` return SGLang's server arguments: secret-looking
  fields (`api_key`, `admin_api_key`, passwords, secrets) are replaced by "<redacted>".
- `GET /metrics`, which mg serves itself ahead of SGLang's authentication, needs
  `Authorization: Bearer <--api-key>` when the server has an API key.
"""

from __future__ import annotations

import hmac
import json
import re
from typing import Any, Awaitable, Callable

INFO_PATHS = ("/get_server_info", "/server_info")
MAX_MESSAGE = 300
_SECRET_KEY = re.compile(r"(^|_)(api_key|password|secret|token)$")
_TRACE = re.compile(r"(\n\s*File \"|Traceback \(most recent call last\))")
# File-system paths (a host root, or a file with an extension); URL paths such as
# /v1/chat/completions, which mg's own messages name, stay.
_PATH = re.compile(r"(?<![\w.])(?:/(?:home|root|work|tmp|usr|opt|var|etc|proc|dev|mnt|srv|lib\w*|run|data|models?)"
                   r"(?:/[\w.\-@+]+)*/?|(?:/[\w.\-@+]+){2,}\.\w+)")

Send = Callable[[dict], Awaitable[None]]


def short_message(text: str) -> str:
    text = _TRACE.split(text, maxsplit=1)[0]
    text = _PATH.sub("<path>", text).strip() or "internal error (the server log has the details)"
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 1] + "…"


def _shorten(obj: Any) -> Any:
    if isinstance(obj, str):
        return short_message(obj)
    if isinstance(obj, dict):
        return {k: _shorten(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_shorten(v) for v in obj]
    return obj


def _redact(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: ("<redacted>" if isinstance(k, str) and _SECRET_KEY.search(k) and v not in (None, "")
                    else _redact(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redact(v) for v in obj]
    return obj


def clean_error(body: bytes) -> bytes:
    try:
        return json.dumps(_shorten(json.loads(body))).encode()
    except ValueError:
        return short_message(body.decode(errors="replace")).encode()


def clean_info(body: bytes) -> bytes:
    try:
        return json.dumps(_redact(json.loads(body))).encode()
    except ValueError:
        return b'{"error": "server info unavailable"}'


def bearer_ok(headers: list[tuple[bytes, bytes]], api_key: str) -> bool:
    value = dict(headers).get(b"authorization", b"").decode(errors="replace")
    scheme, _, token = value.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())


def cleaning_sender(send: Send, info: bool) -> Send:
    """Wrap `send`: buffer error responses (and server info) and send them cleaned."""
    held: dict | None = None
    chunks: list[bytes] = []

    async def send_clean(message: dict) -> None:
        nonlocal held
        if message["type"] == "http.response.start":
            streamed = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                           for k, v in message.get("headers", []))
            if not streamed and (info or message.get("status", 200) >= 400):
                held = message
                return None
            return await send(message)
        if held is None or message["type"] != "http.response.body":
            return await send(message)
        chunks.append(message.get("body", b""))
        if message.get("more_body", False):
            return None
        raw = b"".join(chunks)
        body = clean_error(raw) if held.get("status", 200) >= 400 else clean_info(raw)
        headers = [(k, v) for k, v in held.get("headers", []) if k.lower() != b"content-length"]
        await send({**held, "headers": headers + [(b"content-length", str(len(body)).encode())]})
        held = None
        await send({"type": "http.response.body", "body": body})

    return send_clean
