"""Copies done by a kernel, never by a CUDA copy engine: page-locked host <-> device, device <-> device.

Why: written when the verifier could run as a thread of SGLang's scheduler process (a placement
since removed), where its copies shared the process's copy-engine queues with SGLang's and
waited behind a forward held by mg's step gate (measured on an H200: until the verify call timed
out). A kernel reads and writes page-locked host memory directly (UVA: a cudaHostAlloc'd
buffer's pointer is valid on the device, as the step gate's mailboxes use it), so it depends on
nothing but its own stream; kept, as the verifier's graphs are built on it. The data is small (a
verify call's inputs, its margins, K/V columns).

Bits: a plain load and store of each element; the caller passes tensors of one dtype and size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

BLOCK = 1024  # elements per program


# why do_not_specialize: one compiled kernel per word type, whatever the sizes and alignments, so a
# warm-up can load them all (a kernel's first launch loads its module, which waits for a held
# stream like an allocation: measured 9 s behind a held stream on an H200)
@triton.jit(do_not_specialize=["src_ptr", "dst_ptr", "n"])
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=mask), mask=mask)


def copy_(src: Tensor, dst: Tensor) -> Tensor:
    """dst[...] = src[...] by a kernel on the current stream (see module doc). Both contiguous, of
    one dtype and size; either may be page-locked host memory, at least one is on the GPU."""
    if src.dtype != dst.dtype or src.numel() != dst.numel():
        raise ValueError(f"copy_: {src.dtype}[{src.numel()}] into {dst.dtype}[{dst.numel()}]")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("copy_: both tensors must be contiguous")
    if src.is_cuda == dst.is_cuda and not src.is_cuda:
        raise ValueError("copy_: one tensor must be on the GPU")
    for t in (src, dst):
        if not t.is_cuda and not t.is_pinned():
            raise ValueError("copy_: a host tensor must be page-locked (pin_memory)")
    nbytes = src.numel() * src.element_size()
    if nbytes:
        # why int32 words: a copy moves bits (integer loads and stores cannot canonicalise a NaN),
        # and one word type for every dtype whose size allows it means one kernel to warm up
        word = torch.int32 if nbytes % 4 == 0 else torch.int8
        s, d = src.reshape(-1).view(torch.uint8).view(word), dst.reshape(-1).view(torch.uint8).view(word)
        _copy_kernel[(triton.cdiv(s.numel(), BLOCK),)](s, d, s.numel(), BLOCK=BLOCK)
    return dst


def warm_up(device: torch.device) -> None:
    """Load every kernel `copy_` can launch (see _copy_kernel) before anything can hold a stream."""
    for n in (4, 3):  # int32 words, int8 bytes
        a = torch.zeros(n, dtype=torch.int8, device=device)
        copy_(a, torch.empty_like(a))
