"""Token ids in a request body must exist in the model's vocabulary.

SGLang passes `input_ids` (/generate) and token-id prompts (/v1/completions) to the embedding
as they are: one id outside the vocabulary made the CPU scheduler raise (IndexError) and the
whole server stop (on a GPU it is a device-side assert). Checked for every request on those
endpoints, with or without X-Deterministic; a bad id is a 400 naming the field.
"""

from __future__ import annotations

from typing import Any

TOKEN_PATHS = ("/generate", "/v1/completions")


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
    return ""
