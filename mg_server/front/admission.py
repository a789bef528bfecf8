"""Admission of deterministic requests, and their part of SIGTERM's drain (HTTP process).

The verifier holds one shadow K/V cache per deterministic request it checks (`max_requests`),
so at most that many deterministic requests (a /generate batch or seeded n > 1 counts each
prompt or sample) are in SGLang at once. Past it they wait in a FIFO queue of `queue_size`
requests; past that a 429 with `Retry-After`. One request larger than the verifier holds is a
400 (it could never run). Why not let SGLang take them all: a request the verifier cannot hold
fails when its first check comes, after SGLang has spent its decode.

Shutdown (launch.shutdown calls these from its own threads): `stop()` refuses new and queued
deterministic requests with a 503; `drained()` says when every admitted one has been answered;
`cut()` answers those still running with a 503 (an unstarted response) or an error event and
the end of the stream (a started one), so no client sees a reset connection.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
from typing import Awaitable, Callable

Send = Callable[[dict], Awaitable[None]]

RETRY_AFTER_S = 1  # a queue that is full now has room within about a second at the usual answer rates


class Refused(Exception):
    def __init__(self, status: int, message: str, param: str = "X-Deterministic", retry_after: int = 0):
        super().__init__(message)
        self.status, self.param, self.retry_after = status, param, retry_after


class Admission:
    def __init__(self, capacity: int, queue_size: int):
        self.capacity, self.queue_size = capacity, queue_size
        self.used = 0  # slots held by admitted requests
        self.waiting: collections.deque[tuple[int, asyncio.Future]] = collections.deque()  # (slots, future), FIFO
        self.running: dict[int, Callable[[], None]] = {}  # admitted request -> its cut
        self.stopping = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()  # drained() / stop() / cut() come from other threads
        self._next = 0

    async def enter(self, slots: int, what: str) -> int:
        """Wait for `slots` verifier slots; returns a ticket for `leave`. Refused: too large,
        the queue is full, or the server is stopping."""
        self.loop = self.loop or asyncio.get_running_loop()
        if self.stopping:
            raise Refused(503, "the server is shutting down and admits no new deterministic requests", "mg")
        if slots > self.capacity:
            raise Refused(400, f"{what} asks for {slots} deterministic completions; the verifier holds at most "
                               f"{self.capacity} at once: send at most {self.capacity} per request", what)
        if not self.waiting and self.used + slots <= self.capacity:
            self.used += slots
        else:
            if len(self.waiting) >= self.queue_size:
                raise Refused(429, f"{self.used} deterministic completions are running and {len(self.waiting)} "
                                   f"requests wait for the verifier (--mg-queue {self.queue_size}); retry later",
                              "mg", RETRY_AFTER_S)
            fut = self.loop.create_future()
            self.waiting.append((slots, fut))
            try:
                await fut
            except asyncio.CancelledError:  # the client left while waiting
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    self._release(slots)  # admitted just as it left: give the slots back
                else:
                    self._drop_waiter(fut)
                raise
        with self._lock:
            self._next += 1
            return self._next

    def _drop_waiter(self, fut: asyncio.Future) -> None:
        self.waiting = collections.deque(w for w in self.waiting if w[1] is not fut)
        self._wake()

    def _wake(self) -> None:
        while self.waiting and self.used + self.waiting[0][0] <= self.capacity:
            slots, fut = self.waiting.popleft()
            if fut.done():
                continue
            self.used += slots
            fut.set_result(None)

    def _release(self, slots: int) -> None:
        self.used -= slots
        self._wake()

    def leave(self, ticket: int, slots: int) -> None:
        with self._lock:
            self.running.pop(ticket, None)
        self._release(slots)

    def on_cut(self, ticket: int, cut: Callable[[], None]) -> None:
        with self._lock:
            self.running[ticket] = cut

    # ---- shutdown (any thread) -----------------------------------------------------------
    def stop(self) -> None:
        """Admit nothing more; queued requests are refused (503)."""
        self.stopping = True
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self._refuse_waiting)

    def _refuse_waiting(self) -> None:
        while self.waiting:
            _, fut = self.waiting.popleft()
            if not fut.done():
                fut.set_exception(Refused(503, "the server shut down before this deterministic request was "
                                               "admitted", "mg"))

    def drained(self) -> bool:
        with self._lock:
            return not self.running and self.used == 0 and not self.waiting

    def cut(self) -> int:
        """Answer every running deterministic request now (see the module doc); returns how many."""
        with self._lock:
            cuts = list(self.running.values())
        if self.loop is not None:
            for c in cuts:
                self.loop.call_soon_threadsafe(c)
        return len(cuts)


# The HTTP process's admissions (one per middleware instance SGLang's app builds), for the shutdown.
_ALL: list[Admission] = []


def register(adm: Admission | None) -> None:
    if adm is not None:
        _ALL.append(adm)


def stop() -> None:
    for a in _ALL:
        a.stop()


def drained() -> bool:
    return all(a.drained() for a in _ALL)


def cut() -> int:
    return sum(a.cut() for a in _ALL)


def refusal_body(e: Refused) -> bytes:
    kind = {400: "BadRequestError", 429: "RateLimitError"}.get(e.status, "ServiceUnavailableError")
    return json.dumps({"object": "error", "message": str(e), "type": kind, "param": e.param,
                       "code": e.status}).encode()


class Guard:
    """Runs one admitted request's app call so that `cut` can end it: the response answered with
    a 503 if it has not started, else ended with an error event; the app call is cancelled."""

    def __init__(self, send: Send, refused_headers: list[tuple[bytes, bytes]],
                 on_end: Callable[[], None] | None = None):
        self.send, self.headers = send, refused_headers
        # called once the response's last message has gone: SGLang's streamed /generate returns
        # from its app call only 2 s later (its disconnect check), which must not hold the slots
        self.on_end = on_end
        self.started = self.ended = False
        self.task: asyncio.Task | None = None
        self.cutting: asyncio.Future | None = None  # the cut's answer, once cut

    async def tracked(self, message: dict) -> None:
        if self.ended:
            return  # cut already: the app's later messages go nowhere
        last = message["type"] == "http.response.body" and not message.get("more_body", False)
        if message["type"] == "http.response.start":
            self.started = True
        elif last:
            self.ended = True
        await self.send(message)
        if last and self.on_end is not None:
            self.on_end()

    async def run(self, call: Awaitable[None]) -> None:
        self.task = asyncio.ensure_future(call)
        try:
            await self.task
        except asyncio.CancelledError:
            if self.cutting is None:  # not our cut: pass the cancellation on
                raise
        if self.cutting is not None:
            await self.cutting  # the cut's answer is the response: it is complete once that is sent

    def cut(self) -> None:
        if self.ended or self.task is None or self.cutting is not None:
            return
        self.cutting = asyncio.ensure_future(self._answer_cut())

    async def _answer_cut(self) -> None:
        why = "the server stopped before this deterministic answer was complete"
        self.task.cancel()
        if not self.started:
            body = refusal_body(Refused(503, why, "mg"))
            self.started = self.ended = True
            await self.send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *self.headers]})
            await self.send({"type": "http.response.body", "body": body})
        else:  # a stream: an error event (the verdict failed), then its end
            self.ended = True
            event = json.dumps({"error": {"message": why, "code": 503, "mg_verdict": "failed"}})
            await self.send({"type": "http.response.body", "body": f"data: {event}\n\n".encode(), "more_body": False})
