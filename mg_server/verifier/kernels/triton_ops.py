"""GPU (Triton) batch-invariant row-wise ops: RMSNorm (+ residual add), log-softmax, top-2,
silu_mul. The matmul is in matmul_triton.py, whose docstring gives the invariance rules; here
they come down to: one program per row, the row's whole reduction in a fixed order, sizes that
vary per call `do_not_specialize`, block sizes from KERNEL_CONFIG only.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .config import KERNEL_CONFIG
from .matmul_triton import _rows

# RMSNorm (+ fused residual add): one program per row
@triton.jit
def _rms_kernel(x_ptr, r_ptr, w_ptr, y_ptr, nr_ptr, N, sx, sr, sy, snr, eps,
                HAS_RES: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols0 = tl.arange(0, CHUNK)
    acc = tl.zeros((CHUNK,), dtype=tl.float32)
    for off in range(0, N, CHUNK):  # why: fixed chunk walk + per-lane partials, M-independent
        cols = off + cols0
        ok = cols < N
        x = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0)
        if HAS_RES:
            x = (x.to(tl.float32) + tl.load(r_ptr + row * sr + cols, mask=ok, other=0.0)
                 .to(tl.float32)).to(nr_ptr.dtype.element_ty)  # residual rounds to its dtype
            tl.store(nr_ptr + row * snr + cols, x, mask=ok)
        xf = x.to(tl.float32)
        acc += xf * xf
    rstd = 1.0 / tl.sqrt_rn(tl.sum(acc, axis=0) / N + eps)
    for off in range(0, N, CHUNK):
        cols = off + cols0
        ok = cols < N
        x = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0)
        if HAS_RES:  # recompute instead of re-reading nr (no intra-program store->load hazard)
            x = (x.to(tl.float32) + tl.load(r_ptr + row * sr + cols, mask=ok, other=0.0)
                 .to(tl.float32)).to(nr_ptr.dtype.element_ty)
        h = (x.to(tl.float32) * rstd).to(y_ptr.dtype.element_ty)  # HF-Llama order
        wv = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * sy + cols, (wv * h.to(tl.float32)).to(y_ptr.dtype.element_ty),
                 mask=ok)


def _rms(x: Tensor,  # [..., H] bf16/fp32 cuda
         residual: Tensor | None,  # [..., H] x.dtype
         weight: Tensor,  # [H]
         eps: float):  # -> (y [..., H] x.dtype, x + residual [..., H] x.dtype)
    x2 = _rows(x)
    M, N = x2.shape
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    r2 = _rows(residual) if residual is not None else x2
    nr = torch.empty_like(y) if residual is not None else y
    weight = weight.contiguous()
    cfg = KERNEL_CONFIG["rowwise"]
    if M:
        _rms_kernel[(M,)](x2, r2, weight, y, nr, N, x2.stride(0), r2.stride(0), y.stride(0),
                          nr.stride(0), float(eps), HAS_RES=residual is not None,
                          CHUNK=cfg["CHUNK"], num_warps=cfg["num_warps"])
    return y.view(x.shape), nr.view(x.shape)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return _rms(x, None, weight, eps)[0]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float):
    return _rms(x, residual, weight, eps)


# ---------------------------------------------------------------------------------------------
# log-softmax and top2: one program per row, chunk walk in index order
@triton.jit
def _log_softmax_kernel(x_ptr, y_ptr, N, sx, sy, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols0 = tl.arange(0, CHUNK)
    mx = tl.full((CHUNK,), float("-inf"), tl.float32)
    for off in range(0, N, CHUNK):
        cols = off + cols0
        x = tl.load(x_ptr + row * sx + cols, mask=cols < N, other=float("-inf"))
        mx = tl.maximum(mx, x.to(tl.float32))
    m = tl.max(mx, axis=0)  # exact
    acc = tl.zeros((CHUNK,), dtype=tl.float32)
    for off in range(0, N, CHUNK):
        cols = off + cols0
        x = tl.load(x_ptr + row * sx + cols, mask=cols < N, other=float("-inf"))
        acc += tl.exp(x.to(tl.float32) - m)
    lse = m + tl.log(tl.sum(acc, axis=0))  # why: one fixed tree over CHUNK lanes
    for off in range(0, N, CHUNK):
        cols = off + cols0
        x = tl.load(x_ptr + row * sx + cols, mask=cols < N, other=0.0)
        tl.store(y_ptr + row * sy + cols, (x.to(tl.float32) - lse).to(y_ptr.dtype.element_ty),
                 mask=cols < N)


def log_softmax(x: Tensor,  # [..., V] any float dtype, cuda
                dtype: torch.dtype = torch.float32) -> Tensor:  # [..., V] dtype
    x2 = _rows(x)
    M, N = x2.shape
    y = torch.empty((M, N), device=x.device, dtype=dtype)
    cfg = KERNEL_CONFIG["rowwise"]
    if M:
        _log_softmax_kernel[(M,)](x2, y, N, x2.stride(0), y.stride(0), CHUNK=cfg["CHUNK"],
                                  num_warps=cfg["num_warps"])
    return y.view(x.shape)


@triton.jit
def _top2_kernel(x_ptr, v_ptr, i_ptr, N, sx, CHUNK: tl.constexpr):
    # Four exact passes (max, argmin-index-of-max, runner-up, its index): order-free.
    row = tl.program_id(0).to(tl.int64)
    cols0 = tl.arange(0, CHUNK)
    big = N + CHUNK
    m = tl.full((CHUNK,), float("-inf"), tl.float32)
    for off in range(0, N, CHUNK):
        cols = off + cols0
        x = tl.load(x_ptr + row * sx + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, x)
    v1 = tl.max(m, axis=0)
    ib = tl.full((CHUNK,), big, tl.int32)
    for off in range(0, N, CHUNK):
        cols = off + cols0
        x = tl.load(x_ptr + row * sx + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        ib = tl.minimum(ib, tl.where((x == v1) & (cols < N), cols, big))
    i1 = tl.min(ib, axis=0)  # ties -> lowest index
    m = tl.full((CHUNK,), float("-inf"), tl.float32)
    for off in range(0, N, CHUNK):
        cols = off + cols0
        x = tl.load(x_ptr + row * sx + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        m = tl.maximum(m, tl.where(cols == i1, float("-inf"), x))
    v2 = tl.max(m, axis=0)
    ib = tl.full((CHUNK,), big, tl.int32)
    for off in range(0, N, CHUNK):
        cols = off + cols0
        x = tl.load(x_ptr + row * sx + cols, mask=cols < N, other=float("-inf")).to(tl.float32)
        ib = tl.minimum(ib, tl.where((x == v2) & (cols < N) & (cols != i1), cols, big))
    i2 = tl.min(ib, axis=0)
    tl.store(v_ptr + row * 2, v1)
    tl.store(v_ptr + row * 2 + 1, v2)
    tl.store(i_ptr + row * 2, i1.to(tl.int64))
    tl.store(i_ptr + row * 2 + 1, i2.to(tl.int64))


def top2(x: Tensor,  # [..., V] any float dtype, cuda
         ) -> tuple[Tensor, Tensor]:  # values [M, 2] fp32, indices [M, 2] int64
    x2 = _rows(x)
    M, N = x2.shape
    vals = torch.empty((M, 2), device=x.device, dtype=torch.float32)
    idx = torch.empty((M, 2), device=x.device, dtype=torch.int64)
    cfg = KERNEL_CONFIG["rowwise"]
    if M:
        _top2_kernel[(M,)](x2, vals, idx, N, x2.stride(0), CHUNK=cfg["CHUNK"],
                           num_warps=cfg["num_warps"])
    return vals, idx


# ---------------------------------------------------------------------------------------------
# SiLU(gate) * up: element-wise, every element runs the same instruction sequence
@triton.jit
def _silu_mul_kernel(g_ptr, u_ptr, y_ptr, n, sg, su, BLOCK: tl.constexpr):
    # grid (rows, column blocks): gate/up may be column slices of one [M, 2I] matmul output
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    g = tl.load(g_ptr + row * sg + offs, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * su + offs, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty)  # HF order: silu in dtype, then *
    tl.store(y_ptr + row * n + offs, (s.to(tl.float32) * u).to(y_ptr.dtype.element_ty), mask=ok)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:  # [..., I] each, same dtype -> [..., I]
    g, u = _rows(gate), _rows(up)  # row-strided views are read in place (no copies)
    m, n = g.shape
    y = torch.empty((m, n), device=gate.device, dtype=gate.dtype)
    if m and n:
        _silu_mul_kernel[(m, triton.cdiv(n, 1024))](g, u, y, n, g.stride(0), u.stride(0), BLOCK=1024,
                                                    num_warps=4)
    return y.view(gate.shape)
