"""What any request body may carry, with or without X-Deterministic: the front's first look.

Every POST and PUT body is read here before SGLang sees it (mg is the outermost layer), and:
- mg's own fields are a 400 wherever they sit: a key `custom_logit_processor` or `custom_params`
  at any depth of a JSON body. Why: SGLang turns a processor string into code with dill (in its
  scheduler and tokenizer manager), and custom_params carry mg's flag and sampling rule; the
  front writes both for deterministic requests only (front.rules), seam/guard.py checks again.
- a body is JSON, and an object: anything else (not JSON, `[]`, `"str"`, `null`) is a 400 on
  every route. A compressed body (`Content-Encoding` other than identity) is a 415: mg reads the
  bytes SGLang parses. Multipart forms (audio uploads) pass; their fields are fixed by SGLang.
- the OpenAI length parameters are whole numbers >= 0 or null, and SGLang gets one limit:
  `max_completion_tokens` (the newer name) wins and becomes `max_tokens`. Why: SGLang reads
  `max_completion_tokens or max_tokens`, so a 0 there was dropped (the answer ran to the context
  length, or to `max_tokens` while mg took it for empty).
- `model` on the OpenAI routes names the served model (else a 404 `model_not_found`).
- token ids and /generate's numeric parameters (front.tokens).
"""

from __future__ import annotations

import json
from typing import Any

from mg_server.config import FrontConfig
from mg_server.front.rules import OPENAI_PATHS
from mg_server.front.tokens import TOKEN_PATHS, bad_token_ids

OWNED = ("custom_logit_processor", "custom_params")
LENGTHS = ("max_completion_tokens", "max_tokens")  # (OpenAI: the newer name first; it wins)
DEFAULT_MODEL = "default"  # the name SGLang's OpenAI routes take for the served model


class Refusal(Exception):
    def __init__(self, message: str, param: str = "body", status: int = 400, code: str = ""):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def owned_field(value: Any) -> str:
    """The path of the first mg-owned key in a JSON value ("" if none); iterative, any depth."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        where, v = stack.pop()
        if isinstance(v, dict):
            for k, item in v.items():
                if k in OWNED:
                    return f"{where}{k}"
                stack.append((f"{where}{k}.", item))
        elif isinstance(v, list):
            stack.extend((f"{where.rstrip('.')}[{i}].", item) for i, item in enumerate(v))
    return ""


def _normalize_lengths(body: dict) -> None:
    """One length limit for SGLang (module doc); a 400 for a value that is not one."""
    for name in LENGTHS:
        v = body.get(name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise Refusal(f"{name} must be a whole number >= 0 (got {v!r})", param=name)
    if "max_completion_tokens" in body:
        limit = body.pop("max_completion_tokens")
        if limit is not None:
            body["max_tokens"] = limit


def _check_model(body: dict, cfg: FrontConfig) -> None:
    model = body.get("model")
    if not cfg.served_models or cfg.any_model or model is None or model == DEFAULT_MODEL:
        return
    if model not in cfg.served_models:
        raise Refusal(f"The model {model!r} does not exist: GET /v1/models names this server's model (or send "
                      "'default')",
                      param="model", status=404, code="model_not_found")


def encoded(headers: list[tuple[bytes, bytes]]) -> bool:
    """A body SGLang would see decoded (Content-Encoding other than identity)."""
    value = dict(headers).get(b"content-encoding", b"identity").strip().lower()
    return value not in (b"", b"identity")


def form(headers: list[tuple[bytes, bytes]]) -> bool:
    return dict(headers).get(b"content-type", b"").lower().startswith(b"multipart/form-data")


def inspect(path: str, raw: bytes, headers: list[tuple[bytes, bytes]], cfg: FrontConfig) -> tuple[Any, bytes]:
    """(the parsed body or None for an empty body or a form, the bytes SGLang gets); Refusal for a
    body the server must not take (module doc)."""
    if encoded(headers):
        raise Refusal("compressed request bodies are not accepted: send it uncompressed (no Content-Encoding)",
                      param="Content-Encoding", status=415)
    if not raw.strip() or form(headers):
        return None, raw
    try:
        body = json.loads(raw)
    except RecursionError:
        raise Refusal("the request body is nested too deeply") from None
    except ValueError:
        raise Refusal("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise Refusal("the request body must be a JSON object")
    if where := owned_field(body):
        raise Refusal(f"{where}: custom_logit_processor and custom_params are not accepted by this server "
                      "(deterministic decoding is asked for with the X-Deterministic header)", param=where)
    changed = False
    if path in OPENAI_PATHS:
        _check_model(body, cfg)
        before = {k: body.get(k, ...) for k in LENGTHS}
        _normalize_lengths(body)
        changed = before != {k: body.get(k, ...) for k in LENGTHS}
    if path in TOKEN_PATHS and cfg.vocab_size and (problem := bad_token_ids(body, path, cfg.vocab_size)):
        raise Refusal(problem, param=problem.partition(":")[0])
    return body, json.dumps(body).encode() if changed else raw
