"""Put the verifier's completion of a missed flip into a non-streamed response body.

The controller sends the answer SGLang emitted (`original`) and the corrected one (`output`,
equal to the verifier-alone reference). The body is rewritten only where it demonstrably holds
`original` in a form mg can respell: `/generate`'s `output_ids` (and its `text`), or the single
choice of a chat/completions response whose text is the tokenizer's spelling of `original`.
Anything else returns None, and the verdict stays `mismatch` (never a silent half-rewrite).
"""

from __future__ import annotations

import json
from functools import lru_cache

from mg_server.runtime.protocol import Correction


@lru_cache(maxsize=4)
def _tokenizer(model_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def _text(model_path: str, ids: list[int]) -> str:
    # SGLang's detokenizer default: special tokens (the chat end token) are not spelled
    return _tokenizer(model_path).decode(ids, skip_special_tokens=True)


def _answer_ids(ids: list[int], corr: Correction) -> list[int] | None:
    """The corrected ids in the body's convention: SGLang keeps a matched stop token in
    output_ids; if this body dropped it, drop it from the correction too."""
    if ids == corr.original:
        return list(corr.output)
    if ids == corr.original[:-1]:
        return list(corr.output[:-1]) if corr.finish == "stop" else None
    return None


def apply(body: bytes, path: str, corr: Correction, model_path: str) -> bytes | None:
    """The response body with the corrected answer, or None if this body cannot be rewritten."""
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None  # a batch (list) answers several requests: not rewritten
    n_old, n_new = len(corr.original), len(corr.output)
    if path == "/generate":
        ids = _answer_ids(doc.get("output_ids"), corr) if isinstance(doc.get("output_ids"), list) else None
        if ids is None:
            return None
        doc["output_ids"] = ids
        if "text" in doc:
            if not model_path or doc["text"] != _text(model_path, corr.original):
                return None
            doc["text"] = _text(model_path, corr.output)
        meta = doc.get("meta_info") or {}
        if "completion_tokens" in meta:
            meta["completion_tokens"] = meta["completion_tokens"] - n_old + n_new
        meta["finish_reason"] = ({"type": "length", "length": n_new} if corr.finish == "length"
                                 else {"type": "stop", "matched": corr.output[-1]})
        return json.dumps(doc).encode()
    choices = doc.get("choices")
    if not model_path or not isinstance(choices, list) or len(choices) != 1:
        return None
    choice = choices[0]
    slot = choice.get("message") if path == "/v1/chat/completions" else choice
    key = "content" if path == "/v1/chat/completions" else "text"
    if not isinstance(slot, dict) or slot.get(key) != _text(model_path, corr.original):
        return None
    slot[key] = _text(model_path, corr.output)
    choice["finish_reason"] = corr.finish
    if "matched_stop" in choice:
        choice["matched_stop"] = corr.output[-1] if corr.finish == "stop" else None
    usage = doc.get("usage") or {}
    for k in ("completion_tokens", "total_tokens"):
        if isinstance(usage.get(k), int):
            usage[k] = usage[k] - n_old + n_new
    return json.dumps(doc).encode()
