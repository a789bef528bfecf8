"""Request/reply over zmq for mg's processes: typed messages, msg ids, timeouts.

A DEALER socket tags each call with a msg_id; a reply that arrives after its call timed out is
recognised by its id and dropped, so a timeout never desynchronises later calls. A client may
name a `peer_check` (see wire.liveness): while a call waits, it is asked every
`CHECK_PERIOD_S` whether the serving process is still there, so a dead or stopped peer costs a
caller about a second instead of the whole timeout. The socket reconnects by itself to a peer
that binds the same path again (a restarted one).
"""

from __future__ import annotations

import itertools
import os
import time
from typing import Callable

import zmq

from mg_server.wire import protocol as P


CHECK_PERIOD_S = 0.1  # how often a waiting call asks peer_check


class RpcError(RuntimeError):
    """A typed failure: `code` is one of protocol.ErrorCode."""

    def __init__(self, code: str, message: str, rid: str = "", expected_pos: int = -1):
        super().__init__(f"[{code}] {message}")
        self.code, self.message, self.rid, self.expected_pos = code, message, rid, expected_pos

    @classmethod
    def of(cls, e: P.ErrorReply) -> "RpcError":
        return cls(e.code, e.message, e.rid, e.expected_pos)


class RpcClient:
    error_cls: type[RpcError] = RpcError

    def __init__(self, ipc_path: str, timeout_s: float, client_name: str = "",
                 peer_check: Callable[[], str] | None = None):
        self.endpoint = "ipc://" + ipc_path
        self.timeout_s = timeout_s
        self.peer_check = peer_check  # "" while the serving process is alive, else why it is not
        self.client_name = client_name or f"pid{os.getpid()}"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # no send limit: past zmq's default (1000 queued) a send blocks, and while a restarted peer
        # loads (tens of seconds on a GPU) the seam's one-way Steps would stop SGLang's scheduler
        # thread; the queue is bounded by the restart's length and goes to the new peer (what went
        # into the old peer's pipe before zmq saw it go is lost with it)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.connect(self.endpoint)
        self._ids = itertools.count(1)

    def call(self, msg: P.Message, timeout_s: float | None = None) -> P.Message:
        msg.msg_id = next(self._ids)
        self.sock.send(P.encode(msg))
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self.error_cls(P.ErrorCode.TIMEOUT, f"no reply to {type(msg).__name__} in time")
            if not self.sock.poll(max(1, int(min(left, CHECK_PERIOD_S) * 1000))):
                down = self.peer_check() if self.peer_check is not None else ""
                if down:
                    raise self.error_cls(P.ErrorCode.PEER_DOWN, f"no reply to {type(msg).__name__}: {down}")
                continue
            reply = P.decode(self.sock.recv())
            if reply.msg_id != msg.msg_id:
                continue  # the late answer of an earlier, timed-out call
            if isinstance(reply, P.Error):
                raise self.error_cls.of(reply.error)
            return reply

    def send(self, msg: P.Message) -> None:
        """One-way: the server sends nothing back for this message (e.g. Step)."""
        msg.msg_id = next(self._ids)
        self.sock.send(P.encode(msg))

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def set_process_title(title: str) -> None:
    """Name mg's processes in `ps` (`mg::controller`, `mg::verifier`), as SGLang names its own."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.setproctitle(title)
