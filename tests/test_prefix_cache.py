"""The verifier's prefix cache (verifier/prefix.py): a prompt that begins like an earlier one maps
that one's K/V blocks, and every answer is bitwise the answer of an engine that computed it cold
(tokens, margins, logits rows, the request's whole shadow K/V). The guards: a digest collision
reuses nothing, a cut inside a mapped prefix never frees or rewrites the cache's slots, eviction
takes only blocks no live request maps."""

from __future__ import annotations

import pytest
import torch

from verifier_helpers import make_tiny, smollm2_shaped

from mg_server.verifier import prefix
from mg_server.verifier.engine import VerifierEngine
from mg_server.verifier.model import VerifierModel
from mg_server.wire.protocol import ErrorCode, ErrorReply, VerifyItem

B = prefix.BLOCK
CASES = [
    pytest.param(("cpu", "llama"), id="cpu-llama"),
    pytest.param(("cuda", "smollm2-shaped"), id="cuda-smollm2-shaped", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module", params=CASES)
def model(request, tmp_path_factory):
    device, kind = request.param
    d = tmp_path_factory.mktemp(kind)
    if kind == "smollm2-shaped":
        smollm2_shaped(d, layers=4)
    else:
        make_tiny(kind, d, dtype=torch.bfloat16, seed=5)
    return VerifierModel.load(d, torch.bfloat16, device, max_positions=256)


def engine(model, pool_tokens=2048, max_requests=16):
    return VerifierEngine(model, max_requests=max_requests, pool_tokens=pool_tokens, max_seq_len=256,
                          graph_buckets=(1, 2, 4, 8, 16, 32, 64, 128))


def tokens(model, n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.spec.vocab, (n,), generator=g).tolist()


def decode(eng, rid, prompt, n, temperature=0.0, seed=0, release=True, start=0):
    """(first result, [(token, margin, logits row)] of n steps, the request's K/V [L, 2, len, Hkv, D]).
    `start` > 0: the verifier holds the prompt's first `start` positions already (a chunked prompt)."""
    seq, out = list(prompt), []
    res = eng.step([VerifyItem(rid=rid, pos=len(seq) - 1, tokens=seq[start:], prompt_len=0 if start else len(seq),
                               temperature=temperature, seed=seed)])[0]
    assert not isinstance(res, ErrorReply), res
    first = res
    for k in range(n):
        out.append((res.token, res.margin, res.logits.cpu().clone()))
        seq.append(res.token)
        if k < n - 1:
            res = eng.step([VerifyItem(rid=rid, pos=len(seq) - 1, tokens=[seq[-1]], temperature=temperature,
                                       seed=seed)])[0]
            assert not isinstance(res, ErrorReply), res
    idx = torch.tensor(eng.seqs[rid].slots)
    kv = torch.stack([eng.pool.k[:, idx], eng.pool.v[:, idx]], 1).cpu().clone()
    if release:
        eng.release(rid)
    return first, out, kv


def same(a, b):
    (_, out_a, kv_a), (_, out_b, kv_b) = a, b
    assert [(t, m) for t, m, _ in out_a] == [(t, m) for t, m, _ in out_b], "tokens or margins differ"
    for (_, _, la), (_, _, lb) in zip(out_a, out_b):
        assert torch.equal(la, lb), "logits differ"
    assert torch.equal(kv_a, kv_b), "shadow K/V differs"


def test_a_shared_preamble_is_computed_once_with_the_same_bits(model):
    """Eval-shaped: one preamble, several questions. The second and later requests map the
    preamble's whole blocks (cold and warm told apart by `reused`) and equal a cold engine."""
    preamble = tokens(model, 3 * B + 5, seed=1)
    questions = [tokens(model, 7 + k, seed=10 + k) for k in range(3)]
    warm = engine(model)
    for k, q in enumerate(questions):
        got = decode(warm, f"q{k}", preamble + q, 6)
        assert got[0].reused == (0 if k == 0 else 3 * B)  # cold, then the preamble's 3 whole blocks
        same(decode(engine(model), "cold", preamble + q, 6), got)
    assert warm.cache.hits == 2 * 3 * B


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_n_samples_of_one_prompt_in_one_call_compute_it_once(model, temperature):
    """RL-shaped: n seeded samples of one prompt arrive in one call; the first computes the
    prompt, the rest go to the next forward and map it. Each equals its sample decoded cold."""
    prompt = tokens(model, 2 * B + 9, seed=2)
    warm = engine(model)
    items = [VerifyItem(rid=f"s{k}", pos=len(prompt) - 1, tokens=prompt, prompt_len=len(prompt),
                        temperature=temperature, seed=k + 1) for k in range(4)]
    first = warm.step(items)
    assert [r.reused for r in first] == [0, 2 * B, 2 * B, 2 * B]
    assert [r.batch_requests for r in first] == [1, 3, 3, 3]
    for k, r in enumerate(first):
        cold = decode(engine(model), "cold", prompt, 1, temperature, seed=k + 1)[1][0]
        assert (r.token, r.margin) == cold[:2] and torch.equal(r.logits.cpu(), cold[2])


def test_a_digest_collision_reuses_nothing(model, monkeypatch):
    """Guard: every block's digest made equal, a prompt that differs maps no block of another's
    (its tokens are compared), and its answer is the cold one."""
    monkeypatch.setattr(prefix, "block_key", lambda parent, toks: b"same-digest")
    warm = engine(model)
    decode(warm, "a", tokens(model, 3 * B, seed=3), 2)
    other = tokens(model, 3 * B, seed=4)
    got = decode(warm, "b", other, 4)
    assert got[0].reused == 0
    same(decode(engine(model), "cold", other, 4), got)


def test_a_cut_inside_a_mapped_prefix_leaves_the_cache_intact(model):
    """Guard: b maps a's prompt blocks, then is rewound inside them and fed other tokens; its
    writes go to slots of its own, so a (still live) and a later c mapping the prompt read the
    prompt's K/V, not b's."""
    prompt = tokens(model, 3 * B + 1, seed=5)
    warm = engine(model)
    a_first = warm.step([VerifyItem(rid="a", pos=len(prompt) - 1, tokens=prompt, prompt_len=len(prompt))])[0]
    b_first = warm.step([VerifyItem(rid="b", pos=len(prompt) - 1, tokens=prompt, prompt_len=len(prompt))])[0]
    assert b_first.reused == 3 * B and (b_first.token, b_first.margin) == (a_first.token, a_first.margin)
    cached = {s for blk in warm.cache.blocks.values() for s in blk.slots}
    other = tokens(model, 20, seed=6)
    cut = warm.step([VerifyItem(rid="b", pos=B + 4 + len(other) - 1, tokens=other, rewind=True)])[0]
    assert not isinstance(cut, ErrorReply)
    assert not set(warm.seqs["b"].slots[B + 4:]) & cached  # b's new positions: its own slots
    a_next = warm.step([VerifyItem(rid="a", pos=len(prompt), tokens=[a_first.token])])[0]
    cold = engine(model)
    cold.step([VerifyItem(rid="a", pos=len(prompt) - 1, tokens=prompt, prompt_len=len(prompt))])
    ref = cold.step([VerifyItem(rid="a", pos=len(prompt), tokens=[a_first.token])])[0]
    assert (a_next.token, a_next.margin) == (ref.token, ref.margin)
    assert torch.equal(a_next.logits.cpu(), ref.logits.cpu())
    same(decode(engine(model), "cold", prompt, 3), decode(warm, "c", prompt, 3))


def test_eviction_takes_unmapped_blocks_only(model):
    """A full pool gives up cached blocks no request maps (least recently used first), never a
    live request's mapped ones; an evicted prefix is computed again, with the same bits."""
    prompt = tokens(model, 3 * B + 1, seed=7)
    small = engine(model, pool_tokens=4 * B + 8)  # 71 usable slots
    decode(small, "a", prompt, 2)  # released: its 3 whole blocks stay cached, unmapped
    assert len(small.cache) == 3 and small.pool_used == 3 * B
    first = set(small.cache.blocks)
    big = tokens(model, 4 * B, seed=8)
    assert not isinstance(small.step([VerifyItem(rid="x", pos=len(big) - 1, tokens=big)])[0], ErrorReply)
    assert not first & set(small.cache.blocks)  # room was made from the cache (x's blocks cached now)
    small.release("x")
    again = decode(small, "a2", prompt, 3)
    same(decode(engine(model), "cold", prompt, 3), again)
    # a live request's mapped blocks are never evicted: a request that needs them gets NO_CAPACITY
    small.step([VerifyItem(rid="live", pos=len(prompt) - 1, tokens=prompt, prompt_len=len(prompt))])
    held = [b for b in small.cache.blocks.values() if b.refs]
    out = small.step([VerifyItem(rid="y", pos=len(big) - 1, tokens=big)])[0]
    assert isinstance(out, ErrorReply) and out.code == ErrorCode.NO_CAPACITY
    assert all(b.key in small.cache.blocks for b in held)


def chunked(eng, rid, prompt, chunk, n, temperature=0.0, seed=0):
    """decode() with the prompt sent as the controller's catch-up sends a long one: items of
    `chunk` tokens (the first naming the prompt's length), then the rest; [reused per chunk] too."""
    reused = []
    for a in range(0, len(prompt) - chunk, chunk):
        r = eng.step([VerifyItem(rid=rid, pos=a + chunk - 1, tokens=prompt[a:a + chunk],
                                 prompt_len=len(prompt) if a == 0 else 0, temperature=temperature, seed=seed)])[0]
        assert not isinstance(r, ErrorReply), r
        reused.append(r.reused)
    res = decode(eng, rid, prompt, n, temperature, seed, release=False, start=len(reused) * chunk)
    reused.append(res[0].reused)
    return reused, res


def test_a_preamble_longer_than_a_call_is_mapped_chunk_by_chunk(model):
    """A preamble longer than one call's rows goes in chunks; a later request maps its cached
    blocks in every chunk, not only the first (each chunk computes its last block: its last row
    gives the chunk's answer), and equals an engine that computed it cold in one item."""
    preamble = tokens(model, 6 * B + 3, seed=11)
    warm = engine(model)
    got = []
    for k in range(3):
        prompt = preamble + tokens(model, 5 + k, seed=20 + k)
        reused, res = chunked(warm, f"q{k}", prompt, 2 * B, 4)
        # cold, then in each 2-block chunk one mapped (its second is its last row's), the rest computed
        assert reused == ([0, 0, 0, 0] if k == 0 else [B, B, B, 0])
        same(decode(engine(model), "cold", prompt, 4, release=False), res)
        got.append(res)
        warm.release(f"q{k}")
    assert warm.cache.hits == 2 * 3 * B


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_n_samples_of_a_long_prompt_compute_each_chunk_once(model, temperature):
    """n samples of a prompt longer than a call, their chunks sent together as the controller's
    arrival does: a chunk's block computed by one sample is mapped by the others (the same call's
    next forward), and blocks computed beside an equal one become the cache's (their slots freed);
    each sample equals its cold decode."""
    prompt = tokens(model, 4 * B + 7, seed=12)
    warm = engine(model)
    n = 4
    for a in (0, 2 * B):  # the first two chunks of 2 blocks: all samples in one call each
        got = warm.step([VerifyItem(rid=f"s{k}", pos=a + 2 * B - 1, tokens=prompt[a:a + 2 * B],
                                    prompt_len=len(prompt) if a == 0 else 0, temperature=temperature,
                                    seed=k + 1) for k in range(n)])
        assert [r.reused for r in got] == [0] + [B] * (n - 1)
        assert [r.batch_requests for r in got] == [1] + [n - 1] * (n - 1)
    held = {s for st in warm.seqs.values() for s in st.slots}
    assert len(held) == 4 * B  # every sample's 64 positions are the cache's 4 blocks
    for k in range(n):
        last = warm.step([VerifyItem(rid=f"s{k}", pos=len(prompt) - 1, tokens=prompt[4 * B:],
                                     temperature=temperature, seed=k + 1)])[0]
        cold = decode(engine(model), "cold", prompt, 1, temperature, seed=k + 1)[1][0]
        assert (last.token, last.margin) == cold[:2] and torch.equal(last.logits.cpu(), cold[2])


def test_slots_freed_for_a_cached_block_are_never_read_by_the_request_that_freed_them(model):
    """Guard: b computes a block a already cached, maps a's in its place and frees its own; c then
    takes the freed slots and writes other tokens into them; b's next steps and the K/V column of
    its answer read a's block (the cold answer), not c's K/V."""
    prompt = tokens(model, 2 * B + 5, seed=13)
    warm = engine(model)
    warm.step([VerifyItem(rid="a", pos=len(prompt) - 1, tokens=prompt, prompt_len=len(prompt))])
    b = warm.step([VerifyItem(rid="b", pos=B - 1, tokens=prompt[:B], prompt_len=len(prompt))])[0]
    assert b.reused == 0 and warm.seqs["b"].slots == warm.seqs["a"].slots[:B]  # its block is a's now
    freed = set(warm._free[-B:])
    other = tokens(model, 3 * B, seed=14)
    warm.step([VerifyItem(rid="c", pos=len(other) - 1, tokens=other, prompt_len=len(other))])
    assert freed & set(warm.seqs["c"].slots)  # c wrote into the slots b gave back
    a_slot = warm.seqs["a"].slots[B - 1]
    assert torch.equal(b.kv_column, warm.pool.column(a_slot))  # b's answer's K/V column: a's block's
    seq = list(prompt)
    r = warm.step([VerifyItem(rid="b", pos=len(seq) - 1, tokens=seq[B:])])[0]
    ref = engine(model)
    ref.step([VerifyItem(rid="b", pos=B - 1, tokens=prompt[:B], prompt_len=len(prompt))])
    cold = ref.step([VerifyItem(rid="b", pos=len(seq) - 1, tokens=seq[B:])])[0]
    assert (r.token, r.margin) == (cold.token, cold.margin) and torch.equal(r.logits.cpu(), cold.logits.cpu())
