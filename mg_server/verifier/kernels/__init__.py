"""Batch-invariant kernels for the MarginGate verifier.

Contract: for every op, the bits of a row's result depend only on that row's inputs (and, for
attention, on the request's keys/values up to the row's position) -- never on the number of
rows in the call, the row's position in it, the thread count, or how a sequence is chunked
into prefill pieces / decode steps.

Dispatch is by tensor device: CUDA -> Triton kernels (`matmul_triton`, `triton_ops`, `attention_triton`),
anything else -> plain-torch exact-integer implementations (`cpu`).  CPU and GPU results are
each self-consistent but NOT bit-equal to each other; `kernel_config_id(device)` names the
numerics a result came from.

Public API (shapes: M rows, K in-features, N out-features, T query tokens, S keys):
    matmul(x, w, bias=None, out_dtype=None)
                                           x [M,K] fp32/bf16, w [N,K] (or prepare_weight(w)),
                                           bias [N] -> [M,N] out_dtype (default x.dtype)
    prepare_weight(w)                      once at load: CPU -> PreparedWeight (exact-integer
                                           fp64 copy, cached per tensor), CUDA -> w.contiguous()
    rms_norm(x, weight, eps)               x [...,H] -> [...,H] x.dtype
    add_rms_norm(x, residual, weight, eps) -> (rms_norm(x+residual), x+residual)
    norm_matmul(x, residual, norm_w, eps, w, bias=None)
                                           -> (matmul(add_rms_norm(...)[0], w, bias), x+residual)
    silu_matmul(gu, w)                     gu [M,2I] (gate, up) -> matmul(silu_mul(gate, up), w)
                                           (both: one fused kernel on CUDA for 16-bit weights
                                           while KERNEL_CONFIG["fused"] says so, fused_triton;
                                           otherwise, and on CPU, the two ops: same bits as them)
    log_softmax(x, dtype=torch.float32)    x [...,V] -> [...,V] dtype
    top2(x)                                -> (values [M,2] fp32, indices [M,2] int64);
                                           ties -> lower index
    argmax(x)                              -> [M] int64 (= top2(x)[1][:, 0])
    silu_mul(gate, up)                     silu(gate) * up, element-wise (torch's CPU silu is
                                           NOT batch-invariant)
    attention(q, k, v, q_start, scale=None)
        q [T,Hq,D], k/v [S,Hkv,D] with S >= q_start+T; row t is at position q_start+t and
        attends keys 0..q_start+t (causal, GQA: q head h uses kv head h // (Hq//Hkv)).
    attention_paged(q, k_buffer, v_buffer, kv_indices, q_start, scale=None)
        k_buffer/v_buffer [slots,Hkv,D] (SGLang pool, one layer), kv_indices [>=q_start+T]
        int32/int64 slot of each position.
    attention_rows(q, k_buffer, v_buffer, kv_table, table_row, positions, max_len, scale=None)
        one query token per row r, at positions[r], over kv_table[table_row[r]]; every varying
        size is read from device memory (CUDA-graph friendly); per row equal to attention_paged.
    rope_store(qk, v, cos, sin, positions, slots, k_layer, v_layer, n_q_heads)
        qk [R,Hq+Hkv,D], v [R,Hkv,D] (strided views of the qkv projection), cos/sin [P,D] fp32
        tables; rotate-half RoPE of every head, K and V written to k_layer/v_layer[slots];
        returns q [R,Hq,D] contiguous (element-wise; one fused launch on CUDA)
    KERNEL_CONFIG, kernel_config_id(device=None)

Seeded sampling (`gumbel_rows`, `sampled_scores_rows`, `sampled_pairs` and their one-row forms,
`choice_of_pair`) is `mg_server.verifier.sampling`: the seam computes it too, and its top-2 is `top2` here.
"""
from __future__ import annotations

from mg_server import env

import torch
from torch import Tensor

from . import cpu as _cpu
from .config import KERNEL_CONFIG, kernel_config_id
from .cpu import PreparedWeight

__all__ = ["matmul", "prepare_weight", "PreparedWeight", "rms_norm", "add_rms_norm", "norm_matmul", "silu_matmul",
           "log_softmax", "top2", "argmax", "silu_mul", "attention", "attention_paged",
           "attention_rows", "rope_store", "KERNEL_CONFIG", "kernel_config_id"]

# Debug only: MG_KERNELS_BACKEND=triton sends CPU tensors to the Triton kernels (use with
# TRITON_INTERPRET=1); it is never needed in production.
_FORCE_TRITON = env.kernels_backend() == "triton"


def _gpu(t: Tensor) -> bool:
    return t.device.type == "cuda" or _FORCE_TRITON


def _tri():
    from . import triton_ops
    return triton_ops


def _mm():
    from . import matmul_triton
    return matmul_triton


def _att():
    from . import attention_triton
    return attention_triton


def prepare_weight(w: Tensor):
    """Call once per weight at model load (CPU: builds the exact-integer copy)."""
    if isinstance(w, PreparedWeight) or not _gpu(w):
        return _cpu.prepare_weight(w)
    return w.contiguous()


def matmul(x: Tensor, w, bias: Tensor | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
    if _gpu(x) and not isinstance(w, PreparedWeight):
        return _mm().matmul(x, w, bias, out_dtype)
    return _cpu.matmul(x, w, bias, out_dtype)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return (_tri() if _gpu(x) else _cpu).rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float):
    return (_tri() if _gpu(x) else _cpu).add_rms_norm(x, residual, weight, eps)


def _fused(x: Tensor, w, op: str) -> bool:
    """The fused prologue kernel serves this call: CUDA, 16-bit, and the table turns it on (a GPU
    entry, so it is part of the GPU kernel configuration id and never of the CPU one)."""
    return (_gpu(x) and not isinstance(w, PreparedWeight) and x.dtype in (torch.bfloat16, torch.float16)
            and bool(KERNEL_CONFIG["fused"][op]))


def norm_matmul(x: Tensor, residual: Tensor, norm_w: Tensor, eps: float, w, bias: Tensor | None = None):
    if _fused(x, w, "norm_matmul"):
        from . import fused_triton
        return fused_triton.norm_matmul(x, residual, norm_w, eps, w, bias)
    h, new_residual = add_rms_norm(x, residual, norm_w, eps)
    return matmul(h, w, bias), new_residual


def silu_matmul(gu: Tensor, w) -> Tensor:
    if _fused(gu, w, "silu_matmul"):
        from . import fused_triton
        return fused_triton.silu_matmul(gu, w)
    i = gu.shape[-1] // 2
    return matmul(silu_mul(gu[..., :i], gu[..., i:]), w)


def log_softmax(x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    return (_tri() if _gpu(x) else _cpu).log_softmax(x, dtype)


def top2(x: Tensor) -> tuple[Tensor, Tensor]:
    """Row-local top-2; ties are broken toward the LOWER index (both for the max and runner-up)."""
    return (_tri() if _gpu(x) else _cpu).top2(x)


def argmax(x: Tensor) -> Tensor:
    return top2(x)[1][:, 0]


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    return (_tri() if _gpu(gate) else _cpu).silu_mul(gate, up)


def rope_store(qk: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, slots: Tensor,
               k_layer: Tensor, v_layer: Tensor, n_q_heads: int) -> Tensor:
    if _gpu(qk):
        from . import rope_triton
        return rope_triton.rope_store(qk, v, cos, sin, positions, slots, k_layer, v_layer, n_q_heads)
    return _cpu.rope_store(qk, v, cos, sin, positions, slots, k_layer, v_layer, n_q_heads)


def attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, scale: float | None = None):
    return (_att() if _gpu(q) else _cpu).attention(q, k, v, q_start, scale)


def attention_paged(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, kv_indices: Tensor,
                    q_start: int, scale: float | None = None) -> Tensor:
    return (_att() if _gpu(q) else _cpu).attention_paged(q, k_buffer, v_buffer, kv_indices,
                                                         q_start, scale)


def attention_rows(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, kv_table: Tensor, table_row: Tensor,
                   positions: Tensor, max_len: int, scale: float | None = None) -> Tensor:
    if _gpu(q):
        return _att().attention_rows(q, k_buffer, v_buffer, kv_table, table_row, positions, max_len, scale)
    # CPU: no graphs to serve, so each row is simply attention_paged of its own prefix.
    rows = [_cpu.attention_paged(q[i:i + 1], k_buffer, v_buffer, kv_table[int(table_row[i])], int(positions[i]),
                                 scale) for i in range(q.shape[0])]
    return torch.cat(rows) if rows else torch.empty_like(q)
