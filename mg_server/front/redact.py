"""What the HTTP front never lets out: secrets, tracebacks, server paths.

- Error responses (status >= 400, not streamed) get short messages: a traceback is cut off,
  absolute paths become `<path>`, the values a validation error echoes are dropped (the body as
  SGLang got it holds mg's injected fields), mg's secrets (its mark, its processor string) are
  removed, and the message is capped at `MAX_MESSAGE` characters; an HTTP phrase as the error's
  type becomes OpenAI's class name (`Bad Request` -> `BadRequestError`). The full detail stays
  in the server log.
- `GET /get_server_info` and `/server_info` return SGLang's server arguments: secret-looking
  fields (`api_key`, `admin_api_key`, passwords, secrets) are replaced by "<redacted>".
- `GET /metrics`, which mg serves itself ahead of SGLang's authentication, needs
  `Authorization: Bearer <--api-key>` when the server has an API key.
"""

from __future__ import annotations

import ast
import hmac
import json
import re
from http import HTTPStatus
from typing import Any, Awaitable, Callable

INFO_PATHS = ("/get_server_info", "/server_info")
MAX_MESSAGE = 300
_SECRET_KEY = re.compile(r"(^|_)(api_key|password|secret|token)$")
_TRACE = re.compile(r"(\n\s*File \"|Traceback \(most recent call last\))")
# File-system paths (a host root, or a file with an extension); URL paths such as
# /v1/chat/completions, which mg's own messages name, stay.
_PATH = re.compile(r"(?<![\w.])(?:/(?:home|root|work|tmp|usr|opt|var|etc|proc|dev|mnt|srv|lib\w*|run|data|models?)"
                   r"(?:/[\w.\-@+]+)*/?|(?:/[\w.\-@+]+){2,}\.\w+)")

_VALIDATION = re.compile(r"^\d+ validation errors?:")
_PHRASES = {s.phrase: "".join(w.capitalize() for w in s.phrase.replace("-", " ").split()) + "Error"
            for s in HTTPStatus if s >= 400}
_PHRASES["Unauthorized"] = "AuthenticationError"

Send = Callable[[dict], Awaitable[None]]


def _validation_summary(text: str) -> str:
    """pydantic's "N validation errors:" text with each error as `loc: msg` (its `input`, which may
    hold the whole body, dropped; an error line cut short is left out)."""
    lines = text.split("\n")
    out = [lines[0]]
    for line in lines[1:]:
        try:
            err = ast.literal_eval(line.strip())
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(err, dict) and "msg" in err:
            loc = ".".join(str(p) for p in err.get("loc", ())[1:] if not str(p).startswith("function-"))
            out.append(f"  {loc}: {err['msg']}" if loc else f"  {err['msg']}")
    return "\n".join(out)


def short_message(text: str, secrets: tuple[str, ...] = ()) -> str:
    for secret in secrets:
        if len(secret) >= 16:  # (mg's mark and processor string; never a word a message needs)
            text = text.replace(secret, "<mg>")
    if _VALIDATION.match(text):
        text = _validation_summary(text)
    text = _TRACE.split(text, maxsplit=1)[0]
    text = _PATH.sub("<path>", text).strip() or "internal error (the server log has the details)"
    return text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE - 1] + "…"


def _shorten(obj: Any, secrets: tuple[str, ...]) -> Any:
    if isinstance(obj, str):
        return short_message(obj, secrets)
    if isinstance(obj, dict):
        out = {k: _shorten(v, secrets) for k, v in obj.items()}
        if out.get("type") in _PHRASES:
            out["type"] = _PHRASES[out["type"]]
        return out
    if isinstance(obj, list):
        return [_shorten(v, secrets) for v in obj]
    return obj


def _redact(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: ("<redacted>" if isinstance(k, str) and _SECRET_KEY.search(k) and v not in (None, "")
                    else _redact(v)) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_redact(v) for v in obj]
    return obj


def clean_error(body: bytes, secrets: tuple[str, ...] = ()) -> bytes:
    try:
        return json.dumps(_shorten(json.loads(body), secrets)).encode()
    except ValueError:
        return short_message(body.decode(errors="replace"), secrets).encode()


def clean_info(body: bytes) -> bytes:
    try:
        return json.dumps(_redact(json.loads(body))).encode()
    except ValueError:
        return b'{"error": "server info unavailable"}'


def bearer_ok(headers: list[tuple[bytes, bytes]], api_key: str) -> bool:
    value = dict(headers).get(b"authorization", b"").decode(errors="replace")
    scheme, _, token = value.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())


def cleaning_sender(send: Send, info: bool, secrets: tuple[str, ...] = ()) -> Send:
    """Wrap `send`: buffer error responses (and server info) and send them cleaned of `secrets`
    (and of what short_message drops)."""
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
        body = clean_error(raw, secrets) if held.get("status", 200) >= 400 else clean_info(raw)
        headers = [(k, v) for k, v in held.get("headers", []) if k.lower() != b"content-length"]
        await send({**held, "headers": headers + [(b"content-length", str(len(body)).encode())]})
        held = None
        await send({"type": "http.response.body", "body": body})

    return send_clean
