"""The one place where tile sizes, split sizes and precision budgets live.

Every number here is part of the *reduction order* (GPU) or the *quantisation grid* (CPU) of
some op, so changing any of them changes output bits.  That is why the table is a literal and
why :func:`kernel_config_id` hashes it: the server reports the id, and two servers agree
bit-for-bit only if their ids agree (same backend, same table).

Nothing in this module looks at the number of rows M, the batch, or the sequence chunking:
a config may depend on dtype (and, for reductions along a feature axis, on that axis' length)
but never on how many rows or tokens are in a call.
"""
from __future__ import annotations

import hashlib
import json

import torch

KERNEL_CONFIG: dict = {
    # 2: the split-K table entry. 3: fused RoPE + K/V store; the verifier's lm_head runs on the
    # bf16 weights with an fp32 output (was an fp32 copy of them: same products, other order).
    "version": 3,
    # ---- GPU (Triton) -------------------------------------------------------------------
    # Persistent matmul: ONE tile config per dtype, no split-K, no autotune.
    # why: the K loop (BLOCK_K steps, in order) is the reduction order of every output element;
    # a fixed table means the order can never depend on M.
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
    # Split-K for 16-bit weights with few column tiles (cdiv(N, BLOCK_N) <= max_n_tiles) and
    # K >= 2 * K_SPLIT: a property of the weight shape only, never of M. With few column tiles a
    # small-M matmul keeps a fraction of the SMs busy (8B o/down at M=1: 16 tiles on 132 SMs).
    # why invariant: split s reduces K [s*K_SPLIT, (s+1)*K_SPLIT) in BLOCK_K steps, ascending;
    # the merge adds the fp32 partials in split order 0, 1, 2, ... for every element.
    # OFF (max_n_tiles 0), measured on an H100 (`python -m mg_server.kernels.bench --splitk`):
    # K_SPLIT 512 took 8B qkv/o/down at M <= 64 from 0.29-0.59x to 0.67-0.86x cuBLAS, but the
    # verifier's 8B decode step only from 14.69 to 14.07 ms, while M = 1024 fell to 0.18-0.23x
    # and a 512-token verifier prefill rose from 70 to 83 ms; the choice cannot depend on M.
    "matmul_splitk": {"K_SPLIT": 512, "max_n_tiles": 0, "num_warps": 4, "num_stages": 4,
                      "MERGE_BLOCK": 1024, "workspace_bytes": 1 << 26},
    # Row-wise reductions (RMSNorm, log-softmax, top2): one program per row, the row is walked
    # in CHUNK-sized pieces in index order; per-lane partials are combined by one tl.sum/tl.max.
    # why: the chunk walk and the final tree depend on N (feature width) only, never on M.
    "rowwise": {"CHUNK": 2048, "num_warps": 8},
    # Fused RoPE + K/V store: element-wise, one program per row (num_warps changes no bits).
    "rope": {"num_warps": 4},
    # Attention: fixed KV split size (keys per split), not a fixed number of splits.
    # why: a query at absolute position p always reduces splits [0, KS), [KS, 2KS), ... up to p,
    # in that order, whether it comes in a prefill chunk of any size or a decode step.
    "attention": {"KV_SPLIT": 256, "BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4,
                  "num_stages": 3, "MERGE_num_warps": 4},
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
