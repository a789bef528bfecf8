"""GPU (Triton) matmuls with an element-wise prologue on their input: the verifier's RMSNorm and
SiLU*up run inside the next projection instead of as kernels of their own.

Why: the verifier's decode forward is a chain of ~310 small, latency-bound kernels (on the H100
at 17 rows, SmolLM2: 1.16 ms of kernels, 1.45 ms of forward); 60 RMSNorms and 30 SiLUs are
~0.15 ms of it plus a launch gap each. Fused, a layer runs 7 kernels instead of 10.

    norm_matmul(x, residual, norm_w, eps, w, bias=None) -> (y [M, N], x + residual [M, K])
        y = rms_norm(x + residual) * norm_w @ w.T (+ bias)
    silu_matmul(gu, w) -> y [M, N]         gu [M, 2K] (gate columns, then up): silu(gate) * up @ w.T

Invariance (matmul_triton's rules): the tile shape comes from config.matmul_tile (it may follow
M; no element's sum depends on it), a row's sum of squares is walked by one program over K in
BLOCK_K steps, ascending, and the product's K loop is the plain matmul's. Each column tile
recomputes its rows' norm (identical code, identical bits) rather than sharing it. The prologue's
element formulas are triton_ops' (HF order); the norm's sum of squares is not the row-wise
kernel's tree, so the bits may differ from the unfused ops' (they were equal on every shape
the fused benchmark measured on the H100, which is not relied on): KERNEL_CONFIG["fused"] is hashed into
the GPU kernel configuration id.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .config import KERNEL_CONFIG, matmul_tile
from .matmul_triton import _TL_DTYPE, _rows, _tile_coords, _tma_ok


@triton.jit(do_not_specialize=["M"])
def _prologue_matmul_kernel(x_ptr, r_ptr, g_ptr, w_ptr, b_ptr, y_ptr, nr_ptr, M, N, K,
                            sxm, srm, snm, swn, sym, eps,
                            SILU: tl.constexpr, HAS_BIAS: tl.constexpr, TMA_W: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr):
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    dt = y_ptr.dtype.element_ty
    if not SILU:
        # why: the row's sum of squares by this one program, K ascending in BLOCK_K pieces, each
        # piece summed by one fixed tree: the same walk for every M and every column tile
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            ok = m_ok[:, None] & (kk < K)[None, :]
            s = (tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=ok, other=0.0).to(tl.float32)
                 + tl.load(r_ptr + rm[:, None] * srm + kk[None, :], mask=ok, other=0.0).to(tl.float32)).to(dt)
            if pid_n == 0:  # one column tile writes the new residual (nobody here reads it)
                tl.store(nr_ptr + rm[:, None] * snm + kk[None, :], s, mask=ok)
            sf = s.to(tl.float32)
            ss += tl.sum(sf * sf, axis=1)
        rstd = 1.0 / tl.sqrt_rn(ss / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # why: the plain matmul's one reduction order, K ascending
        kk = k0 + rk
        k_ok = kk < K
        ok = m_ok[:, None] & k_ok[None, :]
        if SILU:
            g = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=ok, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + rm[:, None] * sxm + (K + kk)[None, :], mask=ok, other=0.0).to(tl.float32)
            a = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt)  # triton_ops.silu_mul's order
        else:
            s = (tl.load(x_ptr + rm[:, None] * sxm + kk[None, :], mask=ok, other=0.0).to(tl.float32)
                 + tl.load(r_ptr + rm[:, None] * srm + kk[None, :], mask=ok, other=0.0).to(tl.float32)).to(dt)
            h = (s.to(tl.float32) * rstd[:, None]).to(dt)  # triton_ops' RMSNorm order
            gw = tl.load(g_ptr + kk, mask=k_ok, other=0.0).to(tl.float32)
            a = (gw[None, :] * h.to(tl.float32)).to(dt)
        if TMA_W:  # w_ptr is a TMA descriptor of w [N, K] (out-of-bounds reads 0): same values
            acc = tl.dot(a, w_ptr.load([pid_n * BLOCK_N, k0]).T, acc)
        else:
            b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :], acc.to(dt), mask=m_ok[:, None] & n_ok[None, :])


def _launch(x2: Tensor, r2: Tensor | None, g: Tensor | None, w: Tensor, bias: Tensor | None, eps: float,
            k: int, silu: bool, tma: bool | None = None) -> tuple[Tensor, Tensor | None]:
    m, n = x2.shape[0], w.shape[0]
    assert w.shape[1] == k and w.dtype == x2.dtype and x2.dtype in (torch.bfloat16, torch.float16), (
        x2.shape, x2.dtype, w.shape, w.dtype)
    y = torch.empty((m, n), device=x2.device, dtype=x2.dtype)  # [M, N] x dtype
    nr = None if silu else torch.empty((m, k), device=x2.device, dtype=x2.dtype)  # [M, K] new residual
    if m == 0:
        return y, nr
    cfg = matmul_tile(_TL_DTYPE[x2.dtype], m, n, k, False)
    wc = w if w.stride(1) == 1 else w.contiguous()
    tma = KERNEL_CONFIG["fused"]["tma"] if tma is None else tma
    # TMA: a property of the weight's shape and storage only, never of M (matmul_triton._tma_ok)
    tma = (tma and x2.device.type == "cuda" and _tma_ok(n, k, x2.dtype) and wc.is_contiguous()
           and wc.data_ptr() % 16 == 0)
    if tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        wc = TensorDescriptor.from_tensor(wc, [cfg["BLOCK_N"], cfg["BLOCK_K"]])
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    _prologue_matmul_kernel[grid](
        x2, r2 if r2 is not None else x2, g if g is not None else y, wc, bias if bias is not None else y, y,
        nr if nr is not None else y, m, n, k,
        x2.stride(0), r2.stride(0) if r2 is not None else 0, nr.stride(0) if nr is not None else 0,
        w.stride(0), y.stride(0), float(eps),
        SILU=silu, HAS_BIAS=bias is not None, TMA_W=tma, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"], num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y, nr


def norm_matmul(x: Tensor,  # [M, K] bf16/fp16 cuda (rows may be strided)
                residual: Tensor,  # [M, K] x.dtype
                norm_w: Tensor,  # [K] the RMSNorm weight
                eps: float,
                w: Tensor,  # [N, K] x.dtype
                bias: Tensor | None = None,  # [N], added in fp32
                tma: bool | None = None,  # the weight by TMA (None: the table's; the fused benchmark compares)
                ) -> tuple[Tensor, Tensor]:  # (y [M, N] x.dtype, x + residual [M, K] x.dtype)
    x2, r2 = _rows(x), _rows(residual)
    return _launch(x2, r2, norm_w.contiguous(), w, bias, eps, x2.shape[1], silu=False, tma=tma)


def silu_matmul(gu: Tensor,  # [M, 2K] bf16/fp16 cuda: gate columns [0, K), up columns [K, 2K)
                w: Tensor,  # [N, K]
                tma: bool | None = None,
                ) -> Tensor:  # [M, N] gu.dtype
    g2 = _rows(gu)
    return _launch(g2, None, None, w, None, 0.0, g2.shape[1] // 2, silu=True, tma=tma)[0]
