"""Seeded sampling as a pure function of (logits, seed, position): Gumbel-max.

    score[v] = logits[v] / T + g(seed, position, v)        token = argmax(score), ties -> lower id
    margin   = T * (score_top1 - score_top2)               (logit units: the greedy tau applies)

g is standard Gumbel noise, g = -log(-log(u)), with u in (0, 1) drawn by a counter-based hash
of (seed, position, vocab id), so argmax(score) is a sample of softmax(logits / T) and needs no
generator state: the fast path (mg's seam in SGLang's process) and the verifier compute the same
noise for a step independently, whatever the batch. Both add the SAME noise to their own logits,
so their score difference at a token pair is Δlogits / T; scaled by T it is the greedy margin's
Δlogits, which tau bounds.

Why the noise is bit-identical everywhere: it is built only from
- integer ops on int64 tensors kept below 2**63 (32-bit lanes, products split into 16-bit
  halves, masks after every step), which are exact on every device, and
- fp64 `frexp` (exact) and +, -, *, / (IEEE correctly rounded, one torch op per kernel, so no
  fused multiply-add can differ between a vectorised and a scalar loop or between devices),
never a library log/exp, whose last bit can differ between torch's vectorised CPU loop, its
scalar tail (which depends on how many threads split the row) and the GPU. Each element depends
only on its own (seed, position, id): no reduction, so the batch cannot enter.

On CUDA one Triton kernel (kernels/noise_triton.py) computes these same ops per element in
registers (6 ms -> a fraction of it for a decode step's 64 rows of a 128k vocabulary); tested bit
for bit against the torch ops on CUDA, which the CPU path runs.

Shapes: `gumbel_rows(seeds, positions, vocab, device)` -> [n, vocab] fp32; `sampled_scores_rows(
logits, temperatures, seeds, positions)` with logits [n, vocab] (any float dtype, any device) ->
[n, vocab] fp32; `gumbel_noise`, `sampled_scores`, `sampled_pair` are their one-row forms.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

M32 = 0xFFFFFFFF
M64 = (1 << 64) - 1
# lowbias32's multipliers (C. Wellons' hash-prospector: a well-mixed 32-bit permutation).
_C1, _C2 = 0x7FEB352D, 0x846CA68B
_LN2 = math.log(2.0)
# atanh series log(m) = 2 (s + s^3/3 + s^5/5 + ...), s = (m - 1) / (m + 1), |s| <= 0.1716 for
# m in [sqrt(1/2), sqrt(2)): 8 terms leave a relative truncation error < 1e-13, far below the
# fp32 the noise is rounded to (fewer terms: the noise of a 49152-id row costs ~8 ms on 1 core).
_SERIES = tuple(1.0 / (2 * k + 1) for k in range(8))


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x < 2**32 (int or int64 tensor) without exceeding 2**49."""
    lo = x * (c & 0xFFFF)
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & M32


def _hash32(x):
    """lowbias32 on 32-bit values (a Python int or an int64 tensor of values < 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def _key(seed: int, position: int) -> tuple[int, int]:
    """Two 32-bit keys of (seed mod 2**64, position), computed with Python ints (exact)."""
    seed &= M64
    k = _hash32(seed & M32)
    k = _hash32(k ^ (seed >> 32))
    k0 = _hash32(k ^ (position & M32))
    k1 = _hash32(k0 ^ ((position >> 32) & M32) ^ 0x9E3779B9)
    return k0, k1


def _log(x: Tensor) -> Tensor:
    """Natural log of positive fp64 x from exact frexp and IEEE arithmetic only (see module doc).
    x: [n] fp64 -> [n] fp64, relative error < 1e-13."""
    m, e = torch.frexp(x)  # x = m * 2**e, m in [0.5, 1)
    low = m < math.sqrt(0.5)
    m = torch.where(low, m * 2.0, m)  # exact (power of two): m in [sqrt(1/2), sqrt(2))
    e = (e - low.to(e.dtype)).to(torch.float64)
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    acc = torch.full_like(s, _SERIES[-1])
    for c in reversed(_SERIES[:-1]):  # Horner, fixed order
        acc = acc * s2 + c
    return e * _LN2 + 2.0 * s * acc


# Rows of noise computed at once: at most this many elements (~16 MB per int64 / fp64 temporary), so
# the transient memory of a forward's noise stays bounded in SGLang's process whatever the batch.
NOISE_ELEMS = 1 << 21


def _keys(seeds: list[int], positions: list[int]) -> Tensor:
    """[n, 2] int64 on the host: each row's two 32-bit keys."""
    return torch.tensor([_key(s, p) for s, p in zip(seeds, positions)], dtype=torch.int64).reshape(-1, 2)


def _on_gpu(device) -> bool:
    return torch.device(device).type == "cuda"


def host_to_device(host: Tensor, device: torch.device | str) -> Tensor:
    """A small host tensor (keys, row indices) on `device`. Why pinned and non_blocking on CUDA:
    the lagged seam calls this at the sampler, where the host must not wait for the GPU; torch's
    caching host allocator keeps the block until the copy is done."""
    if not _on_gpu(device):
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def gumbel_rows(seeds: list[int], positions: list[int], vocab: int, device: torch.device | str = "cpu") -> Tensor:
    """-> [n, vocab] fp32 standard Gumbel noise, row k of (seeds[k], positions[k]); bit-identical on
    every device, and row k equal to that row computed alone (only elementwise ops: see module doc).
    On CUDA one kernel computes the torch ops' bits (kernels/noise_triton.py)."""
    if _on_gpu(device):
        from mg_server.verifier.kernels.noise_triton import noise_rows

        return noise_rows(host_to_device(_keys(seeds, positions), device), vocab, torch.device(device))
    return _gumbel_torch(seeds, positions, vocab, device)


def _gumbel_torch(seeds: list[int], positions: list[int], vocab: int, device: torch.device | str) -> Tensor:
    """gumbel_rows in torch ops (the CPU's path; on CUDA the kernel's reference)."""
    keys = host_to_device(_keys(seeds, positions), device)
    k0, k1 = keys[:, :1], keys[:, 1:]  # [n, 1] int64 each
    ids = torch.arange(vocab, dtype=torch.int64, device=device)[None, :]  # [1, V] int64
    x = _hash32(_hash32(ids ^ k0) ^ k1)  # [n, V] int64 in [0, 2**32)
    # u in (0, 1) from the top 24 bits: (k + 0.5) / 2**24 is exact in fp64, never 0 or 1.
    u = ((x >> 8).to(torch.float64) + 0.5) * (1.0 / (1 << 24))
    return (-_log(-_log(u))).to(torch.float32)


def gumbel_noise(seed: int, position: int, vocab: int, device: torch.device | str = "cpu") -> Tensor:
    """-> [vocab] fp32 standard Gumbel noise of (seed, position); bit-identical on every device."""
    return gumbel_rows([seed], [position], vocab, device)[0]


def sampled_scores_rows(logits: Tensor, temperatures: list[float], seeds: list[int], positions: list[int]) -> Tensor:
    """logits [n, V] (any float dtype/device) -> perturbed scores [n, V] fp32, row k = logits[k] /
    T_k + gumbel(seed_k, position_k): the seam and the verifier both compute their rows here, so
    equal logits give equal scores bit for bit, whatever rows share the call (elementwise ops;
    the division by a Python scalar per temperature, as a row alone has it). On CUDA the noise
    and the add are one kernel (kernels/noise_triton.py) on the same division's output."""
    n, vocab = logits.shape
    if any(not t > 0 for t in temperatures):
        raise ValueError(f"seeded sampling needs a temperature > 0, got {temperatures!r}")
    if logits.is_cuda:
        from mg_server.verifier.kernels.noise_triton import noise_rows

        return noise_rows(host_to_device(_keys(seeds, positions), logits.device), vocab, logits.device,
                          _scaled(logits, temperatures))
    return _scores_torch(logits, temperatures, seeds, positions)


def _scaled(logits: Tensor, temperatures: list[float]) -> Tensor:
    """logits [n, V] -> [n, V] fp32 logits / T, a division by a Python scalar per row (one for all
    rows when they share T), as a row alone is divided."""
    if len(set(temperatures)) == 1:  # (one temperature: the usual case, one division)
        return logits.float() / float(temperatures[0])
    return torch.stack([logits[j].float() / float(t) for j, t in enumerate(temperatures)])


def _scores_torch(logits: Tensor, temperatures: list[float], seeds: list[int], positions: list[int]) -> Tensor:
    """sampled_scores_rows in torch ops, in row chunks of NOISE_ELEMS (the CPU's path; on CUDA the
    reference the kernel is tested against)."""
    n, vocab = logits.shape
    out = torch.empty((n, vocab), dtype=torch.float32, device=logits.device)
    step = max(1, NOISE_ELEMS // max(1, vocab))
    for a in range(0, n, step):
        b = min(n, a + step)
        out[a:b] = _scaled(logits[a:b], temperatures[a:b]) + _gumbel_torch(seeds[a:b], positions[a:b], vocab,
                                                                           logits.device)
    return out


def warm_up_sampling(device: torch.device) -> None:
    """Compile and load the CUDA noise kernel (its sizes are not specialised on: one compile)."""
    if _on_gpu(device):
        sampled_scores_rows(torch.zeros((1, 16), dtype=torch.float32, device=device), [1.0], [0], [0])
        torch.cuda.synchronize(device)


def sampled_scores(logits: Tensor, temperature: float, seed: int, position: int) -> Tensor:
    """logits [V] (any float dtype/device) -> perturbed scores [V] fp32 = logits / T + gumbel."""
    return sampled_scores_rows(logits[None], [temperature], [seed], [position])[0]


def sampled_pairs(logits: Tensor, temperatures: list[float], seeds: list[int], positions: list[int]) -> Tensor:
    """logits [n, V] -> [n, 2] fp64 on logits' device: per row (top1 - top2 of the scores, computed
    in fp32, then widened exactly; their argmax, ties -> lower id). Left on the device so that a
    caller can read all rows back at once, by whatever copy it may use (the verifier:
    wire.zerocopy). The top-2 is the verifier's batch-invariant one: a row's pair does not
    depend on the others."""
    from mg_server.verifier.kernels import top2  # the verifier's batch-invariant top-2

    vals, idx = top2(sampled_scores_rows(logits, temperatures, seeds, positions))  # [n, 2] fp32, int64
    return torch.stack(((vals[:, 0] - vals[:, 1]).double(), idx[:, 0].double()), dim=1)


def sampled_pair(logits: Tensor, temperature: float, seed: int, position: int) -> Tensor:
    """logits [V] -> [2] fp64: sampled_pairs of one row."""
    return sampled_pairs(logits[None], [temperature], [seed], [position])[0]


def choice_of_pair(pair: list[float], temperature: float) -> tuple[int, float]:
    """A read-back sampled_pair -> (token, margin in logit units = T * (top1 - top2))."""
    return int(pair[1]), float(temperature) * pair[0]


def sampled_choice(logits: Tensor, temperature: float, seed: int, position: int) -> tuple[int, float]:
    """logits [V] -> (token, margin in logit units): argmax of the scores (ties -> lower id) and
    T * (top1 - top2) of the scores."""
    return choice_of_pair(sampled_pair(logits, temperature, seed, position).tolist(), temperature)
