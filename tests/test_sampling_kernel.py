"""Seeded sampling (mg_server.verifier.sampling): the noise is a pure function of (seed, position,
id), bit-identical whatever the batch or thread count, distinct per seed and position, and the
sampled tokens follow softmax(logits / T)."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mg_server.verifier import sampling
from mg_server.verifier.sampling import (_hash32, _log, _mul32, gumbel_noise, sampled_choice, sampled_pairs,
                                        sampled_scores, sampled_scores_rows)

V = 49152


def test_integer_hash_matches_uint32_arithmetic():
    xs = [0, 1, 12345, 0x7FFFFFFF, 0xFFFFFFFF, 0xDEADBEEF]
    t = _hash32(torch.tensor(xs, dtype=torch.int64))
    for x, got in zip(xs, t.tolist()):
        # reference: lowbias32 in plain modular arithmetic
        y = x ^ (x >> 16)
        y = (y * 0x7FEB352D) % 2**32
        y ^= y >> 15
        y = (y * 0x846CA68B) % 2**32
        y ^= y >> 16
        assert got == y == _hash32(x)
    assert _mul32(0xFFFFFFFF, 0xFFFFFFFF) == (0xFFFFFFFF ** 2) % 2**32


def test_log_is_accurate():
    x = torch.cat([torch.rand(10000, dtype=torch.float64) + 1e-12, torch.tensor([1.0, 0.5, 2 ** -24, 17.0],
                                                                                 dtype=torch.float64)])
    assert torch.allclose(_log(x), torch.log(x), rtol=1e-12, atol=1e-13)


def test_noise_is_bit_identical_across_threads_and_batches():
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = gumbel_noise(7, 11, V)
        torch.set_num_threads(2)
        b = gumbel_noise(7, 11, V)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(a, b) and a.dtype == torch.float32 and a.shape == (V,)
    # a row's scores do not depend on which batch the row came from (rows are computed alone)
    batch = torch.randn(8, V, dtype=torch.bfloat16)
    alone = batch[3].clone()
    assert torch.equal(sampled_scores(batch[3], 0.8, 5, 40), sampled_scores(alone, 0.8, 5, 40))
    small = torch.cat([torch.randn(2, V, dtype=torch.bfloat16), alone[None]])
    assert torch.equal(sampled_scores(small[2], 0.8, 5, 40), sampled_scores(batch[3], 0.8, 5, 40))


def test_rows_computed_together_equal_each_row_alone(monkeypatch):
    """The seam and the verifier compute all of a forward's seeded rows in one call: each row's
    scores and (margin, token) equal that row computed alone, bit for bit, with mixed and equal
    temperatures, and however the rows are chunked (NOISE_ELEMS)."""
    logits = torch.randn(6, V, dtype=torch.bfloat16)
    temps, seeds, poss = [0.8, 0.8, 1.3, 0.8, 0.5, 2.0], [5, 9, 5, 2 ** 40, 0, 7], [40, 40, 41, 3, 2 ** 33, 0]
    alone = torch.stack([sampled_scores(logits[k].clone(), temps[k], seeds[k], poss[k]) for k in range(6)])
    for elems in (sampling.NOISE_ELEMS, V, 3 * V):  # one chunk, one row a chunk, three rows a chunk
        monkeypatch.setattr(sampling, "NOISE_ELEMS", elems)
        assert torch.equal(sampled_scores_rows(logits, temps, seeds, poss), alone)
        same_t = sampled_scores_rows(logits[:2], temps[:2], seeds[:2], poss[:2])  # one temperature
        assert torch.equal(same_t, alone[:2])
    pairs = sampled_pairs(logits, temps, seeds, poss).tolist()
    assert [sampling.choice_of_pair(p, t) for p, t in zip(pairs, temps)] == [
        sampled_choice(logits[k].clone(), temps[k], seeds[k], poss[k]) for k in range(6)]
    try:
        sampled_scores_rows(logits[:2], [0.8, 0.0], [1, 2], [3, 4])
        raise AssertionError("a zero temperature was accepted")
    except ValueError as e:
        assert "temperature > 0" in str(e)


@pytest.mark.gpu
def test_rows_on_the_gpu_equal_the_rows_alone():
    """The seam and the verifier both sample on CUDA: a batch of rows there (the pinned,
    non-blocking key copy included) equals each row computed alone there, and the noise equals
    the CPU's bit for bit (the scores do not: CUDA divides by a scalar as a multiplication by its
    reciprocal, so both sides must run on one device type, as they do)."""
    from mg_server.verifier.sampling import gumbel_rows, sampled_pair

    logits = torch.randn(5, 49152, dtype=torch.float32, device="cuda")
    temps, seeds, poss = [0.7, 0.7, 1.1, 0.7, 0.3], [1, 2, 3, 4, 2 ** 63], [9, 10, 11, 2 ** 35, 0]
    noise = gumbel_rows(seeds, poss, 49152, "cuda").cpu()
    assert torch.equal(noise, torch.stack([gumbel_noise(seeds[k], poss[k], 49152) for k in range(5)]))
    alone = torch.stack([sampled_scores(logits[k], temps[k], seeds[k], poss[k]) for k in range(5)])
    assert torch.equal(sampled_scores_rows(logits, temps, seeds, poss), alone)
    pairs = torch.stack([sampled_pair(logits[k], temps[k], seeds[k], poss[k]) for k in range(5)])
    assert torch.equal(sampled_pairs(logits, temps, seeds, poss), pairs)


@pytest.mark.gpu
def test_the_noise_kernel_gives_the_torch_ops_bits_on_cuda():
    """kernels/noise_triton.py against the torch ops it replaces, both on CUDA: the noise and the
    scores (bf16 and fp32 logits, one and mixed temperatures, a 128k vocabulary, huge seeds and
    positions) bit for bit; the noise also against the CPU's."""
    g = torch.Generator().manual_seed(3)
    V, n = 128256, 70
    seeds = [int(x) for x in torch.randint(0, 2 ** 62, (n,), generator=g)] + [2 ** 64 - 1, 0]
    poss = [int(x) for x in torch.randint(0, 2 ** 40, (n,), generator=g)] + [0, 2 ** 33 + 7]
    n = len(seeds)
    temps = [0.8] * n
    mixed = [0.3 + 0.05 * (k % 17) for k in range(n)]
    noise = sampling.gumbel_rows(seeds, poss, V, "cuda")
    assert torch.equal(noise, sampling._gumbel_torch(seeds, poss, V, "cuda"))
    assert torch.equal(noise[-4:].cpu(), sampling._gumbel_torch(seeds[-4:], poss[-4:], V, "cpu"))
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(n, V, generator=g) * 4).to(dtype).cuda()
        for ts in (temps, mixed):
            assert torch.equal(sampled_scores_rows(logits, ts, seeds, poss),
                               sampling._scores_torch(logits, ts, seeds, poss)), (dtype, ts[:3])


def test_the_noise_kernel_computes_the_torch_ops_in_the_interpreter():
    """The kernel's logic (hash on uint32 lanes, frexp from the bits, the series) through
    TRITON_INTERPRET=1 on the CPU: the CPU noise bit for bit, and logits / T + noise."""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import torch
        from mg_server.verifier import sampling as S
        from mg_server.verifier.kernels.noise_triton import noise_rows
        seeds, poss, V = [0, 1, 2 ** 64 - 1, 12345678901234], [0, 7, 2 ** 33 + 5, 300], 3001
        ref = S.gumbel_rows(seeds, poss, V)
        got = noise_rows(S._keys(seeds, poss), V, torch.device("cpu"))
        assert torch.equal(ref, got), (ref - got).abs().max()
        lg, T = torch.randn(4, V) * 5, [0.8, 0.8, 1.3, 0.7]
        scaled = S._scaled(lg, T)
        assert torch.equal(noise_rows(S._keys(seeds, poss), V, torch.device("cpu"), scaled.clone()), scaled + ref)
        print("ok")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_noise_differs_per_seed_and_position():
    base = gumbel_noise(1, 10, 4096)
    for other in (gumbel_noise(2, 10, 4096), gumbel_noise(1, 11, 4096), gumbel_noise(1 + 2 ** 32, 10, 4096),
                  gumbel_noise(1, 10 + 2 ** 32, 4096)):
        assert (other != base).float().mean() > 0.99
    assert torch.equal(gumbel_noise(-1, 3, 64), gumbel_noise(2 ** 64 - 1, 3, 64))  # seeds are mod 2**64
    g = gumbel_noise(3, 0, V).double()  # standard Gumbel: mean Euler's gamma, std pi / sqrt(6)
    assert abs(g.mean() - 0.5772) < 0.02 and abs(g.std() - math.pi / math.sqrt(6)) < 0.02


def test_sampled_tokens_follow_softmax_and_margin_is_in_logit_units():
    logits = torch.tensor([1.0, 2.0, 0.5, 0.0, -1.0])
    t = 0.8
    counts = torch.zeros(5)
    for seed in range(3000):
        tok, margin = sampled_choice(logits, t, seed, 9)
        counts[tok] += 1
        assert margin >= 0
    assert (counts / 3000 - torch.softmax(logits / t, 0)).abs().max() < 0.03
    # margin = T * (score gap): shifting the winner's logit by d moves the margin by d
    tok, m = sampled_choice(logits, t, 4, 9)
    bumped = logits.clone()
    bumped[tok] += 0.25
    assert abs(sampled_choice(bumped, t, 4, 9)[1] - (m + 0.25)) < 1e-5
