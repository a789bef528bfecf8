"""Client of a verifier worker: typed calls with timeouts, K/V columns read from shared slots.

One client per thread (zmq sockets are not thread-safe). The request/reply plumbing (DEALER
socket, msg_id per call, late replies of timed-out calls dropped) is `wire.channel.RpcClient`.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from mg_server.wire import protocol as P
from mg_server.wire.channel import RpcClient, RpcError
from mg_server.wire.shm import SlotBuffer


class VerifierError(RpcError):
    """A typed failure of a verifier call: `code` is one of protocol.ErrorCode."""


class VerifierClient(RpcClient):
    error_cls = VerifierError

    def __init__(self, ipc_path: str, timeout_s: float = 30.0, client_name: str = "",
                 peer_check: Callable[[], str] | None = None):
        super().__init__(ipc_path, timeout_s, client_name, peer_check)
        self.info: P.HelloReply | None = None
        self.slots: SlotBuffer | None = None

    # ---- API ----------------------------------------------------------------------------
    def connect(self, timeout_s: float | None = None, expect_model_id: str = "",
                expect_kernel_config_id: str = "", attach_slots: bool = True) -> P.HelloReply:
        """Handshake (waits for the worker to load) and attach the shared slot buffer.

        attach_slots=False for a client that only relays (slot, gen) to another process: on CUDA,
        attaching opens a CUDA context and an IPC mapping in this process.
        """
        info = self.call(P.Hello(protocol_version=P.PROTOCOL_VERSION, client=self.client_name,
                                  expect_model_id=expect_model_id,
                                  expect_kernel_config_id=expect_kernel_config_id), timeout_s)
        assert isinstance(info, P.HelloReply)
        if info.protocol_version != P.PROTOCOL_VERSION:
            raise VerifierError(P.ErrorCode.PROTOCOL_MISMATCH, f"server speaks {info.protocol_version}")
        if self.slots is not None:
            self.slots.close()
        self.info, self.slots = info, (SlotBuffer.attach(info.shm) if attach_slots else None)
        return info

    def verify_many(self, items: list[P.VerifyItem], timeout_s: float | None = None
                    ) -> list[P.VerifyResult | P.ErrorReply]:
        """Send items in one message (served in one batched forward where rids differ)."""
        reply = self.call(P.Verify(items=list(items)), timeout_s)
        assert isinstance(reply, P.VerifyReply)
        return reply.results

    def verify(self, rid: str, pos: int, tokens: list[int], *, rewind: bool = False,
               want_digest: bool = False, want_column: bool = False, timeout_s: float | None = None
               ) -> P.VerifyResult:
        """Verify step `pos` of `rid` after teacher-forcing `tokens` (= t_start..t_pos)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        item = P.VerifyItem(rid=rid, pos=pos, tokens=list(tokens), rewind=rewind, want_digest=want_digest,
                            want_column=want_column, deadline_ns=time.time_ns() + int(timeout * 1e9))
        (res,) = self.verify_many([item], timeout)
        if isinstance(res, P.ErrorReply):
            raise VerifierError.of(res)
        return res

    def kv_column(self, res: P.VerifyResult, out: torch.Tensor | None = None) -> torch.Tensor:
        """The K/V column of position res.pos: [L, 2, Hkv, D] (0 = K after RoPE, 1 = V), copied
        out of the shared slot (raises shm.StaleSlot if the slot was reused meanwhile). Only a
        result of an item with want_column has one."""
        assert self.slots is not None, "connect() first"
        if res.slot < 0:
            raise ValueError(f"the result of {res.rid!r} at {res.pos} carries no K/V column (verify with want_column)")
        return self.slots.read(res.slot, res.gen, out)

    def release(self, rids: list[str], timeout_s: float | None = None) -> int:
        """Free finished/aborted requests' shadow caches; returns how many were held."""
        reply = self.call(P.Release(rids=list(rids)), timeout_s)
        return reply.n  # type: ignore[union-attr]

    def stats(self, timeout_s: float | None = None) -> P.StatsReply:
        return self.call(P.Stats(), timeout_s)  # type: ignore[return-value]

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop the worker. Detaches the slot buffer first: a CUDA IPC mapping must be released
        before its producer exits."""
        if self.slots is not None:
            self.slots.close()
            self.slots = None
        self.call(P.Shutdown(), timeout_s)

    def close(self) -> None:
        if self.slots is not None:
            self.slots.close()
            self.slots = None
        super().close()

    def __enter__(self) -> "VerifierClient":
        return self
