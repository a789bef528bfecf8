"""Verdicts on deterministic responses, and the health of mg's runtime, as the front sees them.

A verdict is the controller's state of the request (`protocol.VerdictState`); only `verified`
makes `X-Deterministic-Verified: true`. The front adds rules of its own, so that no answer says
`verified` unless it is one:
- an error response (status >= 400, or a stream that carried an error event) is `failed`
  without asking the controller: its rid may even belong to another request (SGLang's 400
  "Duplicate request IDs"), and an error is never a verified answer;
- a controller that does not answer (dead, stopped) gives `controller-unreachable` within
  seconds (its heartbeat, wire.liveness), and a request still running when the wait ends
  gives `audit-timeout`.
Health: `problem()` reads the controller's heartbeat file (no call that a busy controller could
hold up): a controller that stopped beating, or one whose verifier is down, is a problem; so is
the step seam's finish watcher (its own beat file) when it stopped beating or keeps failing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from typing import Awaitable, Callable

from mg_server.config import FrontConfig
from mg_server.front import correction
from mg_server.front.stream import StreamEvents
from mg_server.wire.liveness import STALE_AFTER_S, beat_path, read_beat, seam_beat_path
from mg_server.wire.protocol import Correction
from mg_server.wire.protocol import VerdictState as S

Send = Callable[[dict], Awaitable[None]]
log = logging.getLogger(__name__)

OPENAI_STREAM_PATHS = ("/v1/chat/completions", "/v1/completions")  # streams of OpenAI chunks
UNREACHABLE, AUDIT_TIMEOUT = "controller-unreachable", "audit-timeout"
PROBLEM_LOOKS = 5  # a verdict wait ends after the runtime had a health problem at 5 looks, 1 s apart


def overall(states: list[str]) -> tuple[bool, str]:
    """(verified, the verdict shown) of a response covering requests in `states`: the first
    state that is not `verified`, else `verified`."""
    ok = bool(states) and all(s == S.VERIFIED for s in states)
    return ok, next((s for s in states if s != S.VERIFIED), S.VERIFIED) if states else S.UNKNOWN


def verdict_object(rids: list[str], states: list[str], kernel_config_id: str) -> dict:
    """The `mg_verdict` field of a deterministic answer (the last event of a stream, a field of a
    non-streamed OpenAI answer): what `X-Deterministic-Verified` and `X-MG-Verdict` say, plus
    each request's id and state (a /generate batch has several) and the verifier's kernel id."""
    ok, worst = overall(states)
    out = {"verified": ok, "verdict": worst, "rids": rids, "states": states}
    if kernel_config_id:
        out["kernel_config"] = kernel_config_id
    return out


def verdict_headers(states: list[str], kernel_config_id: str) -> list[tuple[bytes, bytes]]:
    ok, worst = overall(states)
    headers = [(b"x-deterministic-verified", b"true" if ok else b"false"), (b"x-mg-verdict", worst.encode())]
    if kernel_config_id:
        headers.append((b"x-mg-kernel-config", kernel_config_id.encode()))
    return headers


class RuntimeView:
    """Blocking lookups of mg's runtime for the front (verdicts run in a worker thread)."""

    def __init__(self, config: FrontConfig):
        self.config = config
        self._local = threading.local()  # one controller client per executor thread

    def _verdicts_blocking(self, rids: list[str], correct: bool) -> list[tuple[str, Correction | None]]:
        if not self.config.controller_ipc:
            return [(S.UNVERIFIED, None)] * len(rids)  # mode off: nothing checks the tokens
        from mg_server.controller.client import ControllerClient

        client = getattr(self._local, "client", None)
        if client is None:
            # the verdict may first run the request's tail audit: allow the whole wait for it
            client = self._local.client = ControllerClient(self.config.controller_ipc,
                                                           timeout_s=self.config.verdict_wait_s, client_name="front")
        deadline = time.monotonic() + self.config.verdict_wait_s
        next_look, troubled = time.monotonic() + 1.0, 0
        states = []
        for rid in rids:
            corr = None
            while True:
                try:
                    reply = client.verdict(rid, correct)
                    state, corr = reply.state, reply.correction
                except Exception:  # noqa: BLE001 - no answer is no verification
                    state = UNREACHABLE
                if state != S.RUNNING or time.monotonic() > deadline:
                    break
                if time.monotonic() > next_look:  # a dead runtime will never end the wait
                    next_look = time.monotonic() + 1.0
                    # a problem seen at PROBLEM_LOOKS looks in a row (not a beat late on a busy host)
                    troubled = troubled + 1 if self.problem() else 0
                    if troubled >= PROBLEM_LOOKS:
                        break
                time.sleep(0.01)
            states.append((AUDIT_TIMEOUT if state == S.RUNNING else state, corr))
        return states

    async def verdicts(self, rids: list[str], correct: bool = False) -> list[tuple[str, Correction | None]]:
        """(state, correction) per rid; `correct`: the caller can swap in a corrected answer."""
        return await asyncio.to_thread(self._verdicts_blocking, rids, correct)

    def problem(self) -> str:
        """Why mg cannot serve deterministic requests now ("" if it can, or in mode off)."""
        if not self.config.controller_ipc:
            return ""
        beat = read_beat(beat_path(self.config.controller_ipc))
        if beat is None:
            return "mg controller is not running"
        if beat.age_s > STALE_AFTER_S:
            return f"mg controller is not responding (no heartbeat for {beat.age_s:.0f}s)"
        if beat.status != "verifier up":  # down, restarting, or starting (on CUDA: waiting for SGLang's weights)
            return f"mg {beat.status}"
        # The seam's finish watcher (scheduler process): without it no verdict completes.
        seam = read_beat(seam_beat_path(self.config.controller_ipc))
        if seam is not None and seam.age_s > STALE_AFTER_S:
            return f"mg finish watcher is not running (no heartbeat for {seam.age_s:.0f}s)"
        if seam is not None and seam.status.startswith("error"):
            return "mg finish watcher is failing: " + seam.status.removeprefix("error ")
        return ""


def with_fields(body: bytes, fields: dict) -> bytes:
    """A non-streamed OpenAI answer (a JSON object with choices) with `fields` set (its
    `system_fingerprint`, `mg_verdict`); any other body unchanged."""
    try:
        answer = json.loads(body)
    except ValueError:
        return body
    if not isinstance(answer, dict) or "choices" not in answer:
        return body  # /generate's native answer, an error: the headers only
    return json.dumps({**answer, **fields}).encode()


def answer_tokens(body: bytes, n: int) -> list[int | None]:
    """Completion tokens of each of the `n` answers in a non-streamed body (None where the body
    does not say): OpenAI's usage, /generate's meta_info (a list for a batch)."""
    try:
        answer = json.loads(body)
    except ValueError:
        return [None] * n
    items = answer if isinstance(answer, list) else [answer]
    if isinstance(answer, dict) and "usage" in answer:
        usage = answer.get("usage")
        items = [{"meta_info": usage}] if isinstance(usage, dict) else [{}]
    counts = [(it.get("meta_info") or {}).get("completion_tokens") if isinstance(it, dict) else None for it in items]
    counts = [c if isinstance(c, int) and not isinstance(c, bool) else None for c in counts]
    return counts if len(counts) == n else [None] * n


def check_empty(settled: dict[str, str], rids: list[str], counts: list[int | None]) -> dict[str, str]:
    """`settled` with every empty-answer verdict the answer contradicts made `failed`: a request
    mg took for empty is `verified` only if its answer has no token (nothing went unchecked)."""
    out = dict(settled)
    for rid, n in zip(rids, counts):
        if out.get(rid) == S.VERIFIED and n != 0:
            log.error("mg: request %s asked for no token but its answer has %s; verdict failed", rid, n)
            out[rid] = S.FAILED
    return out


def verdict_sender(send: Send, echo: tuple[bytes, bytes], rids: list[str], view: RuntimeView,
                   kernel_config_id: str, settled: dict[str, str] | None = None, path: str = "",
                   fingerprint: str = "", checked: bool = False) -> Send:
    """Wrap `send` so the response of deterministic request(s) `rids` carries its verdict
    (`settled`: verdicts known without the controller, e.g. empty answers, checked against the
    answer here unless `checked` says the caller did) and `fingerprint`
    (OpenAI's system_fingerprint; "" for none). A non-streamed answer (one request, or each of
    a /generate batch) whose audit found a missed flip gets the corrected answer
    (front.correction) and the verdict `verified`, if its body can be rewritten: the verifier's
    completion."""
    held: dict | None = None  # the response start of a non-streamed answer, until its verdict
    parts: list[bytes] = []  # its body, until the last part
    stream: StreamEvents | None = None  # a stream's events, until its `[DONE]`
    done = False
    failed = False  # an error status, or an error event in the stream
    settled = settled or {}
    shown = [r.rpartition("#")[0] or r for r in rids]  # the client's ids, not mg's instance keys

    async def states(correct: bool = False) -> list[tuple[str, Correction | None]]:
        if failed:
            return [(S.FAILED, None)] * len(rids)
        ask = [r for r in rids if r not in settled]
        got = dict(zip(ask, await view.verdicts(ask, correct))) if ask else {}
        return [(settled[r], None) if r in settled else got[r] for r in rids]

    async def finish_held(body: bytes) -> tuple[dict, bytes]:
        nonlocal settled
        if settled and not checked:
            settled = check_empty(settled, rids, answer_tokens(body, len(rids)))
        got = await states(correct=len(rids) == 1 or path == "/generate")
        extra: list[tuple[bytes, bytes]] = []
        if any(n is not None for _, n in got):
            body, ok = correction.apply(body, path, [n for _, n in got], view.config.model_path)
            # where the body cannot take the rewrite the controller counted on: mismatch
            got = [(st, n) if k else (S.MISMATCH, None) for (st, n), k in zip(got, ok)]
        if any(n is not None for _, n in got):  # per request of the body, "-" where none
            extra.append((b"x-mg-corrected-from", ",".join(str(n.first) if n else "-" for _, n in got).encode()))
        final = [st for st, _ in got]
        fields = {"mg_verdict": verdict_object(shown, final, kernel_config_id)}
        if fingerprint and not failed:
            fields["system_fingerprint"] = fingerprint
        body = with_fields(body, fields)
        headers = [(k, v) for k, v in held["headers"] if k.lower() != b"content-length"]
        headers += [(b"content-length", str(len(body)).encode())] + extra
        headers += verdict_headers(final, kernel_config_id)
        return {**held, "headers": headers}, body

    async def send_with_verdict(message: dict) -> None:
        nonlocal held, stream, failed, done, settled
        if message["type"] == "http.response.start":
            headers = list(message.get("headers", [])) + [echo]
            if fingerprint:
                headers.append((b"x-mg-system-fingerprint", fingerprint.encode()))
            failed = message.get("status", 200) >= 400
            if any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers):
                # its verdict comes last in the stream (front.stream); the kernel id is known now
                stream = StreamEvents(path in OPENAI_STREAM_PATHS, fingerprint)
                headers.append((b"x-deterministic-verified", b"in-stream"))
                if kernel_config_id:
                    headers.append((b"x-mg-kernel-config", kernel_config_id.encode()))
                return await send({**message, "headers": headers})
            held = {**message, "headers": headers}
            return None
        if message["type"] != "http.response.body":
            return await send(message)
        body = message.get("body", b"")
        if stream is not None and not done:
            more = message.get("more_body", False)
            events, tail = stream.feed(body)
            failed = failed or stream.error
            if tail is None:
                events += b"" if more else stream.flush()
                return await send({**message, "body": events}) if events or not more else None
            done = True
            if events:
                await send({"type": "http.response.body", "body": events, "more_body": True})
            # a stream's tokens have left: a missed flip stays `mismatch`
            if settled and not checked and stream.saw_tokens:
                settled = check_empty(settled, rids, [None] * len(rids))
            got = [st for st, _ in await states()]
            event = stream.verdict_event(verdict_object(shown, got, kernel_config_id))
            return await send({**message, "body": event + tail})
        if held is None:
            return await send(message)
        parts.append(body)
        if message.get("more_body", False):
            return None  # a multi-part body: held whole until its verdict
        start, whole = await finish_held(b"".join(parts))
        held = None
        await send(start)
        await send({**message, "body": whole, "more_body": False})

    return send_with_verdict
