"""The step publisher: the device hands a forward's step values to the host without a host sync.

Why: mg's fast path must not wait for the GPU before sampling (a device-to-host read of the
margins there costs the overlap scheduler its CPU/GPU overlap on every deterministic forward).
Per forward (`StepPublisher.launch`), one kernel on the sampler's stream writes each row's
(margin, fast token, position, need, target) to page-locked host memory (UVA: the pointer of a
cudaHostAlloc'd buffer is valid on the device), the row's tag after a system fence by the thread
that wrote its values, then the forward's tag; the host trusts the values once the forward's and
every row's tag are there (measured: one tag after a block barrier could land before other
threads' values). The host (seam/lagged.py) reads them one forward later and sends the next
forward's kernels only after it processed this one, so one mailbox is reused: no allocation per
forward (CUDA orders a page-locked allocation after all earlier work).

Nothing waits for the host: every row is a window row (committed with its fast token, checked
behind), so the sampler's tokens are the fast ones. (A hold path, in which the stream waited for
the host's tokens and repair copies, served the removed commit paths: docs/history/commit-paths.md.)

`ReferencePublisher` is the same on CPU tensors: the host logic's unit tests use it, and the GPU
test checks the kernel against it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mg_server.seam.kernel_launch import Launcher


@triton.jit
def _fence_sys(x):
    # membar.sys: this thread's earlier writes are visible system-wide (the host included) before
    # its later ones, and its later reads see what others wrote before it; returns x, so a store
    # of the result cannot move before the fence
    return tl.inline_asm_elementwise("membar.sys; mov.b64 $0, $1;", "=l,l", [x], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit(do_not_specialize=["n", "target"])
def _publish_kernel(margin_ptr, fast_ptr, pos_ptr, need_ptr,  # [n] device
                    out_ptr,  # page-locked host memory (module doc)
                    n, target, RB: tl.constexpr):
    r = tl.arange(0, RB)
    for s in range(0, n, RB):
        rows = s + r
        m = rows < n
        base = out_ptr + 1 + 5 * rows
        tl.store(base, tl.load(margin_ptr + rows, mask=m, other=0.0).to(tl.float64), mask=m)
        tl.store(base + 1, tl.load(fast_ptr + rows, mask=m, other=0).to(tl.float64), mask=m)
        tl.store(base + 2, tl.load(pos_ptr + rows, mask=m, other=0).to(tl.float64), mask=m)
        tl.store(base + 3, tl.load(need_ptr + rows, mask=m, other=0).to(tl.float64), mask=m)
        # each row's own tag, stored by the thread that stored its values, after a system fence:
        # the host trusts a row only once its tag is there (no ordering across threads assumed)
        rtag = _fence_sys(tl.zeros([RB], dtype=tl.int64) + target)
        tl.store(base + 4, rtag.to(tl.float64), mask=m)
    tag = _fence_sys(target.to(tl.int64))
    tl.debug_barrier()
    tl.store(out_ptr, tag.to(tl.float64))


# host time per call matters here (the scheduler thread is CPU-bound): seam.kernel_launch says why
_PUBLISH = Launcher(_publish_kernel, constexprs=1, num_warps=4)


class _Mailbox:
    """The host's side (any thread; no CUDA call)."""

    def __init__(self, capacity: int, pinned: bool):
        self.capacity = capacity
        self.out = torch.zeros(1 + 5 * capacity, dtype=torch.float64, pin_memory=pinned)  # tag, 4 values + tag/row
        self._out = self.out.numpy()

    def published(self, target: int, n: int) -> bool:
        """The forward's tag and each of its n rows' tags are there (then so are the values)."""
        return self._out[0] == target and bool((self._out[5:1 + 5 * n:5] == target).all())

    def values(self, n: int) -> list[list[float]]:
        """Per row: margin, fast token, position, need; after published()."""
        return self._out[1:1 + 5 * n].reshape(n, 5)[:, :4].tolist()

    def _check(self, margin: Tensor) -> int:
        n = margin.numel()
        if n > self.capacity:
            raise ValueError(f"{n} rows exceed the publisher's capacity {self.capacity}")
        return n


class StepPublisher(_Mailbox):
    """The CUDA publisher (module doc), for forwards of at most `capacity` rows on `device`."""

    def __init__(self, capacity: int, device: torch.device):
        super().__init__(capacity, pinned=True)
        # compile and load the kernel now, not at a serving forward (target 0: one row)
        zeros = [torch.zeros(1, dtype=d, device=device) for d in (torch.float32, torch.int64, torch.int64, torch.int32)]
        self.launch(*zeros, 0)
        torch.cuda.synchronize(device)

    def launch(self, margin: Tensor, fast: Tensor, pos: Tensor, need: Tensor, target: int) -> None:
        """Enqueue the publish on the current stream; returns at once. margin [n] fp32, fast [n]
        int64, pos [n] int64, need [n] int32, on the device."""
        n = self._check(margin)
        # the kernel indexes element k as ptr + k: a strided view (topk's indices[:, 0], measured on
        # the H100) would hand row k another row's token
        margin, fast, pos, need = (t.contiguous() for t in (margin, fast, pos, need))
        _PUBLISH((1,), margin, fast, pos, need, self.out, n, int(target), 32)


class ReferencePublisher(_Mailbox):
    """The same on CPU tensors, synchronously (module doc)."""

    def __init__(self, capacity: int):
        super().__init__(capacity, pinned=False)

    def launch(self, margin: Tensor, fast: Tensor, pos: Tensor, need: Tensor, target: int) -> None:
        n = self._check(margin)
        vals = torch.stack([margin.double(), fast.double(), pos.double(), need.double(),
                            torch.full((n,), float(target), dtype=torch.float64)], dim=1)
        self.out[1:1 + 5 * n] = vals.reshape(-1)
        self.out[0] = target


__all__ = ["StepPublisher", "ReferencePublisher"]
