"""Batch-invariance and accuracy tests for mg_server.verifier.kernels, on CPU and (marker `gpu`) CUDA.

Invariance is checked bitwise (torch.equal): op(x[:k]) == op(x)[:k] for k = 1..64 and a few
large k, permuted rows, 1 vs 2 CPU threads; attention: one prefill == any chunking == decode
steps, contiguous == paged.  A sanity test shows torch.mm itself fails the same check, so the
harness can detect variance.
"""
from __future__ import annotations

import contextlib
import math

import pytest
import torch

import mg_server.verifier.kernels as K

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}  # relative to max |ref|


def ks_for(m: int) -> list[int]:
    return sorted(set(list(range(1, min(64, m) + 1)) + [m // 3, m // 2 + 1, m - 1, m]) - {0})


@contextlib.contextmanager
def threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def gen(seed=0):
    return torch.Generator(device="cpu").manual_seed(seed)


def rand(*shape, dtype, device, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=gen(seed)) * scale).to(device=device, dtype=dtype)


def check_rows(fn, x, full=None):
    """fn on prefixes and on a row permutation must equal the full call's rows bitwise."""
    full = fn(x) if full is None else full
    m = x.shape[0]
    bad = [k for k in ks_for(m) if not torch.equal(fn(x[:k]), full[:k])]
    assert not bad, f"prefix results differ for k={bad[:10]}"
    perm = torch.randperm(m, generator=gen(1)).to(x.device)
    assert torch.equal(fn(x[perm]), full[perm]), "permuted rows differ"
    if x.device.type == "cpu":
        with threads(1):
            one = fn(x)
        with threads(2):
            two = fn(x)
        assert torch.equal(one, full) and torch.equal(two, full), "thread count changes bits"
    return full


def rel_err(a, ref):
    return ((a.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------------------------
def test_torch_mm_is_batch_variant_sanity():
    """The harness must be able to fail: plain torch.mm (CPU fp32) is M-variant here."""
    x = rand(64, 576, dtype=torch.float32, device="cpu")
    w = rand(960, 576, dtype=torch.float32, device="cpu", seed=1)
    full = torch.mm(x, w.t())
    variant = [k for k in ks_for(64) if not torch.equal(torch.mm(x[:k], w.t()), full[:k])]
    if not variant:
        pytest.skip("torch.mm happened to be batch-invariant on this CPU/BLAS")
    with pytest.raises(AssertionError):
        check_rows(lambda a: torch.mm(a, w.t()), x, full)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,bias", [(300, 960, 576, False), (200, 576, 1536, True),
                                        (1024, 77, 100, True)])
def test_matmul_invariant_and_accurate(device, dtype, m, n, k, bias):
    x = rand(m, k, dtype=dtype, device=device)
    w = rand(n, k, dtype=dtype, device=device, seed=1, scale=k ** -0.5)
    b = rand(n, dtype=dtype, device=device, seed=2) if bias else None
    pw = K.prepare_weight(w)
    full = check_rows(lambda a: K.matmul(a, pw, b), x)
    assert full.dtype == dtype and full.shape == (m, n)
    assert torch.equal(K.matmul(x, w, b), full), "raw weight and prepared weight differ"
    ref = x.double() @ w.double().t() + (b.double() if bias else 0)
    assert rel_err(full, ref) < TOL[dtype]


@pytest.mark.parametrize("device", DEVICES)
def test_matmul_fp32_output(device):
    """bf16 operands with an fp32 output (the verifier's lm_head): rows invariant; on CPU the
    same bits as the fp32 copies of the operands (the exact-integer path sees values only)."""
    x = rand(200, 576, dtype=torch.bfloat16, device=device)
    w = rand(3000, 576, dtype=torch.bfloat16, device=device, seed=1, scale=576 ** -0.5)
    pw = K.prepare_weight(w)
    full = check_rows(lambda a: K.matmul(a, pw, out_dtype=torch.float32), x)
    assert full.dtype == torch.float32
    ref = x.double() @ w.double().t()
    assert rel_err(full, ref) < 1e-5  # fp32 accumulation, no bf16 rounding of the output
    if device == "cpu":
        assert torch.equal(full, K.matmul(x.float(), K.prepare_weight(w.float())))


def _rope_case(device, dtype, r=70, hq=9, hkv=3, d=64, slots=200):
    qkv = rand(r, (hq + 2 * hkv) * d, dtype=dtype, device=device)
    qk, v = qkv[:, :(hq + hkv) * d].view(r, hq + hkv, d), qkv[:, (hq + hkv) * d:].view(r, hkv, d)
    ang = torch.arange(300, dtype=torch.float64)[:, None] * torch.rand(d // 2, generator=gen(3)).double()
    cos = torch.cat([ang.cos(), ang.cos()], -1).float().to(device)  # [P, D] fp32
    sin = torch.cat([ang.sin(), ang.sin()], -1).float().to(device)
    pos = torch.randint(0, 300, (r,), generator=gen(4)).to(device)
    slot = torch.randperm(slots, generator=gen(5))[:r].to(device)
    return qk, v, cos, sin, pos, slot


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_store(device, dtype):
    """Fused RoPE + K/V store: per row independent of the row count; bit-equal to the torch
    formula (cpu.rope_store) on the same device; K/V land in their slots."""
    from mg_server.verifier.kernels import cpu as C
    qk, v, cos, sin, pos, slot = _rope_case(device, dtype)
    hq, hkv, d = 9, 3, 64

    def run(n, fn=K.rope_store):
        kl = torch.zeros(200, hkv, d, dtype=dtype, device=device)
        vl = torch.zeros_like(kl)
        q = fn(qk[:n], v[:n], cos, sin, pos[:n], slot[:n], kl, vl, hq)
        return q, kl, vl

    q, kl, vl = run(70)
    for n in (1, 2, 7, 33):
        qn, kn, vn = run(n)
        assert torch.equal(qn, q[:n]) and torch.equal(kn[slot[:n]], kl[slot[:n]])
    assert torch.equal(vl[slot], v)
    qr, kr, vr = run(70, C.rope_store)
    assert torch.equal(q, qr) and torch.equal(kl, kr) and torch.equal(vl, vr)


@pytest.mark.gpu
def test_matmul_into_a_shared_buffer_gpu():
    """matmul(..., out=) (the verifier's graphs write every bucket's fp32 logits into one buffer):
    the same bits as a fresh output, for the row counts of the window graphs' tiles."""
    from mg_server.verifier.kernels.matmul_triton import matmul

    w = rand(4096, 512, dtype=torch.bfloat16, device="cuda", seed=1, scale=0.05)
    buf = torch.full((640, 4096), float("nan"), device="cuda")  # [rows, N] fp32
    for m in (1, 17, 136, 160, 520, 640):
        x = rand(m, 512, dtype=torch.bfloat16, device="cuda", seed=m)
        got = matmul(x, w, out=buf[:m])
        assert got.data_ptr() == buf.data_ptr() and torch.equal(got, K.matmul(x, w, out_dtype=torch.float32))


@pytest.mark.gpu
def test_silu_mul_strided_gpu():
    """silu_mul reads the column halves of the gate/up output in place: same bits as copies."""
    gu = rand(100, 2 * 1536, dtype=torch.bfloat16, device="cuda", scale=3.0)
    g, u = gu[:, :1536], gu[:, 1536:]
    assert torch.equal(K.silu_mul(g, u), K.silu_mul(g.contiguous(), u.contiguous()))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336)])
def test_matmul_splitk_invariant_gpu(n, k):
    """The split-K kernel (off in the table, see config.py) keeps rows independent of M."""
    sk = K.KERNEL_CONFIG["matmul_splitk"]
    old = sk["max_n_tiles"]
    sk["max_n_tiles"] = 32
    try:
        x = rand(300, k, dtype=torch.bfloat16, device="cuda")
        w = rand(n, k, dtype=torch.bfloat16, device="cuda", seed=1, scale=0.02)
        b = rand(n, dtype=torch.bfloat16, device="cuda", seed=2)
        full = check_rows(lambda a: K.matmul(a, w, b), x)
        assert rel_err(full, x.double() @ w.double().t() + b.double()) < TOL[torch.bfloat16]
    finally:
        sk["max_n_tiles"] = old


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336)])
def test_matmul_invariant_8b_shapes_gpu(n, k, tma):
    """Both kernel flavours (pointer loads / TMA descriptors) of the bf16 table entry."""
    cfg = K.KERNEL_CONFIG["matmul"]["bfloat16"]
    old = cfg.get("tma")
    cfg["tma"] = tma
    try:
        x = rand(1024, k, dtype=torch.bfloat16, device="cuda")
        w = rand(n, k, dtype=torch.bfloat16, device="cuda", seed=1, scale=0.02)
        b = rand(n, dtype=torch.bfloat16, device="cuda", seed=2)
        full = check_rows(lambda a: K.matmul(a, w, b), x)
        ref = x.double() @ w.double().t() + b.double()
        assert rel_err(full, ref) < TOL[torch.bfloat16]
    finally:
        cfg.pop("tma", None) if old is None else cfg.update(tma=old)


@pytest.mark.gpu
@pytest.mark.parametrize("key", [k for k in K.KERNEL_CONFIG["matmul_tiles"] if k != "rows"])
def test_matmul_tiles_bit_equal_gpu(key):
    """Every tile config "matmul_tiles" names for a shape gives the dtype entry's tile's bits (why
    the tile may follow M), with the output dtype that shape's entry serves; "default" on a shape
    of no entry, bf16 and fp16, both outputs."""
    from mg_server.verifier.kernels.config import parse_tile
    from mg_server.verifier.kernels.matmul_triton import matmul_with_tile
    names = dict.fromkeys(K.KERNEL_CONFIG["matmul_tiles"][key])
    if key == "default":
        cases = [(1000, 4096, dt, out) for dt in (torch.bfloat16, torch.float16) for out in (None, torch.float32)]
    else:
        n, k = (int(v) for v in key.split(":")[0].split("x"))
        cases = [(n, k, torch.bfloat16, torch.float32 if key.endswith(":f32") else None)]
    for n, k, dt, out in cases:
        x = rand(300, k, dtype=dt, device="cuda")
        w = rand(n, k, dtype=dt, device="cuda", seed=1, scale=0.02)
        ref = matmul_with_tile(x, w, K.KERNEL_CONFIG["matmul"][str(dt).split(".")[1]], out_dtype=out)
        bad = [t for t in names if not torch.equal(matmul_with_tile(x, w, parse_tile(t), out_dtype=out), ref)]
        assert not bad, f"{key} {dt} out={out}: tiles {bad} change bits"
        assert torch.equal(K.matmul(x, w, out_dtype=out), ref)


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,tile", [(6144, 4096, "64x128w4s6k"), (4096, 4096, "128x128w4s4k"),
                                      (28672, 4096, "128x256w8s3k"), (1000, 1000, "64x64w4s6k")])
def test_stream_k_tiles_bit_equal_gpu(n, k, tile):
    """A stream-K tile (config "matmul_tiles", suffix k) hands a tile's fp32 accumulator from one
    program to the next mid-K: the bits must be the whole-tile kernel's at every row count (the
    cuts fall elsewhere for each), with a bias and an fp32 output, call after call (the hand-over
    flags must return to 0) and replayed from a CUDA graph. K = 1000 ends in a partial chunk."""
    from mg_server.verifier.kernels.config import parse_tile
    from mg_server.verifier.kernels.matmul_triton import matmul_with_tile, num_sms

    base, t = K.KERNEL_CONFIG["matmul"]["bfloat16"], parse_tile(tile)
    w = rand(n, k, dtype=torch.bfloat16, device="cuda", seed=1, scale=0.02)
    b = rand(n, dtype=torch.bfloat16, device="cuda", seed=2)
    streamed = 0
    for m in (129, 300, 384, 511, 777, 1024):
        x = rand(m, k, dtype=torch.bfloat16, device="cuda", seed=m)
        streamed += -(-m // t["BLOCK_M"]) * -(-n // t["BLOCK_N"]) >= num_sms(0)  # (else the whole-tile kernel)
        # (an fp32 output tile of 128x256 does not fit shared memory, stream-K or not)
        for bias, out in ((None, None), (b, None), (b, torch.float32))[:2 if t["BLOCK_N"] == 256 else 3]:
            ref = matmul_with_tile(x, w, base, bias, out)
            for _ in range(3):
                assert torch.equal(matmul_with_tile(x, w, t, bias, out), ref), (m, bias is not None, out)
    assert streamed >= 2
    x = rand(1024, k, dtype=torch.bfloat16, device="cuda", seed=5)
    ref = matmul_with_tile(x, w, base)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = matmul_with_tile(x, w, t)
    for _ in range(3):
        y.zero_()
        g.replay()
        assert torch.equal(y, ref)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("h", [576, 4096])
def test_rms_norm(device, dtype, h):
    x = rand(150, h, dtype=dtype, device=device, scale=3.0)
    r = rand(150, h, dtype=dtype, device=device, seed=3)
    w = rand(h, dtype=dtype, device=device, seed=4)
    y = check_rows(lambda a: K.rms_norm(a, w, 1e-5), x)
    x64 = x.double()
    ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert rel_err(y, ref) < TOL[dtype] * 2
    xr = torch.stack([x, r], 1)  # rows carry (x, residual) together through the checks
    both = check_rows(lambda a: torch.stack(K.add_rms_norm(a[:, 0], a[:, 1], w, 1e-5), 1), xr)
    assert torch.equal(both[:, 1], x + r)
    assert torch.equal(both[:, 0], K.rms_norm(x + r, w, 1e-5))


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(960, 576), (3072, 576), (6144, 4096)])  # 135m qkv/gate_up, 8b qkv
def test_norm_matmul_invariant_gpu(n, k):
    """The fused RMSNorm prologue (off in the table: called directly): rows invariant, the
    residual exact, the product accurate (its sum of squares is walked in BLOCK_K pieces: close
    to, not necessarily bit-equal with, the two ops), TMA and pointer loads bit-equal."""
    from mg_server.verifier.kernels import fused_triton as F

    x = rand(150, k, dtype=torch.bfloat16, device="cuda", scale=3.0)
    r = rand(150, k, dtype=torch.bfloat16, device="cuda", seed=3)
    gn = rand(k, dtype=torch.bfloat16, device="cuda", seed=4)
    w = rand(n, k, dtype=torch.bfloat16, device="cuda", seed=5, scale=0.05)
    bias = rand(n, dtype=torch.bfloat16, device="cuda", seed=6) if n == 960 else None
    both = check_rows(lambda a: torch.cat(F.norm_matmul(a[:, 0], a[:, 1], gn, 1e-5, w, bias), 1),
                      torch.stack([x, r], 1))
    assert torch.equal(F.norm_matmul(x, r, gn, 1e-5, w, bias, tma=False)[0], both[:, :n])
    y, nr = both[:, :n], both[:, n:]
    assert torch.equal(nr, x + r)
    s = (x + r).double()
    h = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-5) * gn.double()
    ref = h @ w.double().T + (bias.double() if bias is not None else 0)
    assert rel_err(y, ref) < 2e-2
    unfused, nr2 = K.norm_matmul(x, r, gn, 1e-5, w, bias)  # the table's path: the two ops
    assert torch.equal(nr2, nr) and rel_err(y, unfused.double()) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(576, 1536), (4096, 14336)])  # 135m / 8b down
def test_silu_matmul_invariant_gpu(n, k):
    """The fused SiLU*up prologue of the down projection (called directly): rows invariant and
    accurate, TMA and pointer loads bit-equal."""
    from mg_server.verifier.kernels import fused_triton as F
    gu = rand(150, 2 * k, dtype=torch.bfloat16, device="cuda", scale=3.0)
    w = rand(n, k, dtype=torch.bfloat16, device="cuda", seed=5, scale=0.05)
    y = check_rows(lambda a: F.silu_matmul(a, w), gu)
    assert torch.equal(F.silu_matmul(gu, w, tma=False), y)
    unfused = K.silu_matmul(gu, w)  # the table's path: the two ops
    assert torch.equal(unfused, K.matmul(K.silu_mul(gu[:, :k], gu[:, k:]), w))
    ref = (torch.nn.functional.silu(gu[:, :k].double()) * gu[:, k:].double()) @ w.double().T
    assert rel_err(y, ref) < 2e-2
    assert rel_err(y, unfused.double()) < 1e-2
    print(f"silu_matmul {n}x{k}: bit-equal to the two ops: {torch.equal(y, unfused)}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_log_softmax(device, dtype):
    x = rand(70, 2048, dtype=dtype, device=device, scale=4.0)
    y = check_rows(K.log_softmax, x)
    assert y.dtype == torch.float32
    ref = torch.log_softmax(x.double(), -1)
    assert (y.double() - ref).abs().max().item() < 1e-5
    big = rand(6, 49152, dtype=dtype, device=device, seed=5, scale=4.0)  # vocab-sized rows
    yb = K.log_softmax(big)
    assert all(torch.equal(K.log_softmax(big[:k]), yb[:k]) for k in range(1, 7))
    assert (yb.double() - torch.log_softmax(big.double(), -1)).abs().max().item() < 1e-5


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_top2_ties_and_invariance(device, dtype):
    x = rand(200, 49152 if device == "cuda" else 8192, dtype=dtype, device=device)
    x[0, 10] = x[0, 500] = 50.0  # tied maximum -> (10, 500)
    x[1, 7] = 50.0
    x[1, 3] = x[1, 9] = 40.0  # tied runner-up -> (7, 3)
    x[2, :] = 1.0  # all equal -> (0, 1)
    v, i = K.top2(x)
    assert v.dtype == torch.float32 and i.dtype == torch.int64
    assert i[0].tolist() == [10, 500] and v[0].tolist() == [50.0, 50.0]
    assert i[1].tolist() == [7, 3] and i[2].tolist() == [0, 1]
    both = check_rows(lambda a: torch.cat([t.double() for t in K.top2(a)], 1), x)
    tv, _ = torch.topk(x.float(), 2)
    assert torch.equal(both[:, :2].float(), tv)
    assert torch.equal(K.argmax(x), i[:, 0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(device, dtype):
    g = rand(100, 1024, dtype=dtype, device=device, scale=4.0)
    u = rand(100, 1024, dtype=dtype, device=device, seed=1)
    gu = torch.stack([g, u], 1)
    y = check_rows(lambda a: K.silu_mul(a[:, 0], a[:, 1]), gu)
    ref = torch.nn.functional.silu(g.double()) * u.double()
    assert rel_err(y, ref) < TOL[dtype]


# ---------------------------------------------------------------------------------------------
def _attn_ref(q, k, v, q_start):
    T, hq, d = q.shape
    g = hq // k.shape[1]
    s = q_start + T
    qq = q.double().transpose(0, 1)
    kk = k[:s].double().repeat_interleave(g, 1).transpose(0, 1)
    vv = v[:s].double().repeat_interleave(g, 1).transpose(0, 1)
    sc = qq @ kk.transpose(1, 2) / math.sqrt(d)
    pos = q_start + torch.arange(T, device=q.device)
    mask = torch.arange(s, device=q.device)[None, :] <= pos[:, None]
    sc = sc.masked_fill(~mask, float("-inf"))
    return (torch.softmax(sc, -1) @ vv).transpose(0, 1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (8, 2, 128)])
def test_attention_chunking_decode_paged(device, dtype, hq, hkv, d):
    S = 600  # crosses two KV split boundaries (256, 512)
    q = rand(S, hq, d, dtype=dtype, device=device)
    k = rand(S, hkv, d, dtype=dtype, device=device, seed=1)
    v = rand(S, hkv, d, dtype=dtype, device=device, seed=2)
    full = K.attention(q, k, v, 0)
    assert full.shape == (S, hq, d) and full.dtype == dtype
    assert rel_err(full, _attn_ref(q, k, v, 0)) < TOL[dtype] * 2
    for cuts in ([0, 1, 255, 256, 257, 511, 513, 600], [0, 100, 356, 600], [0, 300, 600]):
        parts = [K.attention(q[a:b], k, v, a) for a, b in zip(cuts[:-1], cuts[1:])]
        assert torch.equal(torch.cat(parts), full), f"chunking {cuts} differs"
    # k/v holding more keys than needed (a pre-allocated cache) must not matter either
    steps = [K.attention(q[t:t + 1], k[:t + 1] if t % 2 else k, v[:t + 1] if t % 2 else v, t)
             for t in list(range(0, 20)) + list(range(250, 262)) + list(range(505, 520)) + [599]]
    ts = list(range(0, 20)) + list(range(250, 262)) + list(range(505, 520)) + [599]
    assert torch.equal(torch.cat(steps), full[ts]), "decode steps differ from prefill"
    slots = torch.randperm(2048, generator=gen(7))[:S].to(device)
    kb = torch.full((2048, hkv, d), float("nan"), dtype=dtype, device=device)
    vb = torch.full((2048, hkv, d), float("nan"), dtype=dtype, device=device)  # unused slots
    kb[slots], vb[slots] = k, v
    assert torch.equal(K.attention_paged(q, kb, vb, slots, 0), full), "paged != contiguous"
    pc = [K.attention_paged(q[a:b], kb, vb, slots, a) for a, b in ((0, 333), (333, 600))]
    assert torch.equal(torch.cat(pc), full)
    assert torch.equal(K.attention_paged(q[599:], kb, vb, slots[:600], 599), full[599:])
    # the row-wise kernel of the verifier's CUDA graphs: any rows, from a slot table, bit-equal
    table = torch.zeros(3, 640, dtype=torch.int64, device=device)
    table[1, :S] = slots
    rows = torch.tensor([0, 1, 255, 256, 257, 300, 511, 512, 599, 3], device=device)
    got = K.attention_rows(q[rows], kb, vb, table, torch.ones_like(rows), rows, 640)
    assert torch.equal(got, full[rows]), "row-wise attention differs from prefill"
    # a window call (on CUDA a request's consecutive rows share K/V tiles): rows of two requests
    # (table rows 1 and 2 hold the same slots) interleaved inside blocks, crossing the split
    # boundaries at 256 and 512
    table[2, :S] = slots
    win = torch.cat([torch.arange(200, 300), torch.arange(0, 17), torch.arange(500, 530), torch.arange(590, 600)])
    trw = torch.tensor([1] * 50 + [2] * 50 + [2] * 17 + [1, 2] * 15 + [1] * 10)
    win, trw = win.to(device), trw.to(device)
    got = K.attention_rows(q[win], kb, vb, table, trw, win, 640)
    assert torch.equal(got, full[win]), "window attention differs from prefill"
    if device == "cpu":
        with threads(1):
            assert torch.equal(K.attention(q, k, v, 0), full)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(32, 8), (9, 3)])
def test_attention_rows_windows_bit_equal_gpu(hq, hkv, monkeypatch):
    """The verifier's window shapes: 8 requests (each its own keys and table) x 17 or 65 rows at
    positions across the split boundaries, plus padding rows (the scratch table, position 0), in
    one call: each row's bits equal its request's prefill row, equal those of calls of one row
    or of 7 rows (other blocks and segments: under 16 rows the splits go through fp32 partials and
    the merge kernel, from 16 rows they are merged in registers), and do not change when the
    partials go in row chunks."""
    from mg_server.verifier.kernels import attention_triton as AT

    d, S, n_req = 128, 700, 8
    slots_all = torch.randperm(n_req * S + 1, generator=gen(3)).to("cuda")
    kb = rand(n_req * S + 1, hkv, d, dtype=torch.bfloat16, device="cuda", seed=4)
    vb = rand(n_req * S + 1, hkv, d, dtype=torch.bfloat16, device="cuda", seed=5)
    q = rand(n_req, S, hq, d, dtype=torch.bfloat16, device="cuda", seed=6)
    table = torch.full((n_req + 1, 768), int(slots_all[-1]), dtype=torch.int64, device="cuda")  # last: padding
    full = []
    for r in range(n_req):
        table[r, :S] = slots_all[r * S:(r + 1) * S]
        full.append(K.attention_paged(q[r], kb, vb, table[r, :S], 0))
    for width in (17, 65):
        starts = [240, 500, 10, 255, 0, 600, 511, 128][:n_req]
        pos = torch.cat([torch.arange(a, a + width) for a in starts] + [torch.zeros(23, dtype=torch.int64)])
        trow = torch.cat([torch.full((width,), r) for r in range(n_req)] + [torch.full((23,), n_req)])
        pos, trow = pos.to("cuda"), trow.to("cuda")
        qr = torch.cat([q[r, a:a + width] for r, a in enumerate(starts)] + [q[0, :23]])
        got = K.attention_rows(qr, kb, vb, table, trow, pos, 768)
        want = torch.cat([full[r][a:a + width] for r, a in enumerate(starts)])
        assert torch.equal(got[:-23], want), f"8 x {width}: window rows differ from prefill"
        for small in (1, 7):
            per_row = torch.cat([K.attention_rows(qr[i:i + small], kb, vb, table, trow[i:i + small],
                                                  pos[i:i + small], 768) for i in range(0, len(pos), small)])
            assert torch.equal(got, per_row), f"8 x {width}: calls of {small} rows differ"
        # calls under 16 rows go through fp32 partials (SPLIT_PAR): in chunks of 2 rows, the same bits
        monkeypatch.setattr(AT, "_PARTIAL_BUDGET", hq * 3 * (d + 2) * 4 * 2)
        per7 = torch.cat([K.attention_rows(qr[i:i + 7], kb, vb, table, trow[i:i + 7], pos[i:i + 7], 768)
                          for i in range(0, len(pos), 7)])
        assert torch.equal(per7, got), "partial chunks"
        monkeypatch.undo()


@pytest.mark.gpu
def test_attention_long_context_gpu():
    S, hq, hkv, d = 5000, 32, 8, 128
    q = rand(S, hq, d, dtype=torch.bfloat16, device="cuda")
    k = rand(S, hkv, d, dtype=torch.bfloat16, device="cuda", seed=1)
    v = rand(S, hkv, d, dtype=torch.bfloat16, device="cuda", seed=2)
    full = K.attention(q, k, v, 0)
    parts = [K.attention(q[a:b], k, v, a) for a, b in ((0, 1000), (1000, 4097), (4097, 5000))]
    assert torch.equal(torch.cat(parts), full)
    for t in (0, 4095, 4096, 4999):
        assert torch.equal(K.attention(q[t:t + 1], k[:t + 1], v[:t + 1], t), full[t:t + 1])
    ref = _attn_ref(q[-64:], k, v, S - 64)
    assert rel_err(full[-64:], ref) < TOL[torch.bfloat16] * 2
    # the graphs' row-wise kernel at a 128k context's max_len: a long prefill chunk and 16 rows
    # (splits merged in registers), 15 rows and a decode row (fp32 partials): the prefill's bits
    table = torch.zeros(2, 131072, dtype=torch.int64, device="cuda")
    table[1, :S] = torch.arange(S, device="cuda")
    for a, b in ((4096, 4736), (1000, 1016), (1000, 1015), (4999, 5000)):
        rows = torch.arange(a, b, device="cuda")
        got = K.attention_rows(q[a:b], k, v, table, torch.ones_like(rows), rows, 131072)
        assert torch.equal(got, full[a:b]), f"rows {a}..{b}"


def test_kernel_config_id_stable():
    a = K.kernel_config_id("cpu")
    assert a == K.kernel_config_id("cpu") and a.startswith("cpu-") and len(a) == 16
    cpu = K.KERNEL_CONFIG["cpu"]
    old = cpu["attn_kv_split"]
    try:
        cpu["attn_kv_split"] = old * 2
        assert K.kernel_config_id("cpu") != a
    finally:
        cpu["attn_kv_split"] = old
    gpu_tile = K.KERNEL_CONFIG["attention"]
    old = gpu_tile["KV_SPLIT"]
    try:
        gpu_tile["KV_SPLIT"] = old * 2
        assert K.kernel_config_id("cpu") == a  # GPU tiles do not name CPU numerics
    finally:
        gpu_tile["KV_SPLIT"] = old
