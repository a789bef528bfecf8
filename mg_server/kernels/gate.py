"""A step gate: the device publishes a forward's step values to the host and, only if some row
needs the verifier, holds its stream until the host answers through page-locked memory.

Why: mg's fast path must not wait for the GPU before sampling (a device-to-host read of the
margins there costs the overlap scheduler its CPU/GPU overlap on every deterministic forward).
And the host's answer must not be a CUDA command: CUDA orders a device or page-locked memory
allocation made anywhere in the process after all earlier work (implicit synchronization), so a
release queued on a stream can wait behind the very gate it should open. Here the host answers
with plain stores to page-locked host memory, which the kernel reads (UVA: the pointer of a
cudaHostAlloc'd buffer is valid on the device), so no CUDA call is on the release path at all.

One kernel per forward (`StepGate.launch`), one program:
  1. publish: write each row's (margin, fast token, position, needs-the-verifier, target) to
     `out` (the row's tag after a system fence by the thread that wrote its values), then
     `out[0] = target`; the host trusts the values once the forward's and every row's tag are
     there (measured: one tag after a block barrier could land before other threads' values);
  2. if no row needs the verifier: chosen = fast tokens, done;
  3. else spin on `inbox[0] == target` (the host writes its tokens, repair descriptors and then
     the tag), with a GPU-clock timeout as a last resort against a lost host;
  4. chosen[k] = the host's token for rows that needed the verifier, else the fast token; for
     each repair, copy the verifier's K/V column (slot buffer -> SGLang's per-layer pool, loc
     from req_to_token) itself, so it is ordered before every later forward on the stream;
  5. `ack = (target, status, ns held)`: status 0 passed, 1 released, 2 timed out (then the fast tokens are
     chosen and nothing is repaired; the host fails the rows that needed the verifier).
The host reads `out` after it sees the tag and writes `inbox` only then, and the next forward's
kernel is launched only after the host processed this one (lagged.py), so one set of mailboxes
is reused: no allocation per forward, which is what the implicit synchronization punishes.

`ReferenceStepGate` is the same protocol on CPU tensors, run synchronously (the device's part at
`launch`, or at `release` for a holding gate): the host logic's unit tests use it, and the GPU
tests check the kernel against it.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _now_ns(dummy):
    # %globaltimer: the GPU's nanosecond wall clock (one dummy operand: the asm needs a shape)
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,l", [dummy], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _fence_sys(x):
    # membar.sys: this thread's earlier writes are visible system-wide (the host included) before
    # its later ones, and its later reads see what others wrote before it; returns x, so a store
    # of the result cannot move before the fence
    return tl.inline_asm_elementwise("membar.sys; mov.b64 $0, $1;", "=l,l", [x], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit(do_not_specialize=["n", "cap", "target", "timeout_ns", "r2t_stride"])
def _step_gate_kernel(margin_ptr, fast_ptr, pos_ptr, need_ptr, chosen_ptr,  # [n] device
                      out_ptr, in_ptr, ack_ptr,  # page-locked host mailboxes (module doc)
                      slots_ptr, k_off_ptr, v_off_ptr, r2t_ptr, r2t_stride,
                      n, cap, target, timeout_ns,
                      COL: tl.constexpr, LAYERS: tl.constexpr, RB: tl.constexpr, CB: tl.constexpr):
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
        need_any = need_any | tl.max(nd, axis=0)
    tag = _fence_sys(target.to(tl.int64))
    tl.debug_barrier()
    tl.store(out_ptr, tag.to(tl.float64))
    released = tl.zeros((), dtype=tl.int32)
    status = tl.zeros((), dtype=tl.int64)
    held = tl.zeros((), dtype=tl.int64)
    if need_any != 0:
        v = tl.load(in_ptr, volatile=True)  # volatile: re-read host memory, never a cached copy
        t0 = _now_ns(v)
        waited = t0 - t0
        while (v != target) & (waited < timeout_ns):
            v = tl.load(in_ptr, volatile=True)
            waited = _now_ns(v) - t0
        tl.debug_barrier()
        # one verdict for all threads: released only if every lane reads the tag now (the host
        # never rewrites it before the ack, so a lane that saw it sees it again)
        seen = tl.load(in_ptr + tl.zeros([RB], dtype=tl.int32), volatile=True)
        released = tl.min((_fence_sys(seen) == target).to(tl.int32), axis=0)
        status = tl.where(released != 0, 1, 2).to(tl.int64)
        held = waited
    for s in range(0, n, RB):
        rows = s + r
        m = rows < n
        fast = tl.load(fast_ptr + rows, mask=m, other=0)
        nd = tl.load(need_ptr + rows, mask=m, other=0)
        host = tl.load(in_ptr + 2 + rows, mask=m & (nd != 0) & (released != 0), other=0, volatile=True)
        tl.store(chosen_ptr + rows, tl.where((nd != 0) & (released != 0), host, fast), mask=m)
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
    held = _fence_sys(held)  # as for the tag: every thread's repair copies are done first
    tl.debug_barrier()
    tl.store(ack_ptr + 2, held)
    tl.store(ack_ptr + 1, status)
    tl.store(ack_ptr, _fence_sys(target.to(tl.int64)))  # the status before the target


class _Mailboxes:
    """The host's side of the protocol (any thread; no CUDA call, so never blocked by the gate)."""

    def __init__(self, capacity: int, pinned: bool):
        self.capacity = capacity
        self.out = torch.zeros(1 + 5 * capacity, dtype=torch.float64, pin_memory=pinned)  # tag, 4 values + tag/row
        self.inbox = torch.zeros(2 + 4 * capacity, dtype=torch.int64, pin_memory=pinned)  # tag, nrep, tokens, 3/repair
        self.ack = torch.zeros(3, dtype=torch.int64, pin_memory=pinned)  # target, status, ns held
        self._out, self._in, self._ack = self.out.numpy(), self.inbox.numpy(), self.ack.numpy()

    def published(self, target: int, n: int) -> bool:
        """The forward's tag and each of its n rows' tags are there (then so are the values)."""
        return self._out[0] == target and bool((self._out[5:1 + 5 * n:5] == target).all())

    def values(self, n: int) -> list[list[float]]:
        """Per row: margin, fast token, position, needs the verifier (1.0/0.0); after published()."""
        return self._out[1:1 + 5 * n].reshape(n, 5)[:, :4].tolist()

    def release(self, target: int, tokens: list[int], repairs: list[tuple[int, int, int]]) -> None:
        """Answer a holding gate: tokens[k] for row k, repairs (slot's first element in the slot
        buffer, req_pool_idx, position); the tag last (x86 keeps stores in order)."""
        cap, box = self.capacity, self._in
        box[2:2 + len(tokens)] = np.asarray(tokens, dtype=np.int64)
        for j, desc in enumerate(repairs):
            box[2 + cap + 3 * j:5 + cap + 3 * j] = desc
        box[1] = len(repairs)
        box[0] = target

    def acked(self, target: int) -> int | None:
        """The gate's status once it has finished (0 passed, 1 released, 2 timed out), else None."""
        return int(self._ack[1]) if self._ack[0] == target else None


class StepGate(_Mailboxes):
    """The CUDA step gate (module doc). k_buffers/v_buffers: SGLang's per-layer pools, each
    [slots, Hkv, D] contiguous; slots: the verifier's slot buffer [n, L, 2, Hkv, D] (same dtype
    and device); req_to_token: [reqs, ctx] int32."""

    def __init__(self, capacity: int, k_buffers: list[Tensor], v_buffers: list[Tensor], slots: Tensor,
                 req_to_token: Tensor, timeout_s: float):
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
        self.timeout_ns = int(timeout_s * 1e9)

    def launch(self, margin: Tensor, fast: Tensor, pos: Tensor, need: Tensor, chosen: Tensor, target: int) -> None:
        """Enqueue the gate on the current stream; returns at once. margin [n] fp32, fast [n] int64,
        pos [n] int64, need [n] int32 (0/1), chosen [n] int64 (written), all on the device."""
        n = margin.numel()
        if n > self.capacity:
            raise ValueError(f"{n} rows exceed the gate's capacity {self.capacity}")
        _step_gate_kernel[(1,)](margin, fast, pos, need, chosen, self.out, self.inbox, self.ack,
                                self.slots, self.k_off, self.v_off, self.req_to_token, self.req_to_token.stride(0),
                                n, self.capacity, int(target), self.timeout_ns,
                                COL=self.col, LAYERS=self.layers, RB=32, CB=triton.next_power_of_2(self.col),
                                num_warps=4)


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
        if bool(need.any()):
            self.held = (target, need.clone(), fast.clone(), chosen)
        else:
            self.ack[1], self.ack[0] = 0, target

    def release(self, target: int, tokens: list[int], repairs: list[tuple[int, int, int]]) -> None:
        super().release(target, tokens, repairs)
        if self.held is None or self.held[0] != target:
            return
        _, need, fast, chosen = self.held
        self.held = None
        host = torch.tensor(tokens, dtype=torch.int64)
        chosen.copy_(torch.where(need != 0, host, fast))
        flat = self.slots.reshape(-1) if self.slots is not None else None
        for src, rpi, p in repairs:
            loc = int(self.req_to_token[rpi, p])
            col = flat[src:src + self.slot_numel].view(len(self.k_buffers), 2, *self.k_buffers[0].shape[1:])
            for layer, (kb, vb) in enumerate(zip(self.k_buffers, self.v_buffers)):
                kb[loc] = col[layer, 0]
                vb[loc] = col[layer, 1]
        self.ack[1], self.ack[0] = 1, target


__all__ = ["StepGate", "ReferenceStepGate"]
