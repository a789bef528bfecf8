"""GPU (Triton) causal GQA attention with a fixed KV split size and a fixed-order merge.

One code path for prefill (T > 1) and decode (T == 1):
1. `_attn_split_kernel`, grid (row blocks, kv heads, splits): for split j it reduces keys
   [j*KV_SPLIT, (j+1)*KV_SPLIT) in BLOCK_N steps, in order, with an online softmax started
   fresh at the split, and writes the partial (m, l, acc[D]) of every row in fp32.
2. `_attn_merge_kernel`, one program per (token, q head): merges that row's splits
   0 .. pos // KV_SPLIT in increasing order, then divides.

Why a row's bits do not depend on T, q_start chunking or decode vs prefill:
* split boundaries are absolute multiples of KV_SPLIT, sub-blocks are aligned to them;
* the set of splits a row merges depends on its absolute position only;
* keys the row cannot see (causal, or beyond the keys present) get p == 0 exactly, and a fully
  masked sub-block leaves (m, l, acc) bit-identical (alpha == exp2(0) == 1, p == 0);
* each MMA output element's accumulation does not depend on which tile row holds it, and the
  tile shapes / instruction choice come from KERNEL_CONFIG only (sizes are do_not_specialize).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .config import KERNEL_CONFIG

_PARTIAL_BUDGET = 1 << 29  # bytes of fp32 partials per launch; only bounds memory, not bits


@triton.jit
def _split_reduce(q, k_ptr, v_ptr, idx_ptr, pos, kvh, split0, split_end, qk_scale, sks, skh, svs, svh,
                  D: tl.constexpr, PAGED: tl.constexpr, PREC: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(m, l, acc) of one split for a tile of query rows q [BLOCK_M, D] at positions pos
    [BLOCK_M]: keys split0 .. split_end-1 in BLOCK_N steps, online softmax from scratch."""
    dd = tl.arange(0, D)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for n0 in range(split0, split_end, BLOCK_N):  # why: fixed, aligned, ascending sub-blocks
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < split_end
        if PAGED:
            slot = tl.load(idx_ptr + n, mask=n_ok, other=0).to(tl.int64)
        else:
            slot = n.to(tl.int64)
        k = tl.load(k_ptr + slot[:, None] * sks + kvh * skh + dd[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(v_ptr + slot[:, None] * svs + kvh * svh + dd[None, :], mask=n_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        vis = (n[None, :] <= pos[:, None]) & n_ok[None, :]
        s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.where(vis, tl.exp2(s - m_safe[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PREC)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=["T", "q_start", "s_eff"])
def _attn_split_kernel(q_ptr, k_ptr, v_ptr, idx_ptr, m_ptr, l_ptr, o_ptr,
                       T, q_start, s_eff, sm_scale,
                       sqt, sqh, sks, skh, svs, svh,
                       NS, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                       PAGED: tl.constexpr, KV_SPLIT: tl.constexpr, PREC: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rb = tl.program_id(0)
    kvh = tl.program_id(1)
    j = tl.program_id(2)
    r = rb * BLOCK_M + tl.arange(0, BLOCK_M)  # row = token * G + (q head within the group)
    r_ok = r < T * G
    tok = r // G
    head = kvh * G + r % G
    pos = q_start + tok  # absolute position of each row
    split0 = j * KV_SPLIT
    last_pos = q_start + (tl.minimum((rb + 1) * BLOCK_M, T * G) - 1) // G
    if split0 <= last_pos:  # some row of this block sees this split
        dd = tl.arange(0, D)
        q = tl.load(q_ptr + tok[:, None].to(tl.int64) * sqt + head[:, None] * sqh + dd[None, :],
                    mask=r_ok[:, None], other=0.0)
        split_end = tl.minimum(split0 + KV_SPLIT, s_eff)
        m_i, l_i, acc = _split_reduce(q, k_ptr, v_ptr, idx_ptr, pos, kvh, split0, split_end,
                                      sm_scale * 1.4426950408889634, sks, skh, svs, svh,
                                      D, PAGED, PREC, BLOCK_M, BLOCK_N)
        out_row = (tok.to(tl.int64) * HQ + head) * NS + j
        tl.store(m_ptr + out_row, m_i, mask=r_ok)
        tl.store(l_ptr + out_row, l_i, mask=r_ok)
        tl.store(o_ptr + out_row[:, None] * D + dd[None, :], acc, mask=r_ok[:, None])


@triton.jit
def _merge_row(m_ptr, l_ptr, o_ptr, out_ptr, base, n_splits, D: tl.constexpr):
    """Merge splits 0 .. n_splits-1 of one (token, head) row in increasing order and store it."""
    dd = tl.arange(0, D)
    m = tl.load(m_ptr + base)
    l = tl.load(l_ptr + base)
    acc = tl.load(o_ptr + base * D + dd)
    for j in range(1, n_splits):  # fixed order: split 0, 1, 2, ...
        mj = tl.load(m_ptr + base + j)
        lj = tl.load(l_ptr + base + j)
        oj = tl.load(o_ptr + (base + j) * D + dd)
        m_new = tl.maximum(m, mj)
        a = tl.exp2(m - m_new)
        b = tl.exp2(mj - m_new)
        l = l * a + lj * b
        acc = acc * a + oj * b
        m = m_new
    tl.store(out_ptr + dd, (acc / l).to(out_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["q_start"])
def _attn_merge_kernel(m_ptr, l_ptr, o_ptr, out_ptr, q_start, sot, soh, NS,
                       HQ: tl.constexpr, D: tl.constexpr, KV_SPLIT: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    n_splits = (q_start + t) // KV_SPLIT + 1  # why: depends on the absolute position only
    _merge_row(m_ptr, l_ptr, o_ptr, out_ptr + t.to(tl.int64) * sot + h * soh, (t.to(tl.int64) * HQ + h) * NS,
               n_splits, D)


def _attention(q: Tensor,  # [T, Hq, D] bf16/fp32 cuda, D a power of two
               k: Tensor,  # [S or slots, Hkv, D] q.dtype, unit stride on D
               v: Tensor,  # [S or slots, Hkv, D] q.dtype
               kv_indices: Tensor | None,  # [>= q_start+T] int32/int64 slot per position
               q_start: int,  # absolute position of q[0]
               scale: float | None) -> Tensor:  # [T, Hq, D] q.dtype
    T, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    assert hq == g * hkv and d == triton.next_power_of_2(d) and k.stride(2) == 1
    assert k.dtype == q.dtype == v.dtype and v.stride(2) == 1
    q = q if q.stride(2) == 1 else q.contiguous()
    cfg = KERNEL_CONFIG["attention"]
    ksplit = cfg["KV_SPLIT"]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.empty((T, hq, d), device=q.device, dtype=q.dtype)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    idx = kv_indices if kv_indices is not None else out  # dummy pointer when not paged
    # Query tokens are processed in chunks only to bound the partial buffers; by the invariance
    # argument above, a chunk is just a call with a later q_start.
    ns_max = triton.cdiv(q_start + T, ksplit)
    step = max(1, _PARTIAL_BUDGET // (hq * ns_max * (d + 2) * 4))
    for t0 in range(0, T, step):
        tc = min(step, T - t0)
        qs = q_start + t0
        s_eff = qs + tc
        ns = triton.cdiv(s_eff, ksplit)
        m_buf = torch.empty((tc, hq, ns), device=q.device, dtype=torch.float32)
        l_buf = torch.empty_like(m_buf)
        o_buf = torch.empty((tc, hq, ns, d), device=q.device, dtype=torch.float32)
        qc = q[t0:t0 + tc]
        grid = (triton.cdiv(tc * g, cfg["BLOCK_M"]), hkv, ns)
        _attn_split_kernel[grid](
            qc, k, v, idx, m_buf, l_buf, o_buf, tc, qs, s_eff, scale,
            qc.stride(0), qc.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            ns, HQ=hq, G=g, D=d, PAGED=kv_indices is not None, KV_SPLIT=ksplit, PREC=prec,
            BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        oc = out[t0:t0 + tc]
        _attn_merge_kernel[(tc, hq)](m_buf, l_buf, o_buf, oc, qs, oc.stride(0), oc.stride(1),
                                     ns, HQ=hq, D=d, KV_SPLIT=ksplit,
                                     num_warps=cfg["MERGE_num_warps"])
    return out


def attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, scale: float | None = None):
    assert k.shape[0] >= q_start + q.shape[0]
    return _attention(q, k, v, None, int(q_start), scale)


def attention_paged(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, kv_indices: Tensor,
                    q_start: int, scale: float | None = None) -> Tensor:
    assert kv_indices.shape[0] >= q_start + q.shape[0]
    return _attention(q, k_buffer, v_buffer, kv_indices.contiguous(), int(q_start), scale)


# ---------------------------------------------------------------------------------------------
# Row-wise paged attention for CUDA graphs: every size that varies from step to step (a row's
# position, its request's slot table) is read from device memory, so one captured launch
# serves any rows. A row's splits, sub-blocks, masks and merge order are those of `_attention`,
# so its bits equal that row's bits there (a row's result does not depend on which tile row
# holds it or which other rows share the tile, the invariance the prefill/decode tests check).
@triton.jit
def _merge_into(m, l_s, acc, m_j, l_j, acc_j, keep):
    """`_merge_row`'s step for a tile of rows held in registers: split j's (m_j, l_j, acc_j)
    merged into the running (m, l_s, acc) where `keep`, the same fp32 operations in the same
    order as the merge kernel's (so the same bits); the other rows unchanged."""
    m_new = tl.maximum(m, m_j)
    a = tl.exp2(m - m_new)
    b = tl.exp2(m_j - m_new)
    l_s = tl.where(keep, l_s * a + l_j * b, l_s)
    acc = tl.where(keep[:, None], acc * a[:, None] + acc_j * b[:, None], acc)
    return tl.where(keep, m_new, m), l_s, acc


@triton.jit(do_not_specialize=["R", "n_blocks", "n_pairs"])
def _attn_rows_split_kernel(q_ptr, k_ptr, v_ptr, tab_ptr, trow_ptr, pos_ptr, m_ptr, l_ptr, o_ptr, out_ptr,
                            R, n_blocks, n_pairs, sm_scale, sqt, sqh, sks, skh, svs, svh, stab, sot, soh,
                            NS, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                            KV_SPLIT: tl.constexpr, SPLIT_PAR: tl.constexpr, PREC: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The rows in blocks of S = BLOCK_M // G consecutive tokens (a tile row per (token, q head));
    a segment is a run of a block's consecutive tokens of one request (one kv_table row): a
    window's rows share each split's K/V tiles, a decode row of many requests gets a program of
    its own. Work item (k, b) is block b's k-th segment, in k-major order (every block's first
    segment first); program p takes items p, p + P, ... and splits jp, jp + SPLIT_PAR, ... of it.
    SPLIT_PAR 1: one program walks all of a segment's splits, so it merges them in registers as
    it goes (split 0, 1, 2, ...: the merge kernel's order and arithmetic) and writes the output
    itself, with no fp32 partials (their size follows max_len: at a 128k context they bounded a
    launch to ~60 rows). SPLIT_PAR > 1: partials, merged by `_attn_rows_merge_kernel`.
    why the grid does not follow max_len: splits past the segment's last position are never
    launched, so a long served context costs no idle programs."""
    S: tl.constexpr = BLOCK_M // G
    kvh = tl.program_id(1)
    jp = tl.program_id(2)
    i = tl.arange(0, BLOCK_M)  # tile row = token in block * G + q head within the group
    t_in = i // G
    head = kvh * G + i % G
    dd = tl.arange(0, D)
    qk_scale = sm_scale * 1.4426950408889634
    for item in range(tl.program_id(0), n_pairs, tl.num_programs(0)):
        b = item % n_blocks
        tok = b * S + t_in
        ok = (t_in < S) & (tok < R)
        tok = tl.where(ok, tok, 0)
        trow = tl.load(trow_ptr + tok, mask=ok, other=-1).to(tl.int64)  # [BLOCK_M] kv_table rows
        prev = tl.load(trow_ptr + tok - 1, mask=ok & (t_in > 0), other=-1).to(tl.int64)
        first = ok & (i % G == 0) & ((t_in == 0) | (trow != prev))  # a segment's first token
        mine = ok & (tl.cumsum(first.to(tl.int32), axis=0) - 1 == item // n_blocks)
        if tl.max(mine.to(tl.int32), axis=0) > 0:
            pos = tl.where(mine, tl.load(pos_ptr + tok, mask=mine, other=-1).to(tl.int64), -1)  # -1: no key
            last = tl.max(pos, axis=0)
            tab = tab_ptr + tl.max(tl.where(mine, trow, 0), axis=0) * stab  # the segment's slot table
            q = tl.load(q_ptr + tok[:, None].to(tl.int64) * sqt + head[:, None] * sqh + dd[None, :],
                        mask=mine[:, None], other=0.0)
            if SPLIT_PAR == 1:
                # split 0 (every row sees it) starts the merge, as in the merge kernel
                # why the split ends at the segment's last position + 1: a prefill chunk's rule
                m_r, l_r, acc_r = _split_reduce(q, k_ptr, v_ptr, tab, pos, kvh, 0, tl.minimum(KV_SPLIT, last + 1),
                                                qk_scale, sks, skh, svs, svh, D, True, PREC, BLOCK_M, BLOCK_N)
                for j in range(1, last // KV_SPLIT + 1):
                    split0 = j * KV_SPLIT
                    m_j, l_j, acc_j = _split_reduce(q, k_ptr, v_ptr, tab, pos, kvh, split0,
                                                    tl.minimum(split0 + KV_SPLIT, last + 1), qk_scale,
                                                    sks, skh, svs, svh, D, True, PREC, BLOCK_M, BLOCK_N)
                    m_r, l_r, acc_r = _merge_into(m_r, l_r, acc_r, m_j, l_j, acc_j, mine & (pos >= split0))
                o = out_ptr + tok[:, None].to(tl.int64) * sot + head[:, None] * soh + dd[None, :]
                tl.store(o, (acc_r / l_r[:, None]).to(out_ptr.dtype.element_ty), mask=mine[:, None])
            else:
                out_row = (tok.to(tl.int64) * HQ + head) * NS
                for j in range(jp, last // KV_SPLIT + 1, SPLIT_PAR):
                    split0 = j * KV_SPLIT
                    m_i, l_i, acc = _split_reduce(q, k_ptr, v_ptr, tab, pos, kvh, split0,
                                                  tl.minimum(split0 + KV_SPLIT, last + 1), qk_scale,
                                                  sks, skh, svs, svh, D, True, PREC, BLOCK_M, BLOCK_N)
                    keep = mine & (pos >= split0)  # the rows that see this split
                    tl.store(m_ptr + out_row + j, m_i, mask=keep)
                    tl.store(l_ptr + out_row + j, l_i, mask=keep)
                    tl.store(o_ptr + (out_row + j)[:, None] * D + dd[None, :], acc, mask=keep[:, None])


@triton.jit
def _attn_rows_merge_kernel(m_ptr, l_ptr, o_ptr, out_ptr, pos_ptr, sot, soh, NS,
                            HQ: tl.constexpr, D: tl.constexpr, KV_SPLIT: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    n_splits = tl.load(pos_ptr + t) // KV_SPLIT + 1  # why: the absolute position only, as above
    _merge_row(m_ptr, l_ptr, o_ptr, out_ptr + t.to(tl.int64) * sot + h * soh, (t.to(tl.int64) * HQ + h) * NS,
               n_splits, D)


def attention_rows(q: Tensor,  # [R, Hq, D] bf16/fp32 cuda: one query token per row
                   k_buffer: Tensor,  # [slots, Hkv, D] q.dtype (one layer of the pool)
                   v_buffer: Tensor,  # [slots, Hkv, D] q.dtype
                   kv_table: Tensor,  # [tables, L] int32/int64: slot of each position, per request
                   table_row: Tensor,  # [R] int: the kv_table row of each query row
                   positions: Tensor,  # [R] int: absolute position of each query row (< L)
                   max_len: int,  # upper bound of position + 1 (sizes the partial buffers)
                   scale: float | None = None) -> Tensor:  # [R, Hq, D] q.dtype
    """Per row equal to attention_paged of its own prefix, for any rows in any order (a request's
    consecutive rows share K/V tiles)."""
    R, hq, d = q.shape
    hkv = k_buffer.shape[1]
    g = hq // hkv
    cfg = KERNEL_CONFIG["attention"]
    assert hq == g * hkv and g <= cfg["BLOCK_M"] and d == triton.next_power_of_2(d)
    assert k_buffer.stride(2) == 1 and v_buffer.stride(2) == 1 and kv_table.stride(1) == 1
    q = q if q.stride(2) == 1 else q.contiguous()
    ksplit, s_tok = cfg["KV_SPLIT"], cfg["BLOCK_M"] // g  # s_tok: tokens per block
    ns = triton.cdiv(max_len, ksplit)  # partials per row; the merge reads 0 .. position // KV_SPLIT
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    out = torch.empty((R, hq, d), device=q.device, dtype=q.dtype)
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    split_par = [n for rows, n in cfg["SPLIT_PAR"] if R >= rows][-1]
    if split_par == 1:  # merged in registers: no partials (the kernel's stores to them are not compiled)
        step, m_buf = R, out
        l_buf = o_buf = out
    else:  # fp32 partials, in row chunks only to bound their memory (rows are independent: no bits change)
        step = max(1, _PARTIAL_BUDGET // (hq * ns * (d + 2) * 4))
        rc = min(R, step)
        m_buf = torch.empty((rc, hq, ns), device=q.device, dtype=torch.float32)  # [rows, Hq, splits] running max
        l_buf = torch.empty_like(m_buf)  # [rows, Hq, splits] fp32 softmax sums
        o_buf = torch.empty((rc, hq, ns, d), device=q.device, dtype=torch.float32)  # [rows, Hq, splits, D] fp32
    for t0 in range(0, R, step):
        tc = min(step, R - t0)
        qc, tr, ps, oc = q[t0:t0 + tc], table_row[t0:t0 + tc], positions[t0:t0 + tc], out[t0:t0 + tc]
        n_blocks = triton.cdiv(tc, s_tok)
        n_pairs = n_blocks * min(s_tok, tc)  # a block has at most one segment per token
        # one program per segment when each request's rows are consecutive (at most one more
        # segment per request than blocks); more segments are taken in turns
        progs = min(n_pairs, n_blocks + kv_table.shape[0])
        _attn_rows_split_kernel[(progs, hkv, split_par)](
            qc, k_buffer, v_buffer, kv_table, tr, ps, m_buf, l_buf, o_buf, oc, tc, n_blocks, n_pairs, scale,
            qc.stride(0), qc.stride(1), k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0),
            v_buffer.stride(1), kv_table.stride(0), oc.stride(0), oc.stride(1), ns, HQ=hq, G=g, D=d,
            KV_SPLIT=ksplit, SPLIT_PAR=split_par, PREC=prec, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        if split_par > 1:
            _attn_rows_merge_kernel[(tc, hq)](m_buf, l_buf, o_buf, oc, ps, oc.stride(0), oc.stride(1),
                                              ns, HQ=hq, D=d, KV_SPLIT=ksplit, num_warps=cfg["MERGE_num_warps"])
    return out
