"""Batch/chunk/gap invariance of the in-process verifier engine, on CPU (tiny models) and CUDA.

Every scenario reaches the same positions as a gap-1 reference in another way and must be
bitwise equal to it (argmax, margin, logits, K/V columns, whole shadow cache).
"""

from __future__ import annotations

import pytest
import torch

from verifier_helpers import Trace, assert_same, drive, make_tiny, schedule, smollm2_shaped

from mg_server.verifier import ops
from mg_server.verifier.engine import VerifierEngine
from mg_server.verifier.model import VerifierModel
from mg_server.verifier.prefix import BLOCK
from mg_server.wire.protocol import ErrorCode, ErrorReply, VerifyItem

SMALL_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # graphs of <= 128 rows: long forwards replay in chunks
N_PROMPT, N_GEN = 21, 72  # total 93 positions: room for a 64-token catch-up after the prompt

CASES = [
    pytest.param(("cpu", "llama"), id="cpu-llama"),
    pytest.param(("cpu", "qwen3"), id="cpu-qwen3"),
    pytest.param(("cuda", "qwen2"), id="cuda-qwen2", marks=pytest.mark.gpu),
    pytest.param(("cuda", "smollm2-shaped"), id="cuda-smollm2-shaped", marks=pytest.mark.gpu),
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()  # wall time only: results do not depend on threads
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=CASES)
def setup(request, tmp_path_factory):
    device, kind = request.param
    d = tmp_path_factory.mktemp(kind)
    if kind == "smollm2-shaped":
        smollm2_shaped(d)
    else:
        make_tiny(kind, d, dtype=torch.bfloat16, seed=3)
    model = VerifierModel.load(d, torch.bfloat16, device, max_positions=256)
    engine = VerifierEngine(model, max_requests=16, pool_tokens=4096, max_seq_len=256)
    g = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, model.spec.vocab, (N_PROMPT,), generator=g).tolist()
    ref, seq = drive(engine, "ref", prompt, list(range(N_PROMPT - 1, N_PROMPT + N_GEN - 1)))
    others = [(f"o{i}", torch.randint(0, model.spec.vocab, (3 + 5 * i,), generator=g).tolist()) for i in range(8)]
    return d, engine, ref, seq, others


def test_cuda_graphs_equal_the_eager_forward(setup):
    """On CUDA the engine replays captured graphs for forwards of <= 640 rows (the reference run
    here); an engine without graphs runs every forward op by op: the bits must not differ."""
    _, engine, ref, seq, others = setup
    if engine.graphs is None:
        pytest.skip("CUDA graphs exist on CUDA devices only")
    assert engine.graph_forwards > 0
    eager = VerifierEngine(engine.model, max_requests=16, pool_tokens=4096, max_seq_len=256, cuda_graphs=False)
    got, _ = drive(eager, "e", seq, schedule(N_PROMPT, len(seq), 3), others[:3])
    assert_same(ref, got)
    assert eager.graph_forwards == 0


def test_a_forward_of_more_rows_than_the_largest_graph_replays_graph_chunks(setup):
    """A verify call carrying more rows than the largest graph (here 7 other prompts, then one
    request's whole sequence: 218 rows) runs as successive graph replays of <= 128 rows (an
    engine whose largest graph holds 128), not op by op (10x slower); the request straddles two
    replays and its bits equal the gap-1 run's."""
    _, engine, ref, seq, others = setup
    if engine.graphs is None:
        pytest.skip("CUDA graphs exist on CUDA devices only")
    engine = VerifierEngine(engine.model, max_requests=16, pool_tokens=4096, max_seq_len=256,
                            graph_buckets=SMALL_BUCKETS)
    others = others[:7]
    first = sum(len(p) for _, p in others)  # rows before the request's: 126
    n = len(seq) - 1
    assert first < engine.graphs.max_rows < first + n
    replays = engine.graph_forwards
    items = [VerifyItem(rid=o, pos=len(p) - 1, tokens=p) for o, p in others]
    items.append(VerifyItem(rid="big", pos=n - 1, tokens=seq[:n], prompt_len=N_PROMPT))
    outs = engine.step(items)
    assert engine.graph_forwards - replays == 2
    got = Trace()
    got.record(0, outs[-1])
    st = engine.seqs["big"]
    idx = torch.tensor(st.slots)
    got.cache = torch.stack([engine.pool.k[:, idx], engine.pool.v[:, idx]], 1).cpu().clone()
    for o, p in others:  # each other request's answer equals its own forward's alone
        alone = engine.step([VerifyItem(rid=o + "-alone", pos=len(p) - 1, tokens=p)])[0]
        res = outs[[it.rid for it in items].index(o)]
        assert (alone.token, alone.margin) == (res.token, res.margin)
        assert torch.equal(alone.logits, res.logits) and torch.equal(alone.kv_column, res.kv_column)
        engine.release(o)
        engine.release(o + "-alone")
    engine.release("big")
    assert_same(ref, got)


class _ReplayedRows:
    """RowGraphs' interface on the CPU: each run overwrites one [max_rows, V] output buffer, as a
    graph replay overwrites its static outputs (so the engine must copy out what it keeps)."""

    def __init__(self, engine: VerifierEngine, max_rows: int):
        self.engine, self.max_rows = engine, max_rows
        self.out = None
        self.kept = torch.full((engine.max_requests, engine.model.spec.vocab), float("nan"))

    def read(self, x):
        return x.tolist()

    def run(self, tokens, positions, slots, table_rows):
        e = self.engine
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        e.kv_table[t(table_rows), t(positions)] = t(slots)  # as the graph does (the engine leaves it to it)
        logits = e.model.forward_rows(t(tokens), t(positions), t(slots), t(table_rows), e.kv_table, e.pool,
                                      e.max_seq_len)  # [R, V] fp32
        if self.out is None:
            self.out = torch.empty((self.max_rows, logits.shape[1]), dtype=logits.dtype)
        r = len(tokens)
        self.out.fill_(-1)
        self.out[:r] = logits
        return self.out[:r], ops.margin_rows(logits).tolist()  # as RowGraphs.run: [margin, argmax] per row


def test_graph_chunks_on_cpu_replay_rows_in_order(setup):
    """The chunking logic without CUDA: replays of <= 16 rows over a 185-row first forward and
    64-row catch-ups, through a stand-in whose outputs each replay overwrites: same bits."""
    d, engine, ref, seq, others = setup
    if engine.model.device.type != "cpu":
        pytest.skip("the CUDA cases replay real graphs (test above)")
    chunked = VerifierEngine(engine.model, max_requests=16, pool_tokens=4096, max_seq_len=256)
    chunked.graphs = _ReplayedRows(chunked, 16)
    got, _ = drive(chunked, "r", seq, schedule(N_PROMPT, len(seq), 64), others=others)
    assert_same(ref, got)
    assert chunked.graph_forwards > 2 * chunked.forwards


@pytest.mark.parametrize("replays", ["cpu-stand-in", "cuda-graphs"])
def test_seeded_rows_straddling_graph_chunks_are_decided_per_replay(setup, replays):
    """A seeded request's catch-up over two replays (its rows decided after their own replay,
    read back through RowGraphs.read): tokens and margins equal those of one op-by-op forward,
    and the greedy request beside it keeps its bits too."""
    _, engine, _, seq, others = setup
    if (replays == "cuda-graphs") != (engine.graphs is not None):
        pytest.skip("the stand-in runs on CPU, the graphs on CUDA")
    if engine.graphs is None:
        engine = VerifierEngine(engine.model, max_requests=16, pool_tokens=4096, max_seq_len=256)
        engine.graphs = _ReplayedRows(engine, 16)
    else:
        engine = VerifierEngine(engine.model, max_requests=16, pool_tokens=4096, max_seq_len=256,
                                graph_buckets=SMALL_BUCKETS)
    eager = VerifierEngine(engine.model, max_requests=16, pool_tokens=4096, max_seq_len=256, cuda_graphs=False)
    n = len(seq) - 1
    greedy = others[:7]  # 126 rows first: the seeded request starts 2 rows before a 128-row replay ends

    def items(tag):
        return [*(VerifyItem(rid=tag + o, pos=len(p) - 1, tokens=p) for o, p in greedy),
                VerifyItem(rid=tag + "s", pos=n - 1, tokens=seq[:n], prompt_len=N_PROMPT, temperature=1e4, seed=11)]

    before = engine.graph_forwards
    try:
        got, want = engine.step(items("g")), eager.step(items("e"))
        assert engine.graph_forwards - before >= 2  # the seeded request straddles replays
        for a, b in zip(got, want):
            assert (a.token, a.margin, a.audit_tokens, a.audit_margins) == (b.token, b.margin, b.audit_tokens,
                                                                            b.audit_margins)
            assert torch.equal(a.logits.cpu(), b.logits.cpu()) and torch.equal(a.kv_column.cpu(), b.kv_column.cpu())
        # sampled, not the greedy reference (why T = 1e4: the CUDA stand-in's random weights give
        # margins that a T of 0.7 and of 4 left untouched; here the Gumbel noise decides)
        assert got[-1].audit_tokens[N_PROMPT:] != seq[N_PROMPT + 1:n]
    finally:
        for e, tag in ((engine, "g"), (eager, "e")):
            for it in items(tag):
                e.release(it.rid)


def test_prompt_chunkings(setup):
    _, engine, ref, seq, _ = setup
    for chunks in ([1] * N_PROMPT, [4, 9, 8], [N_PROMPT - 1, 1]):
        got, _ = drive(engine, "c", seq, schedule(N_PROMPT, len(seq), 1, chunks))
        assert_same(ref, got)


@pytest.mark.parametrize("gap", [1, 7, 64])
def test_catch_up_gaps(setup, gap):
    _, engine, ref, seq, _ = setup
    got, _ = drive(engine, "g", seq, schedule(N_PROMPT, len(seq), gap))
    assert_same(ref, got)
    assert set(got.pred) == set(range(len(seq) - 1))


@pytest.mark.parametrize("widths", [(17,) * 8, (65,) * 8, (1, 5, 17, 33, 65, 9, 2, 64)],
                         ids=["8x17", "8x65", "mixed"])
def test_windows_of_many_requests_equal_the_gap_one_run(setup, widths):
    """Windows: every request's pending rows in one forward (8 prompts of 15 + 6 rows, then 8 x 17 =
    136 rows, 8 x 65 = 520 rows or mixed widths, each request the same tokens in its own table):
    every row's argmax and margin, every answer's logits and K/V, and each whole shadow cache
    equal the gap-1 run's. On CUDA these take the 192..640-row graphs, where attention's segments
    hold up to 16 of a request's rows, where the reference took one-row graphs and one-row
    segments: neither the bucket nor the other rows change a bit."""
    _, engine, ref, seq, _ = setup
    PART = BLOCK - 1
    rids = [f"w{k}" for k in range(len(widths))]
    traces = {r: Trace() for r in rids}
    held = dict.fromkeys(rids, 0)  # positions each request's shadow cache holds
    rows = []
    while True:
        items = []
        for r, w in zip(rids, widths):
            a = held[r]
            # teacher-force positions a .. b-1; the prompt first in one block's less (identical prompts
            # of one call are computed once, verifier/prefix.py: this test wants each computed)
            b = PART if a == 0 else N_PROMPT if a == PART else min(a + w, len(seq) - 1)
            if a < b:
                items.append(VerifyItem(rid=r, pos=b - 1, tokens=seq[a:b], prompt_len=N_PROMPT))
        if not items:
            break
        rows.append(sum(len(it.tokens) for it in items))
        for it, res in zip(items, engine.step(items)):
            assert not isinstance(res, ErrorReply), res
            traces[it.rid].record(held[it.rid], res)
            held[it.rid] = it.pos + 1
    assert max(rows) == max(8 * PART, sum(widths))
    for r in rids:
        idx = torch.tensor(engine.seqs[r].slots)
        traces[r].cache = torch.stack([engine.pool.k[:, idx], engine.pool.v[:, idx]], 1).cpu().clone()
        engine.release(r)
        assert_same(ref, traces[r])
        assert set(traces[r].pred) == set(range(len(seq) - 1))


@pytest.mark.parametrize("n_others", [1, 8])
def test_other_requests_in_the_same_forward(setup, n_others):
    _, engine, ref, seq, others = setup
    got, _ = drive(engine, "b", seq, schedule(N_PROMPT, len(seq), 1), others=others[:n_others])
    assert_same(ref, got)
    assert max(got.batch_requests) == n_others + 1


def test_fresh_model_instance_agrees(setup):
    d, engine, ref, seq, _ = setup
    model = VerifierModel.load(d, torch.bfloat16, engine.model.device, max_positions=128)
    fresh = VerifierEngine(model, max_requests=2, pool_tokens=512, max_seq_len=128)
    got, _ = drive(fresh, "f", seq, schedule(N_PROMPT, len(seq), 5))
    assert_same(ref, got)


def test_audit_reports_the_first_divergence(setup):
    _, engine, ref, seq, _ = setup
    bad = list(seq)
    p = N_PROMPT + 10
    bad[p] = (bad[p] + 1) % engine.model.spec.vocab  # the caller emitted another token at p
    out = engine.step([VerifyItem(rid="x", pos=N_PROMPT + 20, tokens=bad[: N_PROMPT + 21],
                                  prompt_len=N_PROMPT)])[0]
    assert out.first_mismatch == p - 1
    assert engine.release("x")
    good = engine.step([VerifyItem(rid="y", pos=N_PROMPT - 1, tokens=seq[:N_PROMPT])])[0]
    assert good.first_mismatch == -1  # prompt tokens are not audited
    out = engine.step([VerifyItem(rid="y", pos=N_PROMPT + 20, tokens=bad[N_PROMPT: N_PROMPT + 21])])[0]
    assert out.first_mismatch == p - 1
    assert engine.release("y")
    first = engine.step([VerifyItem(rid="z", pos=N_PROMPT - 1, tokens=seq[:N_PROMPT])])[0]
    bad2 = list(seq)
    bad2[N_PROMPT] = (first.token + 1) % engine.model.spec.vocab  # differs from the verified token
    out = engine.step([VerifyItem(rid="z", pos=N_PROMPT + 3, tokens=bad2[N_PROMPT: N_PROMPT + 4])])[0]
    assert out.first_mismatch == N_PROMPT - 1
    assert engine.release("z")


def test_engine_errors(setup):
    _, engine, _, seq, _ = setup
    out = engine.step([VerifyItem(rid="u", pos=5, tokens=[1])])[0]
    assert isinstance(out, ErrorReply) and out.code == ErrorCode.UNKNOWN_REQUEST
    out = engine.step([VerifyItem(rid="t", pos=300, tokens=seq[:1] * 301)])[0]
    assert isinstance(out, ErrorReply) and out.code == ErrorCode.TOO_LONG
    assert not engine.seqs and engine.pool_used == engine.cache.idle_slots  # (cached blocks only)


def test_idle_requests_are_evicted_when_full(setup):
    d, engine, _, seq, _ = setup
    small = VerifierEngine(engine.model, max_requests=2, pool_tokens=64, max_seq_len=64, evict_idle_s=0.0)
    for rid in ("a", "b"):
        assert not isinstance(small.step([VerifyItem(rid=rid, pos=9, tokens=seq[:10])])[0], ErrorReply)
    assert not isinstance(small.step([VerifyItem(rid="c", pos=9, tokens=seq[:10])])[0], ErrorReply)
    assert "a" not in small.seqs and set(small.seqs) == {"b", "c"}  # least recently used went first
    out = small.step([VerifyItem(rid="a", pos=10, tokens=seq[10:11])])[0]
    assert out.code == ErrorCode.UNKNOWN_REQUEST
    strict = VerifierEngine(engine.model, max_requests=1, pool_tokens=64, max_seq_len=64)
    strict.step([VerifyItem(rid="a", pos=9, tokens=seq[:10])])
    out = strict.step([VerifyItem(rid="b", pos=9, tokens=seq[:10])])[0]
    assert out.code == ErrorCode.NO_CAPACITY


def test_eviction_spares_the_requests_of_the_same_forward(setup):
    """A new request that needs room evicts an idle one, never one admitted earlier in its own
    call, even when that one is the least recently used."""
    _, engine, _, seq, _ = setup
    small = VerifierEngine(engine.model, max_requests=2, pool_tokens=64, max_seq_len=64, evict_idle_s=0.0)
    for rid in ("a", "b"):  # "a" is the least recently used
        small.step([VerifyItem(rid=rid, pos=9, tokens=seq[:10])])
    out = small.step([VerifyItem(rid="a", pos=10, tokens=seq[10:11]), VerifyItem(rid="c", pos=9, tokens=seq[:10])])
    assert not any(isinstance(o, ErrorReply) for o in out)
    assert set(small.seqs) == {"a", "c"}


def test_items_that_fit_the_pool_alone_but_not_together_get_no_capacity(setup):
    """One forward's items each fit the free slots, together they do not (32 finished requests'
    tail audits in one call, on the H100): the last ones get NO_CAPACITY, the rest are served,
    and nothing raises (it was an IndexError that failed every request of the call)."""
    _, engine, _, seq, _ = setup
    small = VerifierEngine(engine.model, max_requests=4, pool_tokens=32, max_seq_len=64)  # 31 free slots
    solo = VerifierEngine(engine.model, max_requests=4, pool_tokens=32, max_seq_len=64)
    items = [VerifyItem(rid=r, pos=11, tokens=seq[:12]) for r in ("a", "b", "c")]  # 12 + 12 fit, + 12 not
    out = small.step(items)
    assert [type(o).__name__ for o in out] == ["StepOutput", "StepOutput", "ErrorReply"]
    assert out[2].code == ErrorCode.NO_CAPACITY and set(small.seqs) == {"a", "b"} and small.pool_used == 24
    assert out[0].token == solo.step([items[0]])[0].token  # served as it would be alone


def test_a_request_whose_slots_were_reused_is_refused_then_computed_again(setup):
    """Isolation in the verifier's own pool: once an idle request is evicted and another's K/V
    is written into its slots, its next item gets UNKNOWN_REQUEST (never a forward over the
    other's K/V), and computed again from position 0 it gets the tokens a fresh engine gives."""
    _, engine, _, seq, _ = setup
    small = VerifierEngine(engine.model, max_requests=2, pool_tokens=40, max_seq_len=64, evict_idle_s=0.0)
    fresh = VerifierEngine(engine.model, max_requests=2, pool_tokens=40, max_seq_len=64)
    a = seq[:30]
    first = small.step([VerifyItem(rid="a", pos=29, tokens=a)])[0]
    slots_a = set(small.seqs["a"].slots)
    small.step([VerifyItem(rid="b", pos=29, tokens=seq[1:31])])  # needs a's slots: a is evicted
    assert "a" not in small.seqs and slots_a & set(small.seqs["b"].slots)
    out = small.step([VerifyItem(rid="a", pos=30, tokens=seq[30:31])])[0]
    assert isinstance(out, ErrorReply) and out.code == ErrorCode.UNKNOWN_REQUEST
    again = small.step([VerifyItem(rid="a", pos=30, tokens=seq[:31])])[0]  # b evicted in turn
    ref = [fresh.step([VerifyItem(rid="a", pos=29, tokens=a)])[0], fresh.step([VerifyItem(rid="a", pos=30,
                                                                                         tokens=seq[30:31])])[0]]
    assert (first.token, first.margin) == (ref[0].token, ref[0].margin)
    assert (again.token, again.margin) == (ref[1].token, ref[1].margin)
