"""Request/reply over zmq for mg's processes: typed messages, msg ids, timeouts.

A DEALER socket tags each call with a msg_id; a reply that arrives after its call timed out is
recognised by its id and dropped, so a timeout never desynchronises later calls.
"""

from __future__ import annotations

import itertools
import os
import time

import zmq

from mg_server.runtime import protocol as P


class RpcError(RuntimeError):
    """A typed failure: `code` is one of protocol.ErrorCode."""

    def __init__(self, code: str, message: str, rid: str = "", expected_pos: int = -1):
        super().__init__(f"[{code}] {message}")
        self.code, self.rid, self.expected_pos = code, rid, expected_pos

    @classmethod
    def of(cls, e: P.ErrorReply) -> "RpcError":
        return cls(e.code, e.message, e.rid, e.expected_pos)


class RpcClient:
    error_cls: type[RpcError] = RpcError

    def __init__(self, ipc_path: str, timeout_s: float, client_name: str = ""):
        self.endpoint = "ipc://" + ipc_path
        self.timeout_s = timeout_s
        self.client_name = client_name or f"pid{os.getpid()}"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(self.endpoint)
        self._ids = itertools.count(1)

    def call(self, msg: P.Message, timeout_s: float | None = None) -> P.Message:
        msg.msg_id = next(self._ids)
        self.sock.send(P.encode(msg))
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                raise self.error_cls(P.ErrorCode.TIMEOUT, f"no reply to {type(msg).__name__} in time")
            reply = P.decode(self.sock.recv())
            if reply.msg_id != msg.msg_id:
                continue  # the late answer of an earlier, timed-out call
            if isinstance(reply, P.Error):
                raise self.error_cls.of(reply.error)
            return reply

    def send(self, msg: P.Message) -> None:
        """One-way: the server sends nothing back for this message (e.g. Step with reply=False)."""
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
