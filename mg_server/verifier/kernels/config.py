"""The one place where tile sizes, split sizes and precision budgets live.

Every number here is part of the *reduction order* (GPU) or the *quantisation grid* (CPU) of
some op, so changing any of them changes output bits.  That is why the table is a literal and
why :func:`kernel_config_id` hashes it: the server reports the id, and two servers agree
bit-for-bit only if their ids agree (same backend, same table).

No reduction order here depends on the number of rows M, the batch, or the sequence chunking:
a config may depend on dtype (and, for reductions along a feature axis, on that axis' length)
but never on how many rows or tokens are in a call. The one thing that follows M is the matmul's
tile *shape* ("matmul_tiles"), which is not part of any element's reduction order (see there).
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import json
import re

import torch

KERNEL_CONFIG: dict = {
    # 2: the split-K table entry. 3: fused RoPE + K/V store; the verifier's lm_head runs on the
    # bf16 weights with an fp32 output (was an fp32 copy of them: same products, other order).
    # (Not bumped for "matmul_tiles": no bits changed, so the CPU id must not; the GPU id still
    # changes with the table, since every GPU entry is hashed.)
    "version": 3,
    # ---- GPU (Triton) -------------------------------------------------------------------
    # Persistent matmul, no autotune. Per dtype: BLOCK_K and the ascending K loop (the reduction
    # order of every output element: fixed, so it can never depend on M), the base tile (fp32's
    # only one) and the TMA switch; 16-bit tile shapes by weight shape and M: "matmul_tiles".
    "matmul": {
        # tma: loads/stores through TMA descriptors when the weight's rows are 16-byte aligned
        # (a property of N, K only; otherwise the pointer-load kernel).  Same tile walk, same
        # ascending BLOCK_K loop: measured bit-equal to the pointer kernel on H200.
        # 64x256: best single tile on H200 over M=1..1024 (bench --variants; every variant
        # measured was bit-equal to every other at the same ascending-K order).
        "bfloat16": {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8,
                     "num_warps": 4, "num_stages": 4, "tma": True},
        "float16": {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8,
                    "num_warps": 4, "num_stages": 4, "tma": True},
        # why ieee: tf32 would also be deterministic, but fp32 accuracy (~1e-5) needs full fp32.
        "float32": {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8,
                    "num_warps": 4, "num_stages": 3},
    },
    # 16-bit matmul tile shapes by weight shape ("NxK", ":f32" for an fp32 output) and row count:
    # entry b of a list serves M <= rows[b] (the last one every larger M). Name: BLOCK_M x BLOCK_N,
    # w num_warps, s num_stages (g GROUP_M if not 8, p without TMA, k stream-K: a call of at least
    # as many tiles as SMs cuts its (tile, K chunk) work into one equal range per SM, and a tile cut
    # between two programs is continued from the first one's fp32 accumulator, handed over through
    # memory: the same sum in the same order, so the same bits; matmul_triton._matmul_sk_tma_kernel);
    # BLOCK_K is the dtype entry's.
    # why this may follow M: a tile's shape changes which program computes an output element and
    # how many share a load, never the element's sum: K ascending in BLOCK_K steps into one fp32
    # accumulator, whatever the tile (every tile here is bit-equal to the dtype entry's on the
    # H100: tests/test_kernels.py test_matmul_tiles_bit_equal_gpu, and the tiles benchmark's bit_equal).
    # Chosen as the fastest tile per (shape, rows) measured by `python benchmarks/verifier.py tiles`
    # on an H100 (benchmarks/results/gpu/matmul_tiles*_h100.json, CUDA-graph timing vs cuBLAS; 8b.qkv
    # at 384 rows and 8b.gate_up at 384-512 from matmul_tiles_streamk*_h100.json: stream-K paid only
    # where the tiles fill just over one wave, 8b.qkv at 384 rows, 0.55-0.58x -> 0.72-0.74x cuBLAS).
    # Rows 320, 448 and 640 (the verifier's window graphs, graphs.BUCKETS): the next larger
    # column's tile, except where a sweep at those rows found one >= 8 % faster (8b qkv, gate_up,
    # down, lm_head_f32; benchmarks/results/gpu/matmul_tiles_windows_h100.json) and the 8B window
    # forward's profile agreed (8b.gate_up at 640 did not: 128x128w4s4 took 253 us a call in the
    # 8 x 65 window's 576-row graph, the kept 128x256w8s3 226 us; results/gpu/window_forward_h100.md).
    "matmul_tiles": {
        "rows": [1, 8, 16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 1024],
        # any other shape: the best geometric mean over all shapes measured (no fp32-out misfits)
        "default": [
            "64x128w4s5", "64x128w4s5", "64x128w4s5", "64x128w4s5", "64x64w4s6", "64x128w4s5", "64x128w4s5",
            "64x128w4s5", "64x128w4s5", "64x128w4s5", "128x128w4s4", "128x128w4s4", "128x128w4s4", "128x128w4s4"],
        # 135m.qkv
        "960x576": [
            "64x128w4s4", "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x64w4s6",
            "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x128w4s4", "64x128w4s4", "64x128w4s4", "64x128w4s4"],
        # 135m.o
        "576x576": [
            "64x64w4s6", "64x128w4s4", "64x64w4s6", "64x128w4s4", "64x64w4s6", "64x64w4s6", "64x64w4s6",
            "64x128w4s4", "64x128w4s4", "64x128w4s4", "64x128w4s4", "64x128w4s4", "64x128w4s4", "64x128w4s4"],
        # 135m.gate_up
        "3072x576": [
            "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x64w4s6",
            "64x128w4s5", "64x128w4s5", "64x128w4s5", "128x128w4s4", "128x128w4s4", "128x256w8s3", "128x256w8s3"],
        # 135m.down
        "576x1536": [
            "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x64w4s6",
            "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x64w4s6", "64x128w4s4", "64x128w4s4"],
        # 135m.lm_head
        "49152x576": [
            "64x256w4s4", "64x128w4s4", "64x128w4s4", "64x256w4s4", "64x128w4s4", "128x128w4s4", "128x128w4s4",
            "128x256w8s3", "128x256w8s3", "128x256w8s3", "128x256w8s3", "128x256w8s3", "128x256w8s3", "128x256w8s3"],
        # 8b.qkv
        "6144x4096": [
            "64x128w4s6", "64x128w4s6", "64x128w4s6", "64x128w4s6", "64x64w4s8", "64x128w4s6", "64x256w4s4",
            "128x128w4s4", "64x256w4s4", "128x128w4s4k", "128x256w8s3", "128x256w8s3", "128x256w8s3", "128x128w4s4"],
        # 8b.o
        "4096x4096": [
            "64x128w4s6", "64x128w4s6", "64x64w4s6", "64x64w4s8", "64x64w4s8", "64x64w4s8", "64x128w4s6",
            "64x128w4s6", "128x128w4s4", "128x128w4s4", "128x128w4s4", "128x128w4s4", "128x256w8s3", "128x256w8s3"],
        # 8b.gate_up
        "28672x4096": [
            "64x256w4s3", "64x128w4s5", "64x128w4s5", "64x128w4s5g1", "64x128w4s5", "128x128w4s4", "64x256w4s4",
            "128x256w8s3", "128x256w8s3", "128x256w8s3", "64x256w4s4", "128x128w4s4", "128x256w8s3", "128x256w8s3"],
        # 8b.down
        "4096x14336": [
            "64x128w4s6", "64x128w4s6", "64x64w4s8", "64x64w4s8", "64x32w4s8", "64x64w4s8", "64x128w4s6",
            "64x128w4s6", "64x256w4s4", "64x256w4s4", "64x256w4s4", "64x256w4s4", "128x256w8s3", "256x128w8s3"],
        # 8b.lm_head
        "128256x4096": [
            "64x256w8s3", "64x256w8s3", "64x256w8s3", "64x128w4s5", "64x128w4s5", "128x256w8s3", "128x256w8s3",
            "128x256w8s3", "128x256w8s3", "128x256w8s3", "128x256w8s3", "128x256w8s3", "128x256w8s3", "128x256w8s3"],
        # 8b.lm_head_f32
        "128256x4096:f32": [
            "64x256w8s3", "64x256w8s3", "64x256w8s3", "64x256w8s3", "64x128w4s5", "128x128w4s4", "64x256w4s4",
            "128x128w8s4", "64x256w4s4", "128x128w4s4", "64x256w4s4", "128x128w4s4", "128x128w4s4", "128x128w4s4"],
        # 135m.lm_head_f32
        "49152x576:f32": [
            "64x128w4s4", "64x128w4s4", "64x128w4s4", "64x128w4s4", "64x128w4s4", "64x256w4s4", "64x256w4s4",
            "128x128w8s4", "128x128w8s4", "128x128w8s4", "128x128w4s4", "128x128w4s4", "128x128w4s4", "128x128w4s4"],
    },
    # Split-K for 16-bit weights with few column tiles (cdiv(N, BLOCK_N) <= max_n_tiles) and
    # K >= 2 * K_SPLIT: a property of the weight shape only, never of M. With few column tiles a
    # small-M matmul keeps a fraction of the SMs busy (8B o/down at M=1: 16 tiles on 132 SMs).
    # why invariant: split s reduces K [s*K_SPLIT, (s+1)*K_SPLIT) in BLOCK_K steps, ascending;
    # the merge adds the fp32 partials in split order 0, 1, 2, ... for every element.
    # OFF (max_n_tiles 0), measured on an H100 (`python benchmarks/verifier.py kernels --splitk`):
    # K_SPLIT 512 took 8B qkv/o/down at M <= 64 from 0.29-0.59x to 0.67-0.86x cuBLAS, but the
    # verifier's 8B decode step only from 14.69 to 14.07 ms, while M = 1024 fell to 0.18-0.23x
    # and a 512-token verifier prefill rose from 70 to 83 ms; the choice cannot depend on M.
    "matmul_splitk": {"K_SPLIT": 512, "max_n_tiles": 0, "num_warps": 4, "num_stages": 4,
                      "MERGE_BLOCK": 1024, "workspace_bytes": 1 << 26},
    # The verifier's RMSNorm (after the residual add) and SiLU*up as prologues of the next
    # projection's matmul (fused_triton; 16-bit only). The row's sum of squares is walked in
    # BLOCK_K pieces instead of the row-wise kernel's CHUNK walk, so turning one on may change bits
    # (and does change this id). tma: the weight through a TMA descriptor (same values).
    # OFF, measured on an H100 (`python benchmarks/verifier.py fused`, results/gpu/bench_fused_h100.json):
    # the fused kernel took 11.5 us for 135m qkv at 17 rows where norm + matmul took 6.0 us, 25 us
    # for 135m down against 8.3 us (the prologue in the K loop stalls the weight pipeline); the
    # verifier's 17-row step rose from 1.49 to 2.14 ms with 223 instead of 312 kernels (one
    # bs-8 lag sweep with it on: +50 % over plain SGLang; unfused, on another machine: +35 %).
    "fused": {"norm_matmul": False, "silu_matmul": False, "tma": True},
    # Row-wise reductions (RMSNorm, log-softmax, top2): one program per row, the row is walked
    # in CHUNK-sized pieces in index order; per-lane partials are combined by one tl.sum/tl.max.
    # why: the chunk walk and the final tree depend on N (feature width) only, never on M.
    "rowwise": {"CHUNK": 2048, "num_warps": 8},
    # Fused RoPE + K/V store: element-wise, one program per row (num_warps changes no bits).
    "rope": {"num_warps": 4},
    # Seeded sampling's noise (+ logits / T) in one kernel (noise_triton): element-wise, one program
    # per (row, BLOCK ids); no reduction, so neither BLOCK nor num_warps changes a bit.
    "noise": {"BLOCK": 1024, "num_warps": 4},
    # Attention: fixed KV split size (keys per split), not a fixed number of splits.
    # why: a query at absolute position p always reduces splits [0, KS), [KS, 2KS), ... up to p,
    # in that order, whether it comes in a prefill chunk of any size or a decode step.
    # SPLIT_PAR ((from rows, programs), ...): attention_rows' programs per (segment, kv head),
    # taking the segment's splits in turns (j, j + n, ...): a few rows get the splits of a long
    # context spread out; from 16 rows the segments alone fill the GPU (H200, 300-key contexts:
    # 60 x 1 rows 1.39 ms a forward with 1, 1.60 with 4). Where a split is computed changes no bits.
    "attention": {"KV_SPLIT": 256, "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4,
                  "num_stages": 3, "MERGE_num_warps": 4, "SPLIT_PAR": ((1, 8), (16, 1))},
    # ---- CPU (torch) --------------------------------------------------------------------
    # Exact-integer float64 products: inputs are rounded per row to a fixed-point grid with
    # `bits` significant bits so that every partial sum is an integer < 2**53 (exact in fp64),
    # which makes the result independent of the BLAS's summation order and thread count.
    "cpu": {
        "fp64_mantissa": 53,
        "max_bits": 24,          # never keep more bits per operand than this
        "attn_kv_split": 256,    # same role as attention.KV_SPLIT; bounds the exact sums
        "attn_max_splits_log2": 14,  # contexts <= 2**14 splits; sets the merge's bit budget
        "softmax_frac_bits": 37,   # fixed-point grid of exp() terms in log-softmax sums
    },
}


_TILE = re.compile(r"(\d+)x(\d+)w(\d+)s(\d+)(?:g(\d+))?(p?)(k?)")


def parse_tile(name: str, block_k: int = 64) -> dict:
    """'64x128w4s5' -> a matmul tile config (KERNEL_CONFIG["matmul_tiles"] names; see there)."""
    m = _TILE.fullmatch(name)
    if not m:
        raise ValueError(f"not a tile name: {name!r} (e.g. 64x128w4s5, 128x64w8s4g1, 64x64w4s6p, 64x128w4s6k)")
    bm, bn, warps, stages = (int(v) for v in m.groups()[:4])
    if bm * bn > 128 * 256:
        raise ValueError(f"tile {name!r}: at most 128x256 elements (the stream-K workspace slot)")
    t = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": block_k, "GROUP_M": int(m.group(5) or 8),
         "num_warps": warps, "num_stages": stages, "tma": not m.group(6)}
    if m.group(7):
        t["stream_k"] = True
    return t


def tile_name(t: dict) -> str:
    return (f"{t['BLOCK_M']}x{t['BLOCK_N']}w{t['num_warps']}s{t['num_stages']}"
            + (f"g{t['GROUP_M']}" if t["GROUP_M"] != 8 else "") + ("" if t.get("tma") else "p")
            + ("k" if t.get("stream_k") else ""))


@functools.lru_cache(maxsize=256)
def _parsed(name: str, block_k: int) -> dict:
    return parse_tile(name, block_k)


def tile_names(n: int, k: int, out_fp32: bool) -> list[str]:
    """The "matmul_tiles" list of an [N, K] weight (one tile name per row bucket)."""
    table = KERNEL_CONFIG["matmul_tiles"]
    return table.get(f"{n}x{k}:f32" if out_fp32 else f"{n}x{k}") or table["default"]


def matmul_tile(dtype_name: str, m: int, n: int, k: int, out_fp32: bool) -> dict:
    """The tile config of one 16-bit matmul call (float32 has one: the dtype entry). Its BLOCK_K
    is the dtype entry's (the reduction order); the entry's "tma" switches TMA off for all."""
    base = KERNEL_CONFIG["matmul"][dtype_name]
    if dtype_name == "float32":
        return base
    rows = KERNEL_CONFIG["matmul_tiles"]["rows"]
    names = tile_names(n, k, out_fp32)
    tile = dict(_parsed(names[min(bisect.bisect_left(rows, m), len(rows) - 1)], base["BLOCK_K"]))
    tile["tma"] = tile["tma"] and bool(base.get("tma"))
    return tile


def _backend_tag() -> str:
    """Backend versions that can change bits: torch (CPU path) and triton (GPU path)."""
    try:
        import triton  # noqa: F401
        tv = triton.__version__
    except Exception:  # pragma: no cover - triton missing
        tv = "none"
    return f"torch={torch.__version__.split('+')[0]};triton={tv}"


def kernel_config_id(device: str | torch.device | None = None) -> str:
    """Short stable hash of KERNEL_CONFIG + backend (cpu:torch / cuda:triton+GPU name).

    Two processes produce identical bits only if their ids are equal.
    """
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        backend = "cuda-triton;" + _backend_tag() + ";" + torch.cuda.get_device_name(dev)
    else:
        backend = "cpu-torch;" + _backend_tag()
    # why per backend: the CPU id must not change when a GPU tile size does, and vice versa.
    part = {k: v for k, v in KERNEL_CONFIG.items() if (k == "cpu") == (dev.type != "cuda")}
    part["version"] = KERNEL_CONFIG["version"]
    blob = json.dumps(part, sort_keys=True) + "|" + backend
    return f"{dev.type}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}"
