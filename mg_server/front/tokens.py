"""Checks of request bodies that SGLang itself does not survive (any request, header or not).

Token ids must exist in the model's vocabulary: SGLang passes `input_ids` (/generate) and
token-id prompts (/v1/completions) to the embedding as they are; one id outside the vocabulary
made the CPU scheduler raise (IndexError) and the whole server stop (on a GPU it is a
device-side assert). Numeric sampling parameters of /generate must be numbers: a string
(`"max_new_tokens": "many"`) was a 500. Each is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

TOKEN_PATHS = ("/generate", "/v1/completions")
INT_PARAMS = ("max_new_tokens", "min_new_tokens", "n", "top_k", "stream_interval")
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty")


def _ids(value: Any) -> list:
    """The flat token ids of an ids field (list[int] or list[list[int]]); [] if it holds text."""
    if not isinstance(value, list):
        return []
    if all(isinstance(v, list) for v in value):
        return [t for v in value for t in v]
    return value if all(not isinstance(v, str) for v in value) else []


def bad_token_ids(body: Any, path: str, vocab_size: int) -> str:
    """Why the body's token ids cannot be served ("" if they can, or if it has none)."""
    if not isinstance(body, dict) or vocab_size <= 0:
        return ""
    field = "input_ids" if path == "/generate" else "prompt"
    for t in _ids(body.get(field)):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            return f"{field}: token id {t!r} is not in the model's vocabulary (0..{vocab_size - 1})"
    params = body.get("sampling_params") if path == "/generate" else None
    for i, p in enumerate(params if isinstance(params, list) else [params] if params is not None else []):
        where = f"sampling_params[{i}]" if isinstance(params, list) else "sampling_params"
        if not isinstance(p, dict):
            return f"{where}: must be an object"
        for name in INT_PARAMS + FLOAT_PARAMS:
            v = p.get(name)
            ok = v is None or (not isinstance(v, bool) and isinstance(v, int if name in INT_PARAMS else (int, float)))
            if not ok:
                return f"{where}.{name}: must be a {'whole number' if name in INT_PARAMS else 'number'}, got {v!r}"
    return ""
