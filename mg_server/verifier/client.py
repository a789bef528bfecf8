"""Client of a verifier worker: typed calls with timeouts.

One client per thread (zmq sockets are not thread-safe). The request/reply plumbing (DEALER
socket, msg_id per call, late replies of timed-out calls dropped) is `wire.channel.RpcClient`.
"""

from __future__ import annotations

import time
from typing import Callable

from mg_server.wire import protocol as P
from mg_server.wire.channel import RpcClient, RpcError


class VerifierError(RpcError):
    """A typed failure of a verifier call: `code` is one of protocol.ErrorCode."""


class VerifierClient(RpcClient):
    error_cls = VerifierError

    def __init__(self, ipc_path: str, timeout_s: float = 30.0, client_name: str = "",
                 peer_check: Callable[[], str] | None = None):
        super().__init__(ipc_path, timeout_s, client_name, peer_check)
        self.info: P.HelloReply | None = None

    # ---- API ----------------------------------------------------------------------------
    def connect(self, timeout_s: float | None = None, expect_model_id: str = "",
                expect_kernel_config_id: str = "") -> P.HelloReply:
        """Handshake: answered once the worker has loaded (on CUDA, once its K/V pool is allocated:
        `ready` says whether it computes yet; a later hello is answered once it does)."""
        info = self.call(P.Hello(protocol_version=P.PROTOCOL_VERSION, client=self.client_name,
                                  expect_model_id=expect_model_id,
                                  expect_kernel_config_id=expect_kernel_config_id), timeout_s)
        assert isinstance(info, P.HelloReply)
        if info.protocol_version != P.PROTOCOL_VERSION:
            raise VerifierError(P.ErrorCode.PROTOCOL_MISMATCH, f"server speaks {info.protocol_version}")
        self.info = info
        return info

    def verify_many(self, items: list[P.VerifyItem], timeout_s: float | None = None
                    ) -> list[P.VerifyResult | P.ErrorReply]:
        """Send items in one message (served in one batched forward where rids differ)."""
        reply = self.call(P.Verify(items=list(items)), timeout_s)
        assert isinstance(reply, P.VerifyReply)
        return reply.results

    def verify(self, rid: str, pos: int, tokens: list[int], *, rewind: bool = False,
               want_digest: bool = False, timeout_s: float | None = None
               ) -> P.VerifyResult:
        """Verify step `pos` of `rid` after teacher-forcing `tokens` (= t_start..t_pos)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        item = P.VerifyItem(rid=rid, pos=pos, tokens=list(tokens), rewind=rewind, want_digest=want_digest,
                            deadline_ns=time.time_ns() + int(timeout * 1e9))
        (res,) = self.verify_many([item], timeout)
        if isinstance(res, P.ErrorReply):
            raise VerifierError.of(res)
        return res

    def release(self, rids: list[str], timeout_s: float | None = None) -> int:
        """Free finished/aborted requests' shadow caches; returns how many were held."""
        reply = self.call(P.Release(rids=list(rids)), timeout_s)
        return reply.n  # type: ignore[union-attr]

    def stats(self, timeout_s: float | None = None) -> P.StatsReply:
        return self.call(P.Stats(), timeout_s)  # type: ignore[return-value]

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop the worker."""
        self.call(P.Shutdown(), timeout_s)

    def __enter__(self) -> "VerifierClient":
        return self
