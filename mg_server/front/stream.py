"""What a deterministic stream (server-sent events) carries besides its tokens.

A stream's headers leave before its tokens exist, so its verdict travels in the stream itself:
one last `data:` event before `data: [DONE]`, whose JSON object has the field `mg_verdict`
(front.verdict's `verdict_object`). Clients that keep only `data:` events see it (the `openai` client keeps an
unknown field as an extra of the chunk object: `chunk.model_extra["mg_verdict"]`). On the OpenAI
endpoints that event is a chunk like the others with empty `choices` (as OpenAI's usage chunk),
and every chunk of the stream carries `system_fingerprint`; on `/generate` (SGLang's native
stream) it is `{"mg_verdict": {...}}`.

`StreamEvents` splits the body into events (a body message may end inside one) and rewrites
each: it never reorders or drops one.
"""

from __future__ import annotations

import json

DONE = b"data: [DONE]"
_SEP = b"\n\n"  # SGLang ends every event with a blank line
_CHUNK_KEYS = ("id", "object", "created", "model")  # copied from the stream's chunks onto the verdict's


def carries_tokens(chunk: dict) -> bool:
    """Whether a stream event carries answer tokens: /generate's meta_info count, OpenAI's usage,
    or a choice with text, content, reasoning or tool calls."""
    for counts in (chunk.get("meta_info"), chunk.get("usage")):
        n = counts.get("completion_tokens") if isinstance(counts, dict) else None
        if isinstance(n, int) and n > 0:
            return True
    for choice in chunk.get("choices") or ():
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        if choice.get("text") or any(delta.get(k) for k in ("content", "reasoning_content", "tool_calls")):
            return True
    return False


class StreamEvents:
    """Per-event rewriting of one deterministic stream."""

    def __init__(self, openai: bool, fingerprint: str):
        self.openai = openai  # an OpenAI endpoint: chunks get `system_fingerprint`
        self.fingerprint = fingerprint
        self.error = False  # an error event passed (SGLang's `data: {"error": ...}`)
        self.saw_tokens = False  # an event carried answer tokens (front.verdict.check_empty)
        self._pending = b""  # the start of an event whose end has not come yet
        self._chunk: dict = {}  # id/object/created/model of the last chunk

    def feed(self, body: bytes) -> tuple[bytes, bytes | None]:
        """(the complete events of `body` so far, rewritten; the `[DONE]` event and everything
        after it, or None while it has not come)."""
        data = self._pending + body
        cut = data.rfind(_SEP)
        if cut < 0:
            self._pending = data
            return b"", None
        self._pending = data[cut + len(_SEP):]
        out = []
        events = data[:cut].split(_SEP)
        for i, event in enumerate(events):
            if event.strip() == DONE:
                return b"".join(out), _SEP.join(events[i:]) + _SEP + self._take_pending()
            out.append(self._rewrite(event) + _SEP)
        return b"".join(out), None

    def _take_pending(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def flush(self) -> bytes:
        """What is left at the end of the body (an event without its blank line), unchanged."""
        return self._take_pending()

    def _rewrite(self, event: bytes) -> bytes:
        if not event.startswith(b"data: {"):
            return event
        try:
            chunk = json.loads(event[len(b"data: "):])
        except ValueError:
            return event
        if not isinstance(chunk, dict):
            return event
        if "error" in chunk:  # (token text cannot make this key: it is the object's own)
            self.error = True
            return event
        self.saw_tokens = self.saw_tokens or carries_tokens(chunk)
        if not self.openai:
            return event
        self._chunk = {k: chunk[k] for k in _CHUNK_KEYS if k in chunk}
        if not self.fingerprint:
            return event
        return b"data: " + json.dumps({**chunk, "system_fingerprint": self.fingerprint}).encode()

    def verdict_event(self, verdict: dict) -> bytes:
        """The event that carries the stream's verdict (sent right before `data: [DONE]`)."""
        if self.openai:
            chunk = {**self._chunk, "choices": [], "mg_verdict": verdict}
            if self.fingerprint:
                chunk["system_fingerprint"] = self.fingerprint
        else:
            chunk = {"mg_verdict": verdict}
        return b"data: " + json.dumps(chunk).encode() + _SEP
