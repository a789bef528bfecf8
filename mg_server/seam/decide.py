"""The lagged seam's per-forward step decision and token forcing, one kernel each on CUDA.

Why fused: on the H100 the seam's launch cost ~0.9 ms of host CPU per deterministic forward,
most of it ~20 small torch ops (index_select, topk, compares, casts) each paying its dispatch;
SGLang's scheduler is CPU-bound at these batch sizes, so that time lands on every request of the
batch. One program per protected row here does the gather, top-2, position check and policy.

`decide`  : for protected row k (batch row meta[k]):
              margin[k] = top1 - top2 of logits[row] in fp32, fast[k] = its lowest-index argmax
              (torch.argmax's rule and SGLang's greedy sampler's), pos[k] = positions[row],
              need[k]   = 0 unless pos == meta[n + k] (the step mg expects); then by the row's
                          mode meta[2n + k]: HOLD (0) 1 if the policy verifies it (always, or
                          not margin >= tau in fp64: Policy.should_verify's comparison; a NaN
                          margin is verified); LAZY (1, a window row, checked behind) 0;
                          BEHIND (2) 2 if the policy verifies it; MUST (3) 1. The seam sends
                          LAZY rows only (the window commit): the other modes are the removed
                          commit paths', kept with the gate's hold path and their GPU tests.
`force`   : logits[row k] = -inf everywhere but 0 at chosen[k] (any sampler then picks it).

`meta` is int64 [3n]: on CUDA it may be page-locked host memory (read through UVA, no copy).
The torch versions below are the CPU path (unit tests) and the GPU tests' reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mg_server.seam.kernel_launch import Launcher

CHUNK = 2048  # columns per step of a row walk (control values only: no output bits depend on it)
HOLD, LAZY, BEHIND, MUST = 0, 1, 2, 3  # a row's mode (meta[2n + k]; module doc)


@triton.jit(do_not_specialize=["n", "V"])
def _decide_kernel(logits_ptr, sl, V, positions_ptr, meta_ptr, tau_ptr, n,
                   margin_ptr, fast_ptr, pos_ptr, need_ptr, rows_ptr,
                   ALWAYS: tl.constexpr, CHUNK: tl.constexpr):
    k = tl.program_id(0)
    row = tl.load(meta_ptr + k)
    base = logits_ptr + row * sl
    cols0 = tl.arange(0, CHUNK)
    m = tl.full((CHUNK,), float("-inf"), tl.float32)
    ib = cols0  # per lane: the lowest column holding the lane's max so far
    for off in range(0, V, CHUNK):
        cols = off + cols0
        x = tl.load(base + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        ib = tl.where(x > m, cols, ib)  # strictly greater: an equal later value keeps the earlier column
        m = tl.maximum(m, x)
    v1 = tl.max(m, axis=0)
    i1 = tl.min(tl.where(m == v1, ib, V + CHUNK), axis=0)
    m2 = tl.full((CHUNK,), float("-inf"), tl.float32)
    for off in range(0, V, CHUNK):
        cols = off + cols0
        x = tl.load(base + cols, mask=(cols < V) & (cols != i1), other=float("-inf")).to(tl.float32)
        m2 = tl.maximum(m2, x)
    margin = v1 - tl.max(m2, axis=0)
    p = tl.load(positions_ptr + row).to(tl.int64)
    step = p == tl.load(meta_ptr + n + k)
    mode = tl.load(meta_ptr + 2 * n + k)
    if ALWAYS:
        low = step
    else:
        low = step & ~(margin.to(tl.float64) >= tl.load(tau_ptr))
    need = tl.where(mode == 3, step.to(tl.int32), tl.where(mode == 1, 0, low.to(tl.int32) * tl.where(mode == 2, 2, 1)))
    tl.store(margin_ptr + k, margin)
    tl.store(fast_ptr + k, i1.to(tl.int64))
    tl.store(pos_ptr + k, p)
    tl.store(need_ptr + k, need.to(tl.int32))
    tl.store(rows_ptr + k, row)


@triton.jit(do_not_specialize=["V"])
def _force_kernel(logits_ptr, sl, V, rows_ptr, chosen_ptr, CHUNK: tl.constexpr):
    k = tl.program_id(0)
    base = logits_ptr + tl.load(rows_ptr + k) * sl
    c = tl.load(chosen_ptr + k)
    cols0 = tl.arange(0, CHUNK)
    for off in range(0, V, CHUNK):
        cols = off + cols0
        val = tl.where(cols == c, 0.0, float("-inf")).to(logits_ptr.dtype.element_ty)
        tl.store(base + cols, val, mask=cols < V)


# host time per call matters here (the scheduler thread is CPU-bound): seam.kernel_launch says why
_DECIDE = Launcher(_decide_kernel, constexprs=2, num_warps=8)
_FORCE = Launcher(_force_kernel, constexprs=1, num_warps=4)


def decide(logits: Tensor,  # [bs, V] float, the sampler's logits (rows unit-strided)
           positions: Tensor,  # [bs] int, the forward's positions, same device
           meta: Tensor,  # [>= 3n] int64: n batch rows, n expected positions, n row modes
           tau: Tensor,  # [1] fp64 (may be page-locked host memory on CUDA)
           always: bool,
           margin: Tensor, fast: Tensor, pos: Tensor, need: Tensor,  # [n] fp32/int64/int64/int32 (0/1/2) out
           rows: Tensor,  # [n] int64 out: meta[:n] on the device, for force()
           ) -> None:
    n = margin.numel()
    if n == 0:
        return
    if logits.device.type != "cuda":
        return decide_reference(logits, positions, meta, tau, always, margin, fast, pos, need, rows)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    if not positions.is_contiguous():
        positions = positions.contiguous()
    _DECIDE((n,), logits, logits.stride(0), logits.shape[1], positions, meta, tau, n,
            margin, fast, pos, need, rows, bool(always), CHUNK)


def force(logits: Tensor, rows: Tensor, chosen: Tensor) -> None:
    """logits [bs, V] in place: row rows[k] -> one-hot (0 at chosen[k], -inf elsewhere).
    rows: decide()'s device copy (why not meta: page-locked meta is rewritten for the next forward
    once this one is published, which can be before this kernel runs)."""
    n = chosen.numel()
    if n == 0:
        return
    if logits.device.type != "cuda" or logits.stride(1) != 1:
        idx = rows[:n].to(logits.device)
        logits.index_fill_(0, idx, float("-inf"))
        logits.index_put_((idx, chosen.to(logits.device)), torch.zeros((), dtype=logits.dtype, device=logits.device))
        return
    _FORCE((n,), logits, logits.stride(0), logits.shape[1], rows, chosen, CHUNK)


def decide_reference(logits, positions, meta, tau, always, margin, fast, pos, need, rows) -> None:
    """decide() in torch ops (the CPU path; the GPU tests' reference)."""
    n = margin.numel()
    dev = logits.device
    m = meta[:3 * n].to(dev)
    idx, exp, mode = m[:n], m[n:2 * n], m[2 * n:]
    v = logits.index_select(0, idx).float()  # [n, V]
    i1 = v.argmax(dim=-1)  # ties: the first maximal index
    v1 = v.gather(1, i1[:, None])[:, 0]
    v2 = v.scatter(1, i1[:, None], float("-inf")).amax(dim=-1)
    mg = v1 - v2
    p = positions.to(dev).index_select(0, idx).to(torch.int64)
    step = p == exp
    low = (step if always else step & ~(mg.double() >= float(tau.reshape(-1)[0]))).to(torch.int32)
    nd = torch.where(mode == MUST, step.to(torch.int32), torch.where(mode == LAZY, 0, low * (1 + (mode == BEHIND))))
    margin.copy_(mg)
    fast.copy_(i1)
    pos.copy_(p)
    need.copy_(nd.to(torch.int32))
    rows.copy_(idx)


__all__ = ["decide", "force", "decide_reference", "HOLD", "LAZY", "BEHIND", "MUST"]
