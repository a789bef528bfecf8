"""A stream gate: hold a CUDA stream until the host releases it, only when the device says so.

Why: mg's fast path must not wait for the GPU before sampling (a device-to-host read of the
margins there costs the overlap scheduler its CPU/GPU overlap on every deterministic forward).
So the sampler's stream decides on the device whether a forward needs the verifier
(`need_any`); if not, the gate is a no-op kernel and the stream runs on. If it does, one program
spins on a device flag until the host has written the verifier's tokens and released the gate
(flag >= target), or until `timeout_ns` has passed (a last resort against a lost host: the fast
tokens are then sampled, and mg's end-of-request check against its own decisions fails the
request instead of calling it verified).

Contract: `gate(flag, need_any, target, timeout_ns, status)` enqueues one kernel on the current
stream. flag: [1] int64 cuda, raised only by the host (monotonic targets); need_any: [1] int32
cuda (0: pass through); status: [1] int32 cuda, written 0 (passed), 1 (released) or 2 (timed out).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _now_ns(dummy):
    # %globaltimer: the GPU's nanosecond wall clock (one dummy operand: the asm needs a shape)
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [dummy], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit(do_not_specialize=["target", "timeout_ns"])
def _gate_kernel(flag_ptr, need_ptr, status_ptr, target, timeout_ns):
    need = tl.load(need_ptr)
    if need != 0:
        v = tl.load(flag_ptr, volatile=True)  # volatile: re-read from memory, never cached
        t0 = _now_ns(v)
        waited = t0 - t0
        while (v < target) & (waited < timeout_ns):
            v = tl.load(flag_ptr, volatile=True)
            waited = _now_ns(v) - t0
        tl.store(status_ptr, tl.where(v >= target, 1, 2).to(tl.int32))
    else:
        tl.store(status_ptr, 0)


def gate(flag: Tensor, need_any: Tensor, target: int, timeout_ns: int, status: Tensor) -> None:
    """Enqueue the gate on the current stream (see module doc); returns at once."""
    if not (flag.is_cuda and need_any.is_cuda and status.is_cuda):
        raise ValueError("the stream gate runs on CUDA tensors only")
    _gate_kernel[(1,)](flag, need_any, status, int(target), int(timeout_ns), num_warps=1)


def release(flag: Tensor, target: int) -> None:
    """Host side: release every gate up to `target`, on the current stream (call it on a stream
    the gated one does not wait for)."""
    flag.fill_(int(target))


__all__ = ["gate", "release"]
