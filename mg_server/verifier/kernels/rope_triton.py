"""GPU (Triton) fused RoPE + K/V store: one launch per layer instead of eight.

The verifier's decode step is launch-bound (a few hundred small kernels in one CUDA graph), and
the torch formulation of rotate-half RoPE plus the two pool writes costs eight of them per layer
(negate, concatenate, two products, a sum, q made contiguous, two index_puts). This kernel does
the same arithmetic in one program per row.

Invariance: purely element-wise; every output element runs the same instruction sequence on
its own inputs, whatever the row count. Bits: each product and the sum round to the model
dtype, as torch's element-wise ops do, so the result equals `cpu.rope_store`'s torch formula on
the same device (checked bitwise by the GPU test). That needs FP fusion off for this kernel:
with it on, the compiler turns "round(x*cos) + round(rot*sin)" into one bf16 FMA (measured in
the PTX: fma.rn.bf16), which skips a rounding.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .config import KERNEL_CONFIG


@triton.jit
def _rope_store_kernel(qk_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, q_ptr, kl_ptr, vl_ptr,
                       s_qk_r, s_qk_h, s_v_r, s_v_h, s_tab, s_kl_s, s_kl_h, s_vl_s, s_vl_h,
                       HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr,
                       BLOCK_H: tl.constexpr, BLOCK_KV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    slot = tl.load(slot_ptr + row).to(tl.int64)
    dd = tl.arange(0, D)
    half: tl.constexpr = D // 2
    partner = (dd + half) % D  # rotate_half: [-x2, x1]
    sign = tl.where(dd < half, -1.0, 1.0)
    dt = qk_ptr.dtype.element_ty
    # cos/sin rounded to the model dtype first (HF casts the tables too)
    c = tl.load(cos_ptr + pos * s_tab + dd).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pos * s_tab + dd).to(dt).to(tl.float32)
    hh = tl.arange(0, BLOCK_H)
    h_ok = hh < HQ + HKV
    base = qk_ptr + row * s_qk_r + hh[:, None] * s_qk_h
    x = tl.load(base + dd[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32)
    xr = tl.load(base + partner[None, :], mask=h_ok[:, None], other=0.0).to(tl.float32) * sign[None, :]
    a = (x * c[None, :]).to(dt)  # why the casts: round each product, then the sum, like torch
    b = (xr * s[None, :]).to(dt)
    y = (a.to(tl.float32) + b.to(tl.float32)).to(dt)  # [BLOCK_H, D]
    is_q = hh < HQ
    tl.store(q_ptr + (row * HQ + hh[:, None]) * D + dd[None, :], y, mask=is_q[:, None])
    kh = tl.where(is_q, 0, hh - HQ)
    tl.store(kl_ptr + slot * s_kl_s + kh[:, None] * s_kl_h + dd[None, :], y, mask=(h_ok & ~is_q)[:, None])
    vh = tl.arange(0, BLOCK_KV)
    v_ok = vh < HKV
    vv = tl.load(v_ptr + row * s_v_r + vh[:, None] * s_v_h + dd[None, :], mask=v_ok[:, None], other=0.0)
    tl.store(vl_ptr + slot * s_vl_s + vh[:, None] * s_vl_h + dd[None, :], vv, mask=v_ok[:, None])


def rope_store(qk: Tensor,  # [R, Hq+Hkv, D] model dtype, cuda; any row/head stride, unit D stride
               v: Tensor,  # [R, Hkv, D] model dtype; any row/head stride, unit D stride
               cos: Tensor,  # [P, D] fp32 (the model's table)
               sin: Tensor,  # [P, D] fp32
               positions: Tensor,  # [R] int64: each row's absolute position
               slots: Tensor,  # [R] int64: the pool slot each row's K/V goes to
               k_layer: Tensor,  # [slots, Hkv, D] model dtype (one layer of the pool)
               v_layer: Tensor,  # [slots, Hkv, D]
               n_q_heads: int) -> Tensor:  # -> q after RoPE [R, Hq, D] contiguous
    r, heads, d = qk.shape
    hkv = heads - n_q_heads
    assert qk.stride(2) == 1 and v.stride(2) == 1 and d == triton.next_power_of_2(d)
    assert k_layer.stride(2) == 1 and v_layer.stride(2) == 1 and cos.stride(1) == 1
    q = torch.empty((r, n_q_heads, d), device=qk.device, dtype=qk.dtype)
    if r:
        _rope_store_kernel[(r,)](
            qk, v, cos, sin, positions, slots, q, k_layer, v_layer,
            qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0),
            k_layer.stride(0), k_layer.stride(1), v_layer.stride(0), v_layer.stride(1),
            HQ=n_q_heads, HKV=hkv, D=d, BLOCK_H=triton.next_power_of_2(heads),
            BLOCK_KV=triton.next_power_of_2(hkv), num_warps=KERNEL_CONFIG["rope"]["num_warps"],
            enable_fp_fusion=False)  # why: keep every rounding of the torch formula (see above)
    return q
