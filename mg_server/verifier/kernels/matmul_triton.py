"""GPU (Triton) batch-invariant matmul: persistent tiles, the 16-bit weights' tile table, the
(disabled) split-K path.

Invariance rules (the row-wise ops in triton_ops.py follow the same):
* Tile sizes come from KERNEL_CONFIG only. The tile *shape* follows the weight shape and M
  (config.matmul_tile), its BLOCK_K and K loop never do: an output element's sum is the same
  whichever tile computes it (config "matmul_tiles" says why; a GPU test checks every tile).
* The row count M is `do_not_specialize`: Triton would otherwise compile separate variants for
  M == 1 / M % 16 == 0, which could change code generation.
* A row's reduction is one fp32 accumulator over its full length, in a fixed order: no split-K
  (unless its table entry turns it on: then the split size is a function of K only and the
  partials merge in a fixed order). A stream-K tile ("k" in the table) may hand that accumulator
  from one program to the next mid-K, through memory and a flag, which changes no bits; no atomics
  touch values. Rows beyond M are masked, never mixed in.
* Persistent (grid = min(#SMs, #tiles)); which program computes a tile does not matter because
  every tile runs the identical K loop.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .config import KERNEL_CONFIG, matmul_tile

_TL_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    if not torch.cuda.is_available():  # TRITON_INTERPRET on CPU
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _rows(x: Tensor) -> Tensor:
    """[..., N] -> [M, N] view with unit column stride (rows may be strided)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(1) == 1 or x2.shape[1] == 1 else x2.contiguous()


def _dev_index(t: Tensor) -> int:
    return t.device.index if t.device.type == "cuda" and t.device.index is not None else 0


# ---------------------------------------------------------------------------------------------
# persistent matmul
@triton.jit
def _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile index -> (pid_m, pid_n), grouped along M for L2 reuse. Both matmul kernels walk
    tiles through this one function, so their output tiling is the same by construction."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile // in_group) * GROUP_M
    gsize = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % in_group) % gsize, (tile % in_group) // gsize


@triton.jit(do_not_specialize=["M"])
def _matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                   sxm, sxk, swn, swk, sym, syn,
                   HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PREC: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile in range(pid, num_tiles, NUM_SMS):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok = rm < M
        n_ok = rn < N
        a_ptrs = x_ptr + rm[:, None] * sxm + rk[None, :] * sxk
        b_ptrs = w_ptr + rn[None, :] * swn + rk[:, None] * swk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # why: the one and only reduction order of y[m, n] -- K in BLOCK_K steps, ascending.
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=m_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
            else:
                k_ok = (k0 + rk) < K
                a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PREC)
            a_ptrs += BLOCK_K * sxk
            b_ptrs += BLOCK_K * swk
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        y_ptrs = y_ptr + rm[:, None] * sym + rn[None, :] * syn
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(x_desc, w_desc, y_desc, b_ptr, M, N, K,
                       HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):
    # Same tile walk and the same ascending BLOCK_K loop as _matmul_kernel; only the loads and
    # stores go through TMA descriptors (out-of-bounds rows/cols read as 0, stores are clipped).
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile in range(pid, num_tiles, NUM_SMS):
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):  # why: the one reduction order, K ascending
            a = x_desc.load([off_m, k0])
            b = w_desc.load([off_n, k0])
            acc = tl.dot(a, b.T, acc, input_precision=PREC)
        if HAS_BIAS:
            rn = off_n + tl.arange(0, BLOCK_N)
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


@triton.jit
def _tma_chunks(x_desc, w_desc, acc, off_m, off_n, k_lo, k_hi, PREC: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc += x[off_m tile, chunks k_lo..k_hi) @ w[off_n tile, same].T, one BLOCK_K chunk at a time."""
    for kk in range(k_lo, k_hi):  # why: K ascending in BLOCK_K chunks, as in every matmul kernel
        a = x_desc.load([off_m, kk * BLOCK_K])
        b = w_desc.load([off_n, kk * BLOCK_K])
        acc = tl.dot(a, b.T, acc, input_precision=PREC)
    return acc


@triton.jit
def _tma_finish(y_desc, b_ptr, acc, off_m, off_n, N, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    if HAS_BIAS:
        rn = off_n + tl.arange(0, BLOCK_N)
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


@triton.jit(do_not_specialize=["M"])
def _matmul_sk_tma_kernel(x_desc, w_desc, y_desc, b_ptr, ws_ptr, flag_ptr, M, N, K,
                          HAS_BIAS: tl.constexpr, PREC: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr, NUM_PROGS: tl.constexpr):
    """Stream-K with an in-order hand-over, for calls of at least NUM_PROGS tiles.

    Whole waves but the last are walked data-parallel as in _matmul_tma_kernel (neighbouring
    tiles at once: L2 reuse; contiguous ranges over many tiles measured 2x slower on 8B gate_up).
    The (tile, K chunk) iterations of the other 1-2 waves' tiles are cut into NUM_PROGS equal
    contiguous ranges, one per program, so the partly filled last wave is spread over every SM. A tile cut between
    programs p and p+1 is not summed from two partials: p computes its first chunks FIRST and
    hands its fp32 accumulator over (workspace slot p+1, then flag p+1); p+1 continues from that
    accumulator LAST, after its whole tiles, and writes the tile.
    why bit-equal to _matmul_tma_kernel: each element is still one fp32 accumulator walked over K
    in ascending BLOCK_K chunks (stored to and loaded from memory exactly between the two parts).
    why no deadlock and (almost) no wait: every range is >= one tile (>= NUM_PROGS tiles), so it
    holds at most the tail of one tile and the head of another; p's head is done within its first
    tile's time, p+1's tail starts after its own head and whole tiles, which take >= as long.
    The grid is at most the SM count, so every program becomes resident."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    chunks = tl.cdiv(K, BLOCK_K)
    num_tiles = num_pid_m * num_pid_n
    dp_tiles = (num_tiles // NUM_PROGS - 1) * NUM_PROGS  # whole tiles of all waves but the last two
    first = dp_tiles * chunks  # the stream-K part: iterations [first, num_tiles * chunks)
    start = first + (pid * (num_tiles * chunks - first)) // NUM_PROGS
    end = first + ((pid + 1) * (num_tiles * chunks - first)) // NUM_PROGS
    slot = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]  # [BM, BN] in a ws slot
    if end % chunks != 0:  # 1. the head of the tile the range ends in, handed to program pid + 1
        pid_m, pid_n = _tile_coords(end // chunks, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _tma_chunks(x_desc, w_desc, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, end % chunks, PREC, BLOCK_K)
        tl.store(ws_ptr + (pid + 1) * BLOCK_M * BLOCK_N + slot, acc)
        tl.debug_barrier()  # every thread's part stored before the flag (the release is cumulative)
        tl.atomic_xchg(flag_ptr + pid + 1, 1, sem="release", scope="gpu")
    for tile in range(pid, dp_tiles, NUM_PROGS):  # 2. the data-parallel waves' tiles
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _tma_chunks(x_desc, w_desc, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, chunks, PREC, BLOCK_K)
        _tma_finish(y_desc, b_ptr, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, N, HAS_BIAS, BLOCK_N)
    for tile in range(tl.cdiv(start, chunks), end // chunks):  # 3. whole tiles of the range
        pid_m, pid_n = _tile_coords(tile, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = _tma_chunks(x_desc, w_desc, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, 0, chunks, PREC, BLOCK_K)
        _tma_finish(y_desc, b_ptr, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, N, HAS_BIAS, BLOCK_N)
    if start % chunks != 0:  # 4. the tail of the tile the range starts in, from program pid - 1's head
        pid_m, pid_n = _tile_coords(start // chunks, num_pid_m, num_pid_n, GROUP_M)
        while tl.atomic_add(flag_ptr + pid, 0, sem="acquire", scope="gpu") == 0:
            pass
        acc = tl.load(ws_ptr + pid * BLOCK_M * BLOCK_N + slot, cache_modifier=".cg")
        tl.debug_barrier()  # every thread has its part before the flag is cleared for the next call
        tl.atomic_xchg(flag_ptr + pid, 0, sem="relaxed", scope="gpu")
        acc = _tma_chunks(x_desc, w_desc, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, start % chunks, chunks,
                          PREC, BLOCK_K)
        _tma_finish(y_desc, b_ptr, acc, pid_m * BLOCK_M, pid_n * BLOCK_N, N, HAS_BIAS, BLOCK_N)


_SK_BUFFERS: dict = {}  # device index -> (ws [progs, 128*256] fp32, flags [progs] int32, zeroed)


def _sk_buffers(x: Tensor, progs: int):
    """The stream-K hand-over workspace and flags of x's device. The flags return to 0 at the end
    of every call, so one pair serves every later call; one pair per device, so stream-K calls
    must not run on two streams of a device at once (mg's verifier runs its matmuls on one
    stream). None while a CUDA graph is being captured and none exists yet: the caller then runs
    the whole-tile kernel, whose bits are the same."""
    key = _dev_index(x)
    bufs = _SK_BUFFERS.get(key)
    if bufs is None or bufs[1].numel() < progs:
        if torch.cuda.is_current_stream_capturing():
            return None
        bufs = (torch.empty((progs, 128 * 256), device=x.device, dtype=torch.float32),
                torch.zeros(progs, device=x.device, dtype=torch.int32))
        _SK_BUFFERS[key] = bufs
    return bufs


@triton.jit(do_not_specialize=["M"])
def _matmul_splitk_kernel(x_ptr, w_ptr, p_ptr, M, N, K, sxm, sxk, swn, swk,
                          K_SPLIT: tl.constexpr, PREC: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Partial product of one (row tile, column tile, K split) -> p[split, M, N] fp32."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = tl.program_id(0) // num_pid_n
    pid_n = tl.program_id(0) % num_pid_n
    split = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    k_lo = split * K_SPLIT
    a_ptrs = x_ptr + rm[:, None] * sxm + (k_lo + rk)[None, :] * sxk
    b_ptrs = w_ptr + rn[None, :] * swn + (k_lo + rk)[:, None] * swk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):  # why: this split's part of K, BLOCK_K steps, ascending
        k_ok = (k0 + rk) < k_hi
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PREC)
        a_ptrs += BLOCK_K * sxk
        b_ptrs += BLOCK_K * swk
    p_ptrs = p_ptr + (split * M + rm[:, None]).to(tl.int64) * N + rn[None, :]
    tl.store(p_ptrs, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["n"])
def _splitk_merge_kernel(p_ptr, b_ptr, y_ptr, n, S, HAS_BIAS: tl.constexpr, N_COLS: tl.constexpr,
                         BLOCK: tl.constexpr):
    """y = p[0] + p[1] + ... + p[S-1] (+ bias), added in split order, element by element."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    acc = tl.load(p_ptr + offs, mask=ok, other=0.0)
    for s in range(1, S):  # why: fixed order, the same for every element and every M
        acc += tl.load(p_ptr + s * n + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs % N_COLS, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def use_splitk(n: int, k: int, dtype: torch.dtype) -> bool:
    """Split-K or not: a function of the weight shape (N, K) and dtype only (see config)."""
    if dtype not in (torch.bfloat16, torch.float16):
        return False
    sk, cfg = KERNEL_CONFIG["matmul_splitk"], KERNEL_CONFIG["matmul"][_TL_DTYPE[dtype]]
    return triton.cdiv(n, cfg["BLOCK_N"]) <= sk["max_n_tiles"] and k >= 2 * sk["K_SPLIT"]


def _matmul_splitk(x2: Tensor, w: Tensor, bias: Tensor | None, y: Tensor) -> None:
    """y [M, N] = x2 [M, K] @ w [N, K].T (+ bias) by K splits; rows in chunks bounded by the
    workspace (rows are independent, so chunking never changes bits)."""
    M, K = x2.shape
    N = w.shape[0]
    cfg, sk = KERNEL_CONFIG["matmul"][_TL_DTYPE[x2.dtype]], KERNEL_CONFIG["matmul_splitk"]
    splits = triton.cdiv(K, sk["K_SPLIT"])
    bm = cfg["BLOCK_M"]
    chunk = max(bm, sk["workspace_bytes"] // (splits * N * 4) // bm * bm)
    for r0 in range(0, M, chunk):
        xc, yc = x2[r0:r0 + chunk], y[r0:r0 + chunk]
        m = xc.shape[0]
        part = torch.empty((splits, m, N), device=x2.device, dtype=torch.float32)  # [S, m, N] fp32
        grid = (triton.cdiv(m, bm) * triton.cdiv(N, cfg["BLOCK_N"]), splits)
        _matmul_splitk_kernel[grid](xc, w, part, m, N, K, xc.stride(0), xc.stride(1), w.stride(0), w.stride(1),
                                    K_SPLIT=sk["K_SPLIT"], PREC="tf32", BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"],
                                    BLOCK_K=cfg["BLOCK_K"], num_warps=sk["num_warps"], num_stages=sk["num_stages"])
        n = m * N
        _splitk_merge_kernel[(triton.cdiv(n, sk["MERGE_BLOCK"]),)](
            part, bias if bias is not None else part, yc, n, splits, HAS_BIAS=bias is not None, N_COLS=N,
            BLOCK=sk["MERGE_BLOCK"], num_warps=4)


def _tma_ok(n: int, k: int, dtype: torch.dtype) -> bool:
    """TMA needs 16-byte aligned row strides: a property of the weight shape only, never M."""
    esz = torch.empty((), dtype=dtype).element_size()
    return (k * esz) % 16 == 0 and (n * esz) % 16 == 0


def matmul(x: Tensor,  # [M, K] bf16/fp16/fp32, cuda
           w: Tensor,  # [N, K] same dtype (nn.Linear layout)
           bias: Tensor | None = None,  # [N] any float dtype, added in fp32
           out_dtype: torch.dtype | None = None,  # default x.dtype; fp32 keeps the fp32 accumulator
           out: Tensor | None = None,  # [M, N] contiguous, written in place (its dtype is the output's)
           ) -> Tensor:  # [M, N] out_dtype
    """x @ w.T (+ bias) with fp32 accumulation; one persistent kernel, K ascending in BLOCK_K
    steps (the output dtype changes only the final element-wise rounding; where the output lives
    changes nothing: `out` lets the verifier's CUDA graphs share one logits buffer)."""
    return matmul_with_tile(x, w, None, bias, out_dtype, out)


def matmul_with_tile(x: Tensor, w: Tensor, tile: dict | None, bias: Tensor | None = None,
                     out_dtype: torch.dtype | None = None, out: Tensor | None = None) -> Tensor:
    """matmul with an explicit tile config (None: config.matmul_tile's); for the tile benchmark."""
    lead = x.shape[:-1]
    x2 = _rows(x)
    M, K = x2.shape
    N = w.shape[0]
    assert w.shape[1] == K and w.dtype == x.dtype, (x.shape, x.dtype, w.shape, w.dtype)
    if out is None:
        y = torch.empty((M, N), device=x.device, dtype=out_dtype or x.dtype)
    else:  # (the TMA store needs a 16-byte aligned base, as a fresh tensor has)
        assert out.shape == (M, N) and out.is_contiguous() and out.data_ptr() % 16 == 0, (out.shape, M, N)
        y = out
    cfg = tile or matmul_tile(_TL_DTYPE[x.dtype], M, N, K, y.dtype == torch.float32)
    if M == 0:
        return y.view(*lead, N)
    if use_splitk(N, K, x.dtype):
        _matmul_splitk(x2, w if w.stride(1) == 1 else w.contiguous(), bias, y)
        return y.view(*lead, N)
    sms = num_sms(_dev_index(x))
    tiles = triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    # why min(): idle programs would only return; the tile->program map never affects bits.
    grid = (min(sms, tiles),)
    prec = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 flag is unused for bf16
    if cfg.get("tma") and x.device.type == "cuda" and _tma_ok(N, K, x.dtype) and _tma_ok(N, K, y.dtype):
        from triton.tools.tensor_descriptor import TensorDescriptor
        bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
        x2 = x2.contiguous()  # row stride K: same layout for every M
        if x2.data_ptr() % 16:  # TMA needs a 16-byte aligned base; a copy has equal values
            x2 = x2.clone()
        wc = w.contiguous()
        if wc.data_ptr() % 16:  # never for a freshly allocated weight
            wc = wc.clone()
        assert bm * bn <= 128 * 256, cfg  # (the stream-K workspace slot)
        bufs = _sk_buffers(x2, sms) if cfg.get("stream_k") and tiles >= sms else None
        if bufs is not None:  # stream-K: same bits, the last wave spread over every SM
            _matmul_sk_tma_kernel[(sms,)](
                TensorDescriptor.from_tensor(x2, [bm, bk]), TensorDescriptor.from_tensor(wc, [bn, bk]),
                TensorDescriptor.from_tensor(y, [bm, bn]), bias if bias is not None else y, bufs[0], bufs[1],
                M, N, K, HAS_BIAS=bias is not None, PREC=prec, BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], NUM_PROGS=sms,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
            return y.view(*lead, N)
        _matmul_tma_kernel[grid](
            TensorDescriptor.from_tensor(x2, [bm, bk]), TensorDescriptor.from_tensor(wc, [bn, bk]),
            TensorDescriptor.from_tensor(y, [bm, bn]), bias if bias is not None else y,
            M, N, K, HAS_BIAS=bias is not None, PREC=prec, BLOCK_M=bm, BLOCK_N=bn,
            BLOCK_K=bk, GROUP_M=cfg["GROUP_M"], NUM_SMS=sms,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
        return y.view(*lead, N)
    _matmul_kernel[grid](
        x2, w, bias if bias is not None else y, y, M, N, K,
        x2.stride(0), x2.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, EVEN_K=(K % cfg["BLOCK_K"] == 0),  # a function of K only
        PREC=prec,
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        GROUP_M=cfg["GROUP_M"], NUM_SMS=sms,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return y.view(*lead, N)
