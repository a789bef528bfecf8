"""A step gate: the device publishes a forward's step values to the host and, only if some row
needs the verifier, holds its stream until the host answers through page-locked memory.

Why: mg's fast path must not wait for the GPU before sampling (a device-to-host read of the
margins there costs the overlap scheduler its CPU/GPU overlap on every deterministic forward).
And the host's answer must not be a CUDA command: CUDA orders a device or page-locked memory
allocation made anywhere in the process after all earlier work (implicit synchronization), so a
release queued on a stream can wait behind the very gate it should open. Here the host answers
with plain stores to page-locked host memory, which the kernel reads (UVA: the pointer of a
cudaHostAlloc'd buffer is valid on the device), so no CUDA call is on the release path at all.

Per forward (`StepGate.launch`), on the sampler's stream (a row's need: 0 no, 1 the verifier
decides its token now, 2 it is verified behind: the fast token goes through, no hold):
  1. publish kernel: write each row's (margin, fast token, position, need, target)
     to `out` (the row's tag after a system fence by the thread that wrote its values), then
     `out[0] = target`; the host trusts the values once the forward's and every row's tag are
     there (measured: one tag after a block barrier could land before other threads' values).
     If no row's need is 1, the kernel raises `flag` to target itself;
  2. cuStreamWaitValue64(flag >= target): the GPU's front end holds the stream, no SM spins.
     (Measured: a spinning kernel makes the GPU time-slice against the verifier process at each
     of its host syncs, 119.8 vs 2.47 ms per round (docs/history/gpu-measurements.md).) The host
     writes its tokens, repair descriptors and the inbox tag, then raises `flag`;
  3. apply kernel: released iff the inbox holds this target; chosen[k] = the host's token for
     rows of need 1, else the fast token; for each repair, copy the verifier's
     K/V column (slot buffer -> SGLang's per-layer pool, loc from req_to_token) itself, so it is
     ordered before every later forward on the stream; `ack = (target, status)`: 0 passed, 1
     released, 2 opened without an answer (`open`, the host's watchdog: fast tokens, nothing
     repaired; the host fails the rows that needed the verifier).
The host reads `out` after it sees the tag and writes `inbox` only then, and the next forward's
kernels are launched only after the host processed this one (lagged.py), so one set of
mailboxes is reused: no allocation per forward, which is what the implicit synchronization
punishes.

`ReferenceStepGate` is the same protocol on CPU tensors, run synchronously (the device's part at
`launch`, or at `release` for a holding gate): the host logic's unit tests use it, and the GPU
tests check the kernel against it.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from mg_server.seam.kernel_launch import Launcher, current_stream


@triton.jit
def _fence_sys(x):
    # membar.sys: this thread's earlier writes are visible system-wide (the host included) before
    # its later ones, and its later reads see what others wrote before it; returns x, so a store
    # of the result cannot move before the fence
    return tl.inline_asm_elementwise("membar.sys; mov.b64 $0, $1;", "=l,l", [x], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit(do_not_specialize=["n", "target"])
def _publish_kernel(margin_ptr, fast_ptr, pos_ptr, need_ptr,  # [n] device
                    out_ptr, flag_ptr,  # page-locked host memory (module doc)
                    n, target, RB: tl.constexpr):
    r = tl.arange(0, RB)
    need_any = tl.zeros((), dtype=tl.int32)
    for s in range(0, n, RB):
        rows = s + r
        m = rows < n
        base = out_ptr + 1 + 5 * rows
        nd = tl.load(need_ptr + rows, mask=m, other=0)
        tl.store(base, tl.load(margin_ptr + rows, mask=m, other=0.0).to(tl.float64), mask=m)
        tl.store(base + 1, tl.load(fast_ptr + rows, mask=m, other=0).to(tl.float64), mask=m)
        tl.store(base + 2, tl.load(pos_ptr + rows, mask=m, other=0).to(tl.float64), mask=m)
        tl.store(base + 3, nd.to(tl.float64), mask=m)
        # each row's own tag, stored by the thread that stored its values, after a system fence:
        # the host trusts a row only once its tag is there (no ordering across threads assumed)
        rtag = _fence_sys(tl.zeros([RB], dtype=tl.int64) + target)
        tl.store(base + 4, rtag.to(tl.float64), mask=m)
        need_any = need_any | tl.max((nd == 1).to(tl.int32), axis=0)  # (2: verified behind, never held)
    tag = _fence_sys(target.to(tl.int64))
    tl.debug_barrier()
    tl.store(out_ptr, tag.to(tl.float64))
    if need_any == 0:  # nothing for the host to decide: open the stream wait ourselves
        tl.store(flag_ptr, _fence_sys(target.to(tl.int64)))


@triton.jit(do_not_specialize=["n", "cap", "target", "r2t_stride"])
def _apply_kernel(fast_ptr, need_ptr, chosen_ptr,  # [n] device
                  in_ptr, ack_ptr,  # page-locked host memory (module doc)
                  slots_ptr, k_off_ptr, v_off_ptr, r2t_ptr, r2t_stride,
                  n, cap, target,
                  COL: tl.constexpr, LAYERS: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr):
    r = tl.arange(0, RB)
    need_any = tl.zeros((), dtype=tl.int32)
    for s in range(0, n, RB):
        need_any = need_any | tl.max((tl.load(need_ptr + s + r, mask=s + r < n, other=0) == 1).to(tl.int32), axis=0)
    released = tl.zeros((), dtype=tl.int32)
    status = tl.zeros((), dtype=tl.int64)
    if need_any != 0:
        # one verdict for all threads: released only if every lane reads this target (the host
        # writes the inbox tag before it raises the flag and never rewrites it before the ack)
        seen = tl.load(in_ptr + tl.zeros([RB], dtype=tl.int32), volatile=True)
        released = tl.min((_fence_sys(seen) == target).to(tl.int32), axis=0)
        status = tl.where(released != 0, 1, 2).to(tl.int64)
    for s in range(0, n, RB):
        rows = s + r
        m = rows < n
        fast = tl.load(fast_ptr + rows, mask=m, other=0)
        nd = tl.load(need_ptr + rows, mask=m, other=0)
        host = tl.load(in_ptr + 2 + rows, mask=m & (nd == 1) & (released != 0), other=0, volatile=True)
        tl.store(chosen_ptr + rows, tl.where((nd == 1) & (released != 0), host, fast), mask=m)
    if released != 0:
        c = tl.arange(0, CB)
        cm = c < COL
        nrep = tl.load(in_ptr + 1, volatile=True)
        for j in range(nrep):
            d = in_ptr + 2 + cap + 3 * j  # (slot's first element, req_pool_idx, position)
            src = tl.load(d, volatile=True)
            loc = tl.load(r2t_ptr + tl.load(d + 1, volatile=True) * r2t_stride + tl.load(d + 2, volatile=True))
            loc = loc.to(tl.int64) * COL
            for layer in range(LAYERS):
                k = tl.load(slots_ptr + src + (2 * layer) * COL + c, mask=cm)
                tl.store(slots_ptr + tl.load(k_off_ptr + layer) + loc + c, k, mask=cm)
                v = tl.load(slots_ptr + src + (2 * layer + 1) * COL + c, mask=cm)
                tl.store(slots_ptr + tl.load(v_off_ptr + layer) + loc + c, v, mask=cm)
    status = _fence_sys(status)  # as for the tag: every thread's repair copies are done first
    tl.debug_barrier()
    tl.store(ack_ptr + 1, status)
    tl.store(ack_ptr, _fence_sys(target.to(tl.int64)))  # the status before the target


# host time per call matters here (the scheduler thread is CPU-bound): seam.kernel_launch says why
_PUBLISH = Launcher(_publish_kernel, constexprs=1, num_warps=4)
_APPLY = Launcher(_apply_kernel, constexprs=4, num_warps=4)

_DRIVER: dict = {}  # CUDA driver entry points, loaded on first use
_VP, _U64, _UINT = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint
_SIGNATURES = {"cuStreamWaitValue64_v2": [_VP, _U64, _U64, _UINT], "cuEventCreate": [ctypes.POINTER(_VP), _UINT],
               "cuEventRecord": [_VP, _VP], "cuEventSynchronize": [_VP],
               "cuCtxGetCurrent": [ctypes.POINTER(_VP)], "cuCtxSetCurrent": [_VP]}


def _cu(name: str, *args) -> None:
    """Call a CUDA driver function; raise on an error. (ctypes drops the GIL for the call.)"""
    fn = _DRIVER.get(name)
    if fn is None:
        fn = getattr(ctypes.CDLL("libcuda.so.1"), name)
        fn.argtypes, fn.restype = _SIGNATURES[name], ctypes.c_int
        _DRIVER[name] = fn
    rc = fn(*args)
    if rc != 0:
        raise RuntimeError(f"{name} failed (CUresult {rc})")


def _stream_wait_geq(stream: int, address: int, value: int) -> None:
    """Enqueue on `stream`: wait until the 64-bit word at `address` (device-visible) is >= value."""
    _cu("cuStreamWaitValue64_v2", _VP(stream), address, value, 0)  # 0: CU_STREAM_WAIT_VALUE_GEQ


class _Mailboxes:
    """The host's side of the protocol (any thread; no CUDA call, so never blocked by the gate)."""

    def __init__(self, capacity: int, pinned: bool):
        self.capacity = capacity
        # host writes of `flag` (release, the watchdog's open): check-then-raise under this lock, so
        # the flag only grows (the device raises it past a target only once it is >= that target)
        self._flag_lock = threading.Lock()
        self.out = torch.zeros(1 + 5 * capacity, dtype=torch.float64, pin_memory=pinned)  # tag, 4 values + tag/row
        self.inbox = torch.zeros(2 + 4 * capacity, dtype=torch.int64, pin_memory=pinned)  # tag, nrep, tokens, 3/repair
        self.flag = torch.zeros(1, dtype=torch.int64, pin_memory=pinned)  # the stream waits for flag >= target
        self.ack = torch.zeros(2, dtype=torch.int64, pin_memory=pinned)  # target, status
        self._out, self._in, self._flag, self._ack = (self.out.numpy(), self.inbox.numpy(), self.flag.numpy(),
                                                      self.ack.numpy())

    def published(self, target: int, n: int) -> bool:
        """The forward's tag and each of its n rows' tags are there (then so are the values)."""
        return self._out[0] == target and bool((self._out[5:1 + 5 * n:5] == target).all())

    def values(self, n: int) -> list[list[float]]:
        """Per row: margin, fast token, position, need (0.0/1.0/2.0: module doc); after published()."""
        return self._out[1:1 + 5 * n].reshape(n, 5)[:, :4].tolist()

    def release(self, target: int, tokens: list[int], repairs: list[tuple[int, int, int]]) -> None:
        """Answer a holding gate: tokens[k] for row k, repairs (slot's first element in the slot
        buffer, req_pool_idx, position); the inbox tag, then the flag last (x86 keeps stores in
        order: the lagged seam is used on x86-64 only)."""
        cap, box = self.capacity, self._in
        box[2:2 + len(tokens)] = np.asarray(tokens, dtype=np.int64)
        for j, desc in enumerate(repairs):
            box[2 + cap + 3 * j:5 + cap + 3 * j] = desc
        box[1] = len(repairs)
        box[0] = target
        self.open(target)

    def open(self, target: int) -> None:
        """Let the stream go without an answer (the watchdog, a failed host): fast tokens,
        status 2. A no-op for a gate already answered or opened."""
        with self._flag_lock:
            if int(self._flag[0]) < target:
                self._flag[0] = target

    def acked(self, target: int) -> int | None:
        """The gate's status once applied (0 passed, 1 released, 2 opened unanswered), else None."""
        return int(self._ack[1]) if self._ack[0] == target else None

    def holding(self, target: int, n: int) -> bool:
        """Published, and some row needs the verifier: the stream waits for the host."""
        return self.published(target, n) and bool((self._out[4:1 + 5 * n:5] == 1).any())

    # The early-verify thread's wait (seam/lagged.py): the reference gate publishes inside
    # launch, so there is nothing to wait for; StepGate overrides these three.
    def watch_publish(self) -> None:
        """From now on, let wait_published() block until each launch's values are out."""

    def bind_thread(self) -> None:
        """Make the calling thread able to wait (once per thread)."""

    def wait_published(self) -> None:
        """Block (without the GIL) until the last launch's publish kernel has run."""


class StepGate(_Mailboxes):
    """The CUDA step gate (module doc). k_buffers/v_buffers: SGLang's per-layer pools, each
    [slots, Hkv, D] contiguous; slots: the verifier's slot buffer [n, L, 2, Hkv, D] (same dtype
    and device); req_to_token: [reqs, ctx] int32."""

    def __init__(self, capacity: int, k_buffers: list[Tensor], v_buffers: list[Tensor], slots: Tensor,
                 req_to_token: Tensor):
        super().__init__(capacity, pinned=True)
        col = k_buffers[0][0].numel()
        for b in (*k_buffers, *v_buffers):
            if not b.is_contiguous() or b.dtype != slots.dtype or b.device != slots.device or b[0].numel() != col:
                raise ValueError("the step gate needs contiguous pools of the slot buffer's dtype and device")
        if slots.shape[1] != len(k_buffers) or slots[0, 0, 0].numel() != col or req_to_token.stride(1) != 1:
            raise ValueError(f"slot buffer {tuple(slots.shape)} does not fit the pool")
        es, base = slots.element_size(), slots.data_ptr()
        # each layer's pool as an element offset from the slot buffer: one base pointer in the kernel
        # (UVA: one address space), no integer-to-pointer casts
        def offsets(bufs):  # [L] int64 on the device
            return torch.tensor([(b.data_ptr() - base) // es for b in bufs], dtype=torch.int64, device=slots.device)

        self.k_off, self.v_off = offsets(k_buffers), offsets(v_buffers)
        if any((b.data_ptr() - base) % es for b in (*k_buffers, *v_buffers)):
            raise ValueError("pool and slot buffer are not element-aligned")
        self.slots, self.req_to_token, self.col, self.layers = slots, req_to_token, col, len(k_buffers)
        self.slot_numel = slots[0].numel()
        self.flag_ptr, self.r2t_stride = self.flag.data_ptr(), req_to_token.stride(0)
        self._event: int | None = None  # recorded after each publish once watch_publish() ran
        self._ctx: int | None = None
        self.cb = triton.next_power_of_2(col)  # lanes of one K/V column copy
        # compile and load both kernels now: a first launch (module load) queued behind a holding
        # gate blocks the launching thread until the gate opens (measured: a deadlock when the
        # thread that would answer it is the one launching). target 0: a pass-through of one row
        def zeros(dtype):  # [1] fresh (aligned like the serving launches' tensors: same specialization)
            return torch.zeros(1, dtype=dtype, device=slots.device)

        self.launch(zeros(torch.float32), zeros(torch.int64), zeros(torch.int64), zeros(torch.int32),
                    zeros(torch.int64), 0)
        torch.cuda.synchronize(slots.device)

    def launch(self, margin: Tensor, fast: Tensor, pos: Tensor, need: Tensor, chosen: Tensor, target: int) -> None:
        """Enqueue publish, stream wait and apply on the current stream; returns at once.
        margin [n] fp32, fast [n] int64, pos [n] int64, need [n] int32 (0/1/2), chosen [n] int64
        (written), all on the device."""
        n = margin.numel()
        if n > self.capacity:
            raise ValueError(f"{n} rows exceed the gate's capacity {self.capacity}")
        if not chosen.is_contiguous():
            raise ValueError("the step gate writes `chosen` densely: pass a contiguous tensor")
        # the kernels index element k as ptr + k: a strided view (topk's indices[:, 0], measured on
        # the H100) would hand row k another row's token
        margin, fast, pos, need = (t.contiguous() for t in (margin, fast, pos, need))
        stream = current_stream(margin.device)
        _PUBLISH((1,), margin, fast, pos, need, self.out, self.flag, n, int(target), 32)
        if self._event is not None:  # between publish and the wait: it completes whatever the host answers
            _cu("cuEventRecord", _VP(self._event), _VP(stream))
        _stream_wait_geq(stream, self.flag_ptr, int(target))
        _APPLY((1,), fast, need, chosen, self.inbox, self.ack, self.slots, self.k_off, self.v_off,
               self.req_to_token, self.r2t_stride, n, self.capacity, int(target),
               self.col, self.layers, 32, self.cb)


    def watch_publish(self) -> None:
        if self._event is None:
            ctx, ev = _VP(), _VP()
            _cu("cuCtxGetCurrent", ctypes.byref(ctx))  # the constructing thread's (torch's) context
            # why blocking sync: the waiting thread sleeps (no core spun per forward); the wake-up
            # costs tens of microseconds against a verify call's milliseconds
            _cu("cuEventCreate", ctypes.byref(ev), 0x1 | 0x2)  # CU_EVENT_BLOCKING_SYNC | DISABLE_TIMING
            self._ctx, self._event = ctx.value, ev.value

    def bind_thread(self) -> None:
        _cu("cuCtxSetCurrent", _VP(self._ctx))

    def wait_published(self) -> None:
        _cu("cuEventSynchronize", _VP(self._event))


class ReferenceStepGate(_Mailboxes):
    """The same protocol on CPU tensors, synchronously (module doc): the device's part of a
    holding gate runs inside `release`. Pools and slots as StepGate's."""

    def __init__(self, capacity: int, k_buffers: list[Tensor], v_buffers: list[Tensor], slots: Tensor | None,
                 req_to_token: Tensor):
        super().__init__(capacity, pinned=False)
        self.k_buffers, self.v_buffers, self.slots, self.req_to_token = k_buffers, v_buffers, slots, req_to_token
        self.slot_numel = slots[0].numel() if slots is not None else 0
        self.held = None  # (target, need, fast, chosen) of a holding gate

    def launch(self, margin: Tensor, fast: Tensor, pos: Tensor, need: Tensor, chosen: Tensor, target: int) -> None:
        n = margin.numel()
        if n > self.capacity:
            raise ValueError(f"{n} rows exceed the gate's capacity {self.capacity}")
        vals = torch.stack([margin.double(), fast.double(), pos.double(), need.double(),
                            torch.full((n,), float(target), dtype=torch.float64)], dim=1)
        self.out[1:1 + 5 * n] = vals.reshape(-1)
        self.out[0] = target
        chosen.copy_(fast)
        if bool((need == 1).any()):
            self.held = (target, need.clone(), fast.clone(), chosen)
        else:
            self.ack[1], self.ack[0] = 0, target

    def open(self, target: int) -> None:
        super().open(target)
        if self.held is not None and self.held[0] == target and self._in[0] != target:  # unanswered
            self.held = None
            self.ack[1], self.ack[0] = 2, target

    def release(self, target: int, tokens: list[int], repairs: list[tuple[int, int, int]]) -> None:
        _Mailboxes.release(self, target, tokens, repairs)  # (its open() finds the inbox answered)
        if self.held is None or self.held[0] != target:
            return
        _, need, fast, chosen = self.held
        self.held = None
        host = torch.tensor(tokens, dtype=torch.int64)
        chosen.copy_(torch.where(need == 1, host, fast))
        flat = self.slots.reshape(-1) if self.slots is not None else None
        for src, rpi, p in repairs:
            loc = int(self.req_to_token[rpi, p])
            col = flat[src:src + self.slot_numel].view(len(self.k_buffers), 2, *self.k_buffers[0].shape[1:])
            for layer, (kb, vb) in enumerate(zip(self.k_buffers, self.v_buffers)):
                kb[loc] = col[layer, 0]
                vb[loc] = col[layer, 1]
        self.ack[1], self.ack[0] = 1, target


__all__ = ["StepGate", "ReferenceStepGate"]
