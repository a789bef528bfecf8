"""Client of the controller, used by mg's forward hook (scheduler process) and the HTTP front.

One client per thread: zmq sockets are not thread-safe. A call gives up as soon as the
controller stops beating, or once another controller beats in its place (wire.liveness
`PeerWatch`: a restarted controller does not know the call's request), so a dead, stopped or
restarted controller costs a caller seconds, not the call's timeout. The socket reconnects to a
restarted controller by itself (the same ipc path).
"""

from __future__ import annotations

from typing import Callable

from mg_server.wire import protocol as P
from mg_server.wire.channel import RpcClient, RpcError
from mg_server.wire.liveness import PeerWatch, beat_path


class ControllerClient(RpcClient):
    def __init__(self, ipc_path: str, timeout_s: float = 60.0, client_name: str = "",
                 peer_check: Callable[[], str] | None = None):
        self.watch = PeerWatch(beat_path(ipc_path))
        super().__init__(ipc_path, timeout_s, client_name, peer_check or self.watch)

    def call(self, msg: P.Message, timeout_s: float | None = None) -> P.Message:
        self.watch.reset()  # the controller serving this call is the one beating at its first look
        return super().call(msg, timeout_s)

    def hello(self, timeout_s: float | None = None) -> P.ControllerInfo:
        info = self.call(P.ControllerHello(protocol_version=P.PROTOCOL_VERSION, client=self.client_name), timeout_s)
        if info.protocol_version != P.PROTOCOL_VERSION:
            raise RpcError(P.ErrorCode.PROTOCOL_MISMATCH, f"controller speaks protocol {info.protocol_version}")
        return info

    def arrive(self, msg: P.Arrive) -> None:
        """A deterministic request's prompt at its arrival (one way, ahead of its first step on
        the same socket)."""
        self.send(msg)

    def report(self, rows: list[P.StepRow]) -> None:
        """Fast commits the seam decided itself (no reply; the controller checks them behind)."""
        self.send(P.Step(rows=rows))

    def news(self, timeout_s: float | None = None) -> P.WindowNewsReply:
        """Requests to roll back, and how much of each live request is checked."""
        return self.call(P.WindowNews(), timeout_s)

    def check_tail(self, rid: str, timeout_s: float | None = None) -> P.TailReply:
        return self.call(P.CheckTail(rid=rid), timeout_s)

    def finish(self, msg: P.Finish) -> None:
        """One way, like `report`: the finish watcher never waits on a busy controller (its
        verify calls can take seconds), and one socket keeps it behind the request's last rows."""
        self.send(msg)

    def verdict(self, rid: str, correct: bool = False, timeout_s: float | None = None) -> P.VerdictReply:
        return self.call(P.Verdict(rid=rid, correct=correct), timeout_s)

    def shutdown(self, timeout_s: float | None = None) -> None:
        self.call(P.Shutdown(), timeout_s)
