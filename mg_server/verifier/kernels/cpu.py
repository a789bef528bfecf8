"""CPU (plain torch) batch-invariant ops: exact-integer float64 reductions.

Why this is invariant *by construction* (not just "measured to be"):

Every reduction whose order we do not control (a BLAS GEMM, ``Tensor.sum``) is fed integers.
Before reducing, each operand row is rounded onto a fixed-point grid chosen from *that row
alone*: ``q = round(x * 2**s)`` with ``s = bits - exponent(max|row|)``, so ``|q| <= 2**bits``.
``bits`` is picked from the length of the reduction (a model constant such as K, D or the KV
split size, never M or the number of tokens) so that ``n_terms * 2**(bits_a+bits_b) <= 2**53``.
Every
partial sum is then an integer of magnitude <= 2**53, which float64 represents exactly, so every
addition is exact and *any* summation order -- any BLAS blocking, any thread count, any M --
gives the same integer.  Scaling back by powers of two is exact; the one rounding that follows
(bias add, cast to the output dtype) is element-wise.  The grid costs an absolute error of at
most 2**-(bits+1) * max|row| per element (matmul, K=576: 22 bits for activations, 21 for
weights): ~1e-6 relative on fp32 data, below bf16 resolution unless a row's dynamic range
exceeds ~2**13.

Element-wise transcendental functions are a second trap on CPU: torch's vectorised and scalar
tail paths can differ (measured here: ``F.silu`` and ``log1p`` change bits with the number of
rows).  So ``exp`` is built from +, *, round and exact power-of-two scaling only, which are
correctly rounded on every path; ``log`` and square roots are taken per row with Python's
``math``/IEEE ``sqrt``.
"""
from __future__ import annotations

import math
import weakref

import torch
from torch import Tensor

from .config import KERNEL_CONFIG

_CPU = KERNEL_CONFIG["cpu"]
_F64 = torch.float64


# ---------------------------------------------------------------------------------------------
# exact helpers
def bits_for(n_terms: int, operands: int = 2) -> int:
    """Bits per operand so that a sum of n_terms products of `operands` factors stays < 2**53."""
    room = _CPU["fp64_mantissa"] - max(0, math.ceil(math.log2(max(1, n_terms))))
    return room if operands == 1 else min(_CPU["max_bits"], room // operands)


def matmul_bits(k: int) -> tuple[int, int]:
    """(activation bits, weight bits) for a K-long exact dot product: sum <= K * 2**(xb+wb)."""
    room = _CPU["fp64_mantissa"] - max(0, math.ceil(math.log2(max(1, k))))
    # why balanced: measured most accurate, even with 4096x outlier activation channels (the
    # outlier multiplies the weight's rounding error, so starving the weight does not pay).
    return room - room // 2, room // 2


def pow2(n: Tensor) -> Tensor:
    """Exact 2**n as float64 from the bit pattern (no pow/exp2: those are not correctly rounded)."""
    n = n.to(torch.int64).clamp(-1022, 1023)
    return ((n + 1023) << 52).view(_F64)


def quantize(x: Tensor, bits, dim: int = -1, inplace: bool = False) -> tuple[Tensor, Tensor]:
    """Round float64 `x` to integers on a grid fixed by max|x| along `dim` (that slice only).

    Returns (q, shift) with q = round(x * 2**shift) integer-valued float64, |q| <= 2**bits,
    shift int64 with `dim` kept (size 1).  `bits` may be an int or a broadcastable tensor.
    """
    amax = torch.maximum(x.amax(dim=dim, keepdim=True), x.amin(dim=dim, keepdim=True).neg())
    # ^ exact max|x| (max/min involve no rounding); faster here than abs() or aminmax()
    _, e = torch.frexp(amax)  # amax < 2**e (amax == 0 -> e == 0)
    shift = bits - e.to(torch.int64)
    q = x.mul_(pow2(shift)) if inplace else x * pow2(shift)  # exact power-of-two scaling
    return q.round_(), shift  # round is exact


_LN2_HI = 6.93147180369123816490e-01  # trailing zero bits: n * _LN2_HI is exact for |n| < 2**11
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e00
_EXP_COEF = [1.0 / math.factorial(i) for i in range(12)]  # Taylor, |r| <= ln2/2 -> err ~6e-15


def exp_det(d: Tensor, inplace: bool = False) -> Tensor:
    """exp(d) for float64 d <= ~0, element-wise bit-identical on every code path.

    Only correctly rounded ops (+, *, round) and an exact power-of-two scale are used -- each a
    separate torch op, never fused into an FMA -- so the vectorised and scalar-tail paths of
    torch agree (unlike torch.exp/silu on CPU).  Values below -700 (including -inf) give 0.
    inplace=True clobbers `d` (saves two large temporaries).
    """
    zero = d < -700.0
    r = d.clamp_(min=-700.0) if inplace else d.clamp(min=-700.0)
    n = torch.mul(r, _INV_LN2).round_()
    t = torch.mul(n, _LN2_HI)
    r.sub_(t).sub_(torch.mul(n, _LN2_LO, out=t))  # r = (d - n*ln2_hi) - n*ln2_lo
    p = torch.mul(r, _EXP_COEF[-1], out=t).add_(_EXP_COEF[-2])
    for c in reversed(_EXP_COEF[:-2]):  # Horner, separate mul and add
        p.mul_(r).add_(c)
    e = r.view(torch.int64).copy_(n)  # reuse r's storage for the exponent bits
    e.clamp_(-1022, 1023).add_(1023).bitwise_left_shift_(52)
    return p.mul_(e.view(_F64)).masked_fill_(zero, 0.0)  # exact 2**n from the bit pattern


def _log_rows(v: Tensor) -> Tensor:
    """log of each element via Python's scalar libm: one call per value, independent of M."""
    return torch.tensor([math.log(a) for a in v.tolist()], dtype=_F64).view(v.shape)


# ---------------------------------------------------------------------------------------------
# matmul
class PreparedWeight:
    """A weight [N, K] pre-rounded for the exact-integer CPU matmul (made once at load time).

    qt:    Tensor  # [K, N] float64, integer-valued, |q| <= 2**bits (transposed: faster GEMV)
    scale: Tensor  # [N] float64, exact powers of two: w ~= q * scale[:, None]
    """

    def __init__(self, w: Tensor):
        assert w.dim() == 2, "weight must be [N, K]"
        self.shape = tuple(w.shape)
        self.dtype = w.dtype
        self.device = w.device
        self.x_bits, self.bits = matmul_bits(w.shape[1])  # why: depends on K only, never M
        q, shift = quantize(w.detach().to(_F64), self.bits)
        self.qt = q.t().contiguous()
        self.scale = pow2(-shift).view(-1)

    def __repr__(self) -> str:
        return f"PreparedWeight(shape={self.shape}, dtype={self.dtype}, bits={self.bits})"


_PREP_CACHE: dict[int, tuple] = {}  # id(w) -> (weakref(w), version, data_ptr, PreparedWeight)


def prepare_weight(w: Tensor) -> PreparedWeight:
    """Return the cached PreparedWeight of `w` (re-made if `w` was modified in place)."""
    if isinstance(w, PreparedWeight):
        return w
    key = id(w)
    hit = _PREP_CACHE.get(key)
    if hit is not None and hit[0]() is w and hit[1] == w._version and hit[2] == w.data_ptr():
        return hit[3]
    pw = PreparedWeight(w)
    _PREP_CACHE[key] = (weakref.ref(w, lambda _r, k=key: _PREP_CACHE.pop(k, None)),
                        w._version, w.data_ptr(), pw)
    return pw


def matmul(x: Tensor, w, bias: Tensor | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
    """x [M, K] (fp32/bf16) @ w[N, K].T (+ bias [N]) -> [M, N] in out_dtype (default x.dtype);
    exact-integer fp64, so the result depends on the operands' values only, not their dtypes."""
    pw = prepare_weight(w)
    lead = x.shape[:-1]
    x64 = x.reshape(-1, x.shape[-1]).to(_F64, copy=True)
    xq, xs = quantize(x64, pw.x_bits, inplace=True)  # per-row grid: this row only
    y = torch.mm(xq, pw.qt)  # exact: integers, |partial sums| <= 2**53
    y.mul_(pow2(-xs)).mul_(pw.scale)  # exact power-of-two scaling (row, then column)
    if bias is not None:
        y.add_(bias.to(_F64))  # one element-wise rounding
    return y.to(out_dtype or x.dtype).view(*lead, pw.shape[0])


# ---------------------------------------------------------------------------------------------
# row-wise ops
def _rstd(x64: Tensor, eps: float) -> Tensor:
    """1/sqrt(mean(x^2) + eps) per row from an exact integer sum of squares.  [R, 1] fp64"""
    k = x64.shape[-1]
    xq, s = quantize(x64, bits_for(k))
    ss = (xq * xq).sum(-1, keepdim=True)  # exact: integers <= 2**53
    ms = ss * pow2(-s) * pow2(-s) / k  # exact scaling, then one rounding
    return 1.0 / torch.sqrt(ms + eps)  # sqrt and / are correctly rounded on every path


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """y = weight * (x * rstd).to(x.dtype), HF-Llama order.  x [..., H], weight [H]."""
    x64 = x.reshape(-1, x.shape[-1]).to(_F64)
    h = (x64 * _rstd(x64, eps)).to(torch.float32).to(x.dtype)
    return (weight.to(x.dtype) * h).view(x.shape)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float):
    """(rms_norm(x + residual), x + residual); the add is element-wise in x.dtype."""
    new_res = x + residual
    return rms_norm(new_res, weight, eps), new_res


def log_softmax(x: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Row-wise log-softmax of x [..., V] -> `dtype` (default fp32)."""
    x64 = x.reshape(-1, x.shape[-1]).to(_F64)
    d = x64 - x64.amax(-1, keepdim=True)  # max is exact
    frac = min(_CPU["softmax_frac_bits"], bits_for(x64.shape[-1], operands=1))
    e = torch.round(exp_det(d) * float(2 ** frac))  # fixed-point terms in [0, 2**frac]
    s = e.sum(-1) * (2.0 ** -frac)  # exact integer sum; s >= 1 (the max term is exactly 1)
    return (d - _log_rows(s).unsqueeze(-1)).to(dtype).view(x.shape)


def top2(x: Tensor) -> tuple[Tensor, Tensor]:
    """Two largest per row: (values [M, 2] fp32, indices [M, 2] int64).

    Ties go to the LOWER index (a repeated maximum gives indices (i, j) with i < j).  max/min are
    exact, so this is order-free.  Rows need >= 2 entries; NaN rows are undefined.
    """
    xf = x.reshape(-1, x.shape[-1]).to(torch.float32)
    n = xf.shape[-1]
    idx = torch.arange(n, device=xf.device)
    v1 = xf.amax(-1, keepdim=True)
    i1 = torch.where(xf == v1, idx, n).amin(-1, keepdim=True)
    rest = xf.masked_fill(idx == i1, float("-inf"))
    v2 = rest.amax(-1, keepdim=True)
    i2 = torch.where((rest == v2) & (idx != i1), idx, n).amin(-1, keepdim=True)
    return torch.cat([v1, v2], -1), torch.cat([i1, i2], -1)


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up element-wise in gate.dtype, bit-identical per element on every path
    (torch.nn.functional.silu is NOT on CPU: its vector and scalar-tail paths differ)."""
    g = gate.to(_F64)
    e = exp_det(-g.abs())  # exp(-|g|) in (0, 1]: no overflow
    sig = torch.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    return ((g * sig).to(torch.float32).to(gate.dtype) * up).view(gate.shape)


# ---------------------------------------------------------------------------------------------
# attention
_CHUNK_ELEMS = 1 << 20  # score elements per pass (cache-sized; measured best here). Rows are
# independent and every op is exact or element-wise, so the chunking never changes bits.


def attention(q: Tensor, k: Tensor, v: Tensor, q_start: int, scale: float | None = None):
    """Causal GQA attention for one request (see package docs).  q [T,Hq,D], k/v [S,Hkv,D].

    Keys are cut into fixed splits of KV_SPLIT positions.  Inside a split, q.k, sum(p) and
    sum(p*v) are exact-integer sums; across splits the merge is an exact fixed-point sum of the
    rescaled partials.  A query row at position p only ever sees splits covering keys 0..p, and
    masked or absent keys contribute exact zeros, so its bits do not depend on T, q_start
    chunking, or whether keys beyond p are present.
    """
    T, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    assert hq == g * hkv and k.shape[0] >= q_start + T
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    ks_ = _CPU["attn_kv_split"]
    s_eff = q_start + T
    ns = -(-s_eff // ks_)
    assert ns <= 2 ** _CPU["attn_max_splits_log2"], "context too long for the merge bit budget"
    sp = ns * ks_
    # K and V: one conversion pass into a zero-padded [2, Hkv, S_pad, D] fp64 buffer, then an
    # in-place per-vector quantisation (k over D for q.k; v over D for sums over a split)
    kv = torch.empty(2, hkv, sp, d, dtype=_F64)
    kv[:, :, s_eff:] = 0.0
    kv[0, :, :s_eff] = k[:s_eff].transpose(0, 1)
    kv[1, :, :s_eff] = v[:s_eff].transpose(0, 1)
    bits = torch.tensor([bits_for(d), bits_for(ks_)]).view(2, 1, 1, 1)
    kv, sh = quantize(kv, bits, inplace=True)
    kblk = kv[0].view(hkv, ns, ks_, d).transpose(2, 3)  # [Hkv, NS, D, KS]
    vblk = kv[1].view(hkv, ns, ks_, d)  # [Hkv, NS, KS, D]
    kinv = pow2(-sh[0]).view(hkv, ns, 1, ks_)
    vinv = pow2(-sh[1]).view(hkv, ns, 1, ks_)
    # queries: rows r = t*G + g per KV head
    q64 = q.to(_F64).view(T, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, T * g, d)
    outs = []
    key_pos = torch.arange(sp).view(ns, 1, ks_)
    nb = bits_for(2 ** _CPU["attn_max_splits_log2"], operands=1)  # cross-split terms
    lbits = bits_for(ks_, operands=1)  # sum(p) over one split: p <= 1 on a 2**-lbits grid
    # why chunks of <= KV_SPLIT tokens: a chunk skips the splits none of its rows can see (they
    # would only add exact zeros), and memory stays bounded; rows are independent either way.
    step = max(1, min(ks_, _CHUNK_ELEMS // (hq * sp)))
    for t0 in range(0, T, step):  # all tensors below are [Hkv, splits, rows, ...]
        t1 = min(T, t0 + step)
        nsc = (q_start + t1 - 1) // ks_ + 1  # splits visible to some row of this chunk
        pos = (q_start + torch.arange(t0, t1)).repeat_interleave(g).view(1, -1, 1)  # [1, R, 1]
        qq, qsh = quantize(q64[:, t0 * g:t1 * g], bits_for(d))  # [Hkv, R, D]
        sc = torch.matmul(qq.unsqueeze(1), kblk[:, :nsc])  # [Hkv, nsc, R, KS] exact int sums
        sc.mul_(pow2(-qsh).unsqueeze(1)).mul_(kinv[:, :nsc]).mul_(scale)  # then one rounding
        sc.masked_fill_(key_pos[:nsc] > pos, float("-inf"))  # causal (also hides padding)
        split_hid = (torch.arange(nsc) * ks_).view(-1, 1, 1) > pos  # [nsc, R, 1]
        m_j = sc.amax(-1, keepdim=True).masked_fill_(split_hid, 0.0)  # [Hkv, nsc, R, 1]
        p = exp_det(sc.sub_(m_j), inplace=True)  # masked -> exactly 0; sc is scratch now
        l_j = torch.mul(p, 2.0 ** lbits, out=sc).round_().sum(-1, keepdim=True)  # exact
        l_j.mul_(2.0 ** -lbits)
        aq, ash = quantize(p.mul_(vinv[:, :nsc]), bits_for(ks_), inplace=True)  # (split, row)
        o_j = torch.matmul(aq, vblk[:, :nsc]).mul_(pow2(-ash))  # [Hkv, nsc, R, D] exact
        # exact merge across splits: rescale to the row max, fixed-point sum over splits
        m_j.masked_fill_(split_hid, float("-inf"))
        beta = exp_det(m_j - m_j.amax(1, keepdim=True))  # invisible splits -> exactly 0
        lb, lsh = quantize(l_j.mul_(beta), nb, dim=1, inplace=True)
        L = lb.sum(1).mul_(pow2(-lsh.squeeze(1)))  # [Hkv, R, 1]
        ob, osh = quantize(o_j.mul_(beta), nb, dim=1, inplace=True)
        O = ob.sum(1).mul_(pow2(-osh.squeeze(1)))  # [Hkv, R, D]
        outs.append(O.div_(L))
    o = torch.cat(outs, 1).view(hkv, T, g, d).permute(1, 0, 2, 3).reshape(T, hq, d)
    return o.to(q.dtype)


def attention_paged(q: Tensor, k_buffer: Tensor, v_buffer: Tensor, kv_indices: Tensor,
                    q_start: int, scale: float | None = None) -> Tensor:
    """Slot-indexed variant: k_buffer/v_buffer [slots, Hkv, D], kv_indices [S] slot per position.

    The gather is an exact copy, so this equals `attention` on the gathered keys bit-for-bit.
    """
    idx = kv_indices[: q_start + q.shape[0]].to(torch.long)
    return attention(q, k_buffer[idx], v_buffer[idx], q_start, scale)


# ---------------------------------------------------------------------------------------------
# RoPE + K/V store (element-wise: the reference formulation the Triton kernel reproduces)
def rope_store(qk: Tensor, v: Tensor, cos: Tensor, sin: Tensor, positions: Tensor, slots: Tensor,
               k_layer: Tensor, v_layer: Tensor, n_q_heads: int) -> Tensor:
    """Rotate-half RoPE of q and k heads, K and V written to their slots; returns q [R, Hq, D].

    qk [R, Hq+Hkv, D] and v [R, Hkv, D] in the model dtype (any row/head strides); cos/sin
    [P, D] fp32 tables; positions/slots [R] int64; k_layer/v_layer [slots, Hkv, D].
    Each product and the sum round to the model dtype, as HF's `x*cos + rotate_half(x)*sin`.
    """
    c = cos[positions].to(qk.dtype)[:, None, :]  # [R, 1, D] model dtype
    s = sin[positions].to(qk.dtype)[:, None, :]
    half = qk.shape[-1] // 2
    rot = torch.cat([-qk[..., half:], qk[..., :half]], dim=-1)
    out = qk * c + rot * s  # [R, Hq+Hkv, D]
    k_layer[slots] = out[:, n_q_heads:]
    v_layer[slots] = v
    return out[:, :n_q_heads].contiguous()
