"""GPU (Triton) seeded-sampling noise in one kernel: the bits of verifier/sampling.py's torch ops.

sampling.py builds each element's Gumbel noise from ~40 elementwise torch kernels (exact integer
hashing, fp64 frexp and IEEE +, -, *, /), each reading and writing [n, V] int64/fp64
temporaries: 6 ms for the 64 seeded rows of one decode step on an H200, about a whole decode step
of the 8B shape. This kernel does the same per-element work in registers, in the same order:
- the hash on uint32 lanes (wrapping products are exactly sampling._mul32's masked ones),
- frexp by the exponent and mantissa bits of a normal fp64 (u lies in (2**-25, 1) and -log(u)
  in (5e-8, 18): both normal, where frexp is exactly this),
- the atanh series, Horner in the same order, every fp64 constant loaded from a tensor (a Python
  float literal in Triton is fp32),
- every fp64 product, sum and quotient through libdevice's explicit-rounding ops (mul_rn, add_rn,
  ...), which no compiler contracts into an FMA: each rounds once, as torch's separate kernels
  round them (the Triton interpreter, which has no libdevice, runs the plain ops: numpy's),
- scores: the logits / T torch computed (sampling._scaled, the same kernel as before) + noise,
  one fp32 add.
Elementwise, one program per (row, block): BLOCK changes no bits. Tested bit-equal to the torch
ops on CUDA (tests/test_sampling_kernel.py).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import libdevice
from torch import Tensor

from .config import KERNEL_CONFIG

# fp64 constants of sampling._log: ln 2, sqrt(1/2), the series' eight coefficients, 1
_CONSTS = (math.log(2.0), math.sqrt(0.5)) + tuple(1.0 / (2 * k + 1) for k in range(8)) + (1.0,)
_consts_on: dict[torch.device, Tensor] = {}


@triton.jit
def _mul(a, b, RN: tl.constexpr):  # a * b rounded once (RN: an explicit-rounding op no compiler fuses)
    if RN:
        return libdevice.mul_rn(a, b)
    return a * b


@triton.jit
def _add(a, b, RN: tl.constexpr):
    if RN:
        return libdevice.add_rn(a, b)
    return a + b


@triton.jit
def _hash32(x):  # lowbias32 on uint32 lanes (sampling._hash32)
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _log64(x, c_ptr, RN: tl.constexpr):  # sampling._log of positive normal fp64 x, op for op
    bits = x.to(tl.int64, bitcast=True)
    e = ((bits >> 52) & 0x7FF) - 1022  # frexp's exponent: x = m * 2**e, m in [0.5, 1)
    m = ((bits & 0x000FFFFFFFFFFFFF) | 0x3FE0000000000000).to(tl.float64, bitcast=True)
    low = m < tl.load(c_ptr + 1)
    m = tl.where(low, m * 2.0, m)  # (exact)
    ef = (e - low.to(tl.int64)).to(tl.float64)
    one = tl.load(c_ptr + 10)  # (fp64 operands only: libdevice's ops take no mixed types)
    if RN:
        s = libdevice.div_rn(libdevice.sub_rn(m, one), libdevice.add_rn(m, one))
    else:
        s = (m - one) / (m + one)
    s2 = _mul(s, s, RN)
    acc = tl.zeros_like(s) + tl.load(c_ptr + 9)
    for k in tl.static_range(1, 8):  # Horner from the highest coefficient, as sampling._log
        acc = _add(_mul(acc, s2, RN), tl.load(c_ptr + 9 - k), RN)
    return _add(_mul(ef, tl.load(c_ptr), RN), _mul(_add(s, s, RN), acc, RN), RN)  # (s + s: 2 s, exact)


@triton.jit(do_not_specialize=["V", "s_sc", "s_out"])  # (one compile for every vocabulary: warm_up_sampling)
def _noise_kernel(sc_ptr, keys_ptr, c_ptr, out_ptr, V, s_sc, s_out,
                  HAS_SCALED: tl.constexpr, RN: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < V
    k0 = tl.load(keys_ptr + 2 * row).to(tl.uint32)
    k1 = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
    x = _hash32(_hash32(cols.to(tl.uint32) ^ k0) ^ k1)
    u = ((x >> 8).to(tl.float64) + 0.5) * (1.0 / 16777216.0)  # exact: (k + 0.5) / 2**24
    g = (-_log64(-_log64(u, c_ptr, RN), c_ptr, RN)).to(tl.float32)
    if HAS_SCALED:
        g = _add(tl.load(sc_ptr + row * s_sc + cols, mask=ok, other=0.0), g, RN)
    tl.store(out_ptr + row * s_out + cols, g, mask=ok)


def _consts(device: torch.device) -> Tensor:
    c = _consts_on.get(device)
    if c is None:
        c = _consts_on[device] = torch.tensor(_CONSTS, dtype=torch.float64, device=device)  # [11] fp64
    return c


def noise_rows(keys: Tensor,  # [n, 2] int64 on `device`: each row's two 32-bit keys (sampling._key)
               vocab: int, device: torch.device,
               scaled: Tensor | None = None) -> Tensor:  # [n, vocab] fp32 on `device`: logits / T
    """-> [n, vocab] fp32 on `device`: the noise, or scaled + noise (written into `scaled`)."""
    n = keys.shape[0]
    out = scaled if scaled is not None else torch.empty((n, vocab), dtype=torch.float32, device=device)
    if n == 0:
        return out
    cfg = KERNEL_CONFIG["noise"]
    grid = (n, triton.cdiv(vocab, cfg["BLOCK"]))
    _noise_kernel[grid](out, keys.contiguous(), _consts(device), out, vocab, out.stride(0), out.stride(0),
                        HAS_SCALED=scaled is not None, RN=device.type == "cuda", BLOCK=cfg["BLOCK"],
                        num_warps=cfg["num_warps"])
    return out
