"""Put the verifier's completion of a missed flip into a non-streamed response body.

The controller sends the answer SGLang emitted (`original`) and the corrected one (`output`,
equal to the verifier-alone reference). The body is rewritten only where it demonstrably holds
`original` in a form mg can respell: `/generate`'s `output_ids` (and its `text`; each answer of a
batch body), or the single choice of a chat/completions response whose text is the tokenizer's
spelling of `original`. Anything else is left as it is, and its verdict stays `mismatch` (never
a silent half-rewrite).
"""

from __future__ import annotations

import json
from functools import lru_cache

from mg_server.wire.protocol import Correction


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


def _apply_one(doc: dict, path: str, corr: Correction, model_path: str) -> bool:
    """Rewrite one answer object in place; False (untouched) if it does not hold `corr.original`."""
    n_old, n_new = len(corr.original), len(corr.output)
    if path == "/generate":
        ids = _answer_ids(doc.get("output_ids"), corr) if isinstance(doc.get("output_ids"), list) else None
        if ids is None:
            return False
        if "text" in doc and (not model_path or doc["text"] != _text(model_path, corr.original)):
            return False
        doc["output_ids"] = ids
        if "text" in doc:
            doc["text"] = _text(model_path, corr.output)
        meta = doc.get("meta_info") or {}
        if "completion_tokens" in meta:
            meta["completion_tokens"] = meta["completion_tokens"] - n_old + n_new
        meta["finish_reason"] = ({"type": "length", "length": n_new} if corr.finish == "length"
                                 else {"type": "stop", "matched": corr.output[-1]})
        return True
    choices = doc.get("choices")
    if not model_path or not isinstance(choices, list) or len(choices) != 1:
        return False
    choice = choices[0]
    slot = choice.get("message") if path == "/v1/chat/completions" else choice
    key = "content" if path == "/v1/chat/completions" else "text"
    if not isinstance(slot, dict) or slot.get(key) != _text(model_path, corr.original):
        return False
    slot[key] = _text(model_path, corr.output)
    choice["finish_reason"] = corr.finish
    if "matched_stop" in choice:
        choice["matched_stop"] = corr.output[-1] if corr.finish == "stop" else None
    usage = doc.get("usage") or {}
    for k in ("completion_tokens", "total_tokens"):
        if isinstance(usage.get(k), int):
            usage[k] = usage[k] - n_old + n_new
    return True


def apply(body: bytes, path: str, corrs: list[Correction | None], model_path: str) -> tuple[bytes, list[bool]]:
    """The response body with each request's corrected answer (`corrs`: one per request of the
    body, None where nothing is replaced), and per request whether its answer could be replaced
    (a None correction counts as done). A /generate batch body is a list of answers, one each."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    answers = doc if isinstance(doc, list) and path == "/generate" else [doc]
    if len(answers) != len(corrs) or not all(isinstance(a, dict) for a in answers):
        return body, [c is None for c in corrs]
    ok = [c is None or _apply_one(a, path, c, model_path) for a, c in zip(answers, corrs)]
    changed = any(c is not None and k for c, k in zip(corrs, ok))
    return (json.dumps(doc).encode() if changed else body), ok
