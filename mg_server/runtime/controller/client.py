"""Client of the controller, used by mg's forward hook (scheduler process) and the HTTP front.

One client per thread: zmq sockets are not thread-safe. A call gives up as soon as the
controller stops beating (runtime.liveness), so a dead or stopped controller costs a caller
seconds, not the call's timeout.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from mg_server.runtime import protocol as P
from mg_server.runtime.channel import RpcClient, RpcError
from mg_server.runtime.liveness import beat_path, stale_reason


class ControllerClient(RpcClient):
    def __init__(self, ipc_path: str, timeout_s: float = 60.0, client_name: str = "",
                 peer_check: Callable[[], str] | None = None, spin_s: float = 0.0):
        super().__init__(ipc_path, timeout_s, client_name,
                         peer_check or partial(stale_reason, beat_path(ipc_path)), spin_s)

    def hello(self, timeout_s: float | None = None) -> P.ControllerInfo:
        info = self.call(P.ControllerHello(protocol_version=P.PROTOCOL_VERSION, client=self.client_name), timeout_s)
        if info.protocol_version != P.PROTOCOL_VERSION:
            raise RpcError(P.ErrorCode.PROTOCOL_MISMATCH, f"controller speaks protocol {info.protocol_version}")
        return info

    def step(self, rows: list[P.StepRow], timeout_s: float | None = None) -> list[P.StepDecision]:
        return self.call(P.Step(rows=rows), timeout_s).decisions

    def report(self, rows: list[P.StepRow]) -> None:
        """Fast commits the seam decided itself (no reply; the controller applies the same policy)."""
        self.send(P.Step(rows=rows, reply=False))

    def stops(self, timeout_s: float | None = None) -> P.StopsReply:
        """Resumable requests that diverged since the last ask (their fast path should end), window
        requests to roll back, and how much of each window request is checked."""
        return self.call(P.Stops(), timeout_s)

    def check_tail(self, rid: str, timeout_s: float | None = None) -> P.TailReply:
        return self.call(P.CheckTail(rid=rid), timeout_s)

    def finish(self, msg: P.Finish, timeout_s: float | None = None) -> None:
        self.call(msg, timeout_s)

    def verdict(self, rid: str, correct: bool = False, timeout_s: float | None = None) -> P.VerdictReply:
        return self.call(P.Verdict(rid=rid, correct=correct), timeout_s)

    def shutdown(self, timeout_s: float | None = None) -> None:
        self.call(P.Shutdown(), timeout_s)
