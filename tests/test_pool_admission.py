"""The verifier's pool under more live deterministic requests than it holds (controller with a
fake verifier whose pool forgets its least recently used requests, as the engine evicts idle
ones): a request the verifier holds stays until its end, a new one enters when its tokens fit, so
every token is computed about once; before, each arrival and each turn of a check evicted a live
request that its next check computed again from position 0."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from test_controller import FakeVerifier, _window_row, make_ctl, ref_next  # noqa: F401

from mg_server.wire import protocol as P


class PoolVerifier(FakeVerifier):
    """A pool of `pool` tokens: before each item, the least recently used requests outside the
    call are forgotten until the item's new tokens fit (the engine's `_evict_idle`); `rows`
    counts the positions it computes."""

    def __init__(self, pool: int):
        super().__init__()
        self.pool, self.rows, self.used, self.clock = pool, 0, {}, 0

    def verify_many(self, items, timeout_s=None):
        self.clock += 1
        inside = {it.rid for it in items}
        out = []
        for it in items:
            start = it.pos + 1 - len(it.tokens)
            if it.rid not in self.seen and start != 0:
                out.append(P.ErrorReply(code=P.ErrorCode.UNKNOWN_REQUEST, message="evicted", rid=it.rid))
                continue
            held = sum(map(len, self.seen.values()))
            for rid in sorted((r for r in self.seen if r not in inside), key=self.used.get):
                if held + len(it.tokens) <= self.pool:
                    break
                held -= len(self.seen.pop(rid))
            self.rows += len(it.tokens)
            self.used[it.rid] = self.clock
            out += super().verify_many([it], timeout_s)
        return out

    def release(self, rids, timeout_s=None):
        for rid in rids:
            self.seen.pop(rid, None)
        return super().release(rids, timeout_s)


def serve(ctl, n: int, prompt_len: int, answer: int, every: int, held: bool = False,
          seed: int = 0) -> dict[str, list[int]]:
    """n requests of `prompt_len` random tokens, request k arriving at forward k * every; each
    decodes `answer` tokens (30 % of steps low-margin) fast and equal to the verifier's, then
    ends through the finish barrier (CheckTail, then Finish), or (`held`, the GPU's held end)
    decodes a surplus of `due` rows until its end is checked (at most 64, the seam's limit);
    two idle turns a forward."""
    rng = random.Random(seed)
    toks = {f"r{k}": [rng.randrange(50) for _ in range(prompt_len)] for k in range(n)}
    steps = dict.fromkeys(toks, 0)
    live: list[str] = []
    fwd = 0
    while fwd <= (n - 1) * every or live:
        for rid in [r for k, r in enumerate(toks) if k * every == fwd]:
            ctl._arrive(P.Arrive(rid=rid, prompt=list(toks[rid])))
            live.append(rid)
        rows = []
        for rid in live:
            t = toks[rid]
            rows.append(_window_row(t, steps[rid], ref_next(t), 0.1 if rng.random() < 0.3 else 0.9, rid=rid))
            rows[-1].due = steps[rid] >= answer
            t.append(ref_next(t))
            steps[rid] += 1
        ctl._step(rows)
        for _ in range(2):
            ctl._idle_turn()
        for rid in [r for r in live if steps[r] >= answer]:
            if held and ctl.reqs[rid].checked < answer:
                assert steps[rid] < answer + 64, f"{rid}: its held end was not checked in 64 forwards"
                continue
            if not held:
                reply = ctl._check_tail(rid)
                assert not reply.error and reply.verified == answer, (rid, reply)
            ctl._finish(P.Finish(rid=rid, output=toks[rid][prompt_len:prompt_len + answer]))
            del toks[rid][prompt_len + answer:]  # (a held end's surplus is never emitted)
            live.remove(rid)
        fwd += 1
    ctl._complete(list(ctl.pending))
    return toks


@pytest.mark.parametrize("held", [False, True], ids=["barrier", "held-end"])
@pytest.mark.parametrize("every", [0, 6], ids=["burst", "spaced"])
def test_every_token_is_computed_about_once_when_the_pool_holds_two_requests(make_ctl, every, held):  # noqa: F811
    ctl = make_ctl("margin", 0.5)
    prompt_len, answer, n = 150, 40, 8
    ctl.vinfo = SimpleNamespace(pool_tokens=2 * (prompt_len + answer) + 20)
    ctl.vclient = fake = PoolVerifier(ctl.vinfo.pool_tokens)
    recomputes = ctl.m.recomputes._value.get()  # (the counter is the process's)
    toks = serve(ctl, n, prompt_len, answer, every, held)
    assert [ctl._verdict(rid).state for rid in toks] == ["verified"] * n
    tokens = sum(len(t) - 1 for t in toks.values())
    print(f"{every=} {held=}: rows {fake.rows} for {tokens} tokens, recomputes {ctl.m.recomputes._value.get() - recomputes}")
    assert fake.rows <= 1.1 * tokens and ctl.m.recomputes._value.get() == recomputes


def _steps(ctl, toks: dict[str, list[int]], n: int, margin: float = 0.1, due=()) -> None:
    """n forwards of every request in `toks` (a token list not stepped before: a new request)."""
    started = ctl.__dict__.setdefault("_test_started", {})  # rid -> (its token list, its prompt's length)
    for _ in range(n):
        for rid, t in toks.items():
            if started.get(rid, (None,))[0] is not t:
                started[rid] = (t, len(t))
            row = _window_row(t, len(t) - started[rid][1], ref_next(t), margin, rid=rid)
            row.due = rid in due
            ctl._step([row])
            t.append(ref_next(t))


def test_n_samples_of_one_prompt_count_its_shared_blocks_once(make_ctl):  # noqa: F811
    """The verifier maps a prompt's whole blocks an earlier request computed: four requests of one
    40-token prompt take 32 shared positions once, so all four fit a pool of 100; two enter first
    (blocks computed beside each other in one forward are not shared), the others at the next
    window check."""
    ctl = make_ctl("margin", 0.5)
    ctl.vinfo = SimpleNamespace(pool_tokens=100)
    toks = {f"s{k}": [7] * 40 for k in range(4)}
    _steps(ctl, toks, 3)
    ctl.forwards = ctl.window_due
    ctl._idle_turn()
    assert set(ctl.parked) == {"s2", "s3"}
    _steps(ctl, toks, 1)
    ctl.forwards = ctl.window_due
    ctl._idle_turn()
    assert not ctl.parked and all(ctl.reqs[r].checked == 4 for r in toks)


def test_a_call_ending_inside_shared_blocks_counts_its_last_block():
    """A chunk whose end lies inside the cached blocks computes its last block (an item never maps
    its last position) before the engine frees it for the cache's: counted, or the pool overfills."""
    from mg_server.controller.pool import Held
    from mg_server.controller.state import ReqState

    a, b = ReqState(tokens=list(range(100)) * 4, prompt_len=400), ReqState(tokens=list(range(100)) * 4, prompt_len=400)
    for chunk, extra in ((256, 16), (512, 0)):  # 384 shared positions: one 256-row call ends inside them
        held = Held(chunk)
        held.take("a", a, 400)
        assert held.need(b) == 400 - 384 + extra


def test_a_long_request_is_not_overtaken_by_younger_short_ones(make_ctl):  # noqa: F811
    ctl = make_ctl("margin", 0.5)
    ctl.vinfo = SimpleNamespace(pool_tokens=100)
    toks = {"a": [1] * 50, "long": [2] * 60}
    _steps(ctl, toks, 2)
    ctl.forwards = ctl.window_due
    ctl._idle_turn()
    assert ctl.reqs["a"].checked == 2 and set(ctl.parked) == {"long"}
    toks["short"] = [3] * 10  # fits beside a, but "long" waits first
    _steps(ctl, toks, 2)
    ctl.forwards = ctl.window_due
    ctl._idle_turn()
    assert set(ctl.parked) == {"long", "short"}
    ctl._finish(P.Finish(rid="a", output=toks.pop("a")[50:]))
    ctl._complete(["a"])
    ctl._idle_turn()
    assert ctl.reqs["long"].checked == 4 and ctl.reqs["short"].checked == 2 and not ctl.parked


def test_a_swept_arrival_frees_its_room_for_a_parked_request(make_ctl, monkeypatch):  # noqa: F811
    """An arrival computed and then aborted in SGLang's queue (no step, no Finish) holds room until
    its sweep; the sweep's release lets the parked request in."""
    from mg_server.controller import arrivals

    ctl = make_ctl("margin", 0.5)
    ctl.vinfo = SimpleNamespace(pool_tokens=40)
    ctl.vclient = PoolVerifier(40)
    monkeypatch.setattr(arrivals, "PREFILL_HOLD_S", 0.0)
    ctl.handle(P.Arrive(rid="gone", prompt=[4] * 30))
    ctl._idle_turn()
    assert ctl.reqs["gone"].verifier_len == 30
    toks = {"b": [5] * 20}
    _steps(ctl, toks, 3)
    ctl.forwards = ctl.window_due
    ctl._idle_turn()
    assert set(ctl.parked) == {"b"}
    monkeypatch.setattr(arrivals, "ARRIVAL_TTL_S", 0.0)
    ctl._arrivals_swept = 0.0
    ctl._sweep_arrivals()
    ctl._idle_turn()
    assert "gone" not in ctl.reqs and not ctl.parked and ctl.reqs["b"].checked == 3


def test_a_parked_held_end_waits_without_a_call_every_forward(make_ctl):  # noqa: F811
    """A held end with no room waits DUE_PATIENCE forwards, its surplus rows asking for no check
    (a window check each forward would read the verifier's weights each forward), then enters."""
    from mg_server.controller.pool import DUE_PATIENCE

    ctl = make_ctl("margin", 0.5)
    ctl.vinfo = SimpleNamespace(pool_tokens=120)
    ctl.vclient = fake = PoolVerifier(120)
    toks = {"a": [1] * 50, "b": [2] * 50, "c": [3] * 60}
    _steps(ctl, toks, 3)
    ctl.forwards = ctl.window_due
    ctl._idle_turn()
    assert set(ctl.parked) == {"c"}
    calls = len(fake.calls)
    for _ in range(DUE_PATIENCE - 1):
        _steps(ctl, toks, 1, margin=0.9, due={"c"})
        ctl._idle_turn()
    assert "c" in ctl.parked and len(fake.calls) == calls  # no call while it waits
    for _ in range(4):
        _steps(ctl, toks, 1, margin=0.9, due={"c"})
        for _ in range(3):
            ctl._idle_turn()
    assert "c" not in ctl.parked and ctl.reqs["c"].checked >= 3


def test_requests_that_outgrow_the_pool_are_evicted_once_not_in_turns(make_ctl):  # noqa: F811
    """Two requests enter at their prompts' length and their answers outgrow the pool: the one
    the verifier evicts waits for room and is computed again once (before: 3.3x the tokens, each
    eviction's recompute evicting the next)."""
    ctl = make_ctl("margin", 0.5)
    ctl.vinfo = SimpleNamespace(pool_tokens=2 * 150 + 60)
    ctl.vclient = fake = PoolVerifier(ctl.vinfo.pool_tokens)
    toks = serve(ctl, 4, 150, 120, 0)
    assert [ctl._verdict(rid).state for rid in toks] == ["verified"] * 4
    assert fake.rows <= 1.3 * sum(len(t) - 1 for t in toks.values())


class EngineClient:
    """The controller's verifier client over a real CPU engine (no worker process)."""

    def __init__(self, engine):
        self.engine, self.rows, self.unknown = engine, 0, 0

    def verify_many(self, items, timeout_s=None):
        out = []
        for it, r in zip(items, self.engine.step(items)):
            if isinstance(r, P.ErrorReply):
                self.unknown += r.code == P.ErrorCode.UNKNOWN_REQUEST
                out.append(r)
                continue
            self.rows += len(it.tokens) - r.reused
            out.append(P.VerifyResult(rid=r.rid, pos=r.pos, token=r.token, margin=r.margin, audit_tokens=r.audit_tokens,
                                      audit_margins=r.audit_margins, first_mismatch=r.first_mismatch, reused=r.reused))
        return out

    def release(self, rids, timeout_s=None):
        return sum(self.engine.release(r) for r in rids)

    def close(self):
        pass


def test_samples_of_a_prompt_longer_than_a_call_share_its_blocks(make_ctl, monkeypatch, tmp_path):  # noqa: F811
    """A real CPU engine: a 400-token prompt goes in 256-row chunks, and the prefix cache maps its
    blocks chunk by chunk, so four samples share its 384 whole-block positions (each later sample
    computes each chunk's last block only); counted as the cache maps them, no request is evicted
    and every token is computed once."""
    import torch
    from verifier_helpers import make_tiny

    from mg_server.controller import arrivals
    from mg_server.verifier.engine import VerifierEngine
    from mg_server.verifier.model import VerifierModel

    make_tiny("llama", tmp_path, dtype=torch.bfloat16, seed=5)
    model = VerifierModel.load(tmp_path, torch.bfloat16, "cpu", max_positions=512)
    prompt = torch.randint(0, model.spec.vocab, (400,), generator=torch.Generator().manual_seed(3)).tolist()
    ref, seq = [], list(prompt)
    alone = VerifierEngine(model, max_requests=2, pool_tokens=1024, max_seq_len=512)
    for k in range(41):  # the verifier-alone answer
        r = alone.step([P.VerifyItem(rid="x", pos=len(seq) - 1, tokens=seq if k == 0 else seq[-1:],
                                     prompt_len=len(seq) if k == 0 else 0)])[0]
        ref.append(r.token)
        seq.append(r.token)
    engine = VerifierEngine(model, max_requests=16, pool_tokens=701, max_seq_len=512, evict_idle_s=0.0)
    ctl = make_ctl("margin", 0.5)
    ctl.vclient = client = EngineClient(engine)
    ctl.vinfo = SimpleNamespace(pool_tokens=engine.pool.n_tokens)
    monkeypatch.setattr(arrivals, "PREFILL_HOLD_S", 0.0)
    toks = {f"s{k}": list(prompt) for k in range(4)}
    for rid in toks:
        ctl._arrive(P.Arrive(rid=rid, prompt=list(prompt)))
    for _ in range(4):
        ctl._idle_turn()
    for k in range(40):
        for rid, t in toks.items():
            ctl._step([_window_row(t, k, ref[k], 0.1, rid=rid)])
            t.append(ref[k])
        ctl._idle_turn()
        ctl._idle_turn()
    for rid in toks:
        assert not ctl._check_tail(rid).error
        ctl._finish(P.Finish(rid=rid, output=toks[rid][400:]))
    ctl._complete(list(ctl.pending))
    assert [ctl._verdict(r).state for r in toks] == ["verified"] * 4
    assert client.unknown == 0 and client.rows <= 1.05 * (400 + 3 * 2 * 16 + 4 * 40)  # (3.8x, then 1.6x before)


def test_a_restarted_verifier_is_not_held_up_by_requests_parked_before(make_ctl, monkeypatch):  # noqa: F811
    from test_controller import Alive

    from mg_server.controller import arrivals

    monkeypatch.setattr(arrivals, "PREFILL_HOLD_S", 0.0)
    ctl = make_ctl("margin", 0.5)
    ctl.vinfo = SimpleNamespace(pool_tokens=100)
    ctl.vclient = PoolVerifier(100)
    toks = {"a": [1] * 60, "p": [2] * 60}
    _steps(ctl, toks, 2)
    ctl.forwards = ctl.window_due
    ctl._idle_turn()
    assert set(ctl.parked) == {"p"}
    ctl._lose("test")  # every live request fails
    ctl.vclient, ctl.verifier_proc, ctl._restart_at, ctl.down_reason = PoolVerifier(100), Alive(), None, ""
    ctl._arrive(P.Arrive(rid="new", prompt=[3] * 10))
    ctl._idle_turn()
    assert ctl.reqs["new"].verifier_len == 10


def test_a_new_request_under_an_old_id_is_the_youngest(make_ctl):  # noqa: F811
    ctl = make_ctl("margin", 0.5)
    ctl.vinfo = SimpleNamespace(pool_tokens=100)
    ctl.vclient = PoolVerifier(100)
    x = {"x": [9] * 5}
    _steps(ctl, x, 1)
    ctl._finish(P.Finish(rid="x", output=x["x"][5:]))
    ctl._complete(["x"])  # its verdict kept: "x" stays in the controller's table
    toks = {"a": [1] * 50, "old": [2] * 55}
    _steps(ctl, toks, 2)
    ctl.forwards = ctl.window_due
    ctl._idle_turn()
    assert set(ctl.parked) == {"old"}
    young = {"x": [3] * 45}
    _steps(ctl, young, 2)  # a new request under the finished one's id
    assert ctl.reqs["x"].prompt_len == 45
    ctl._finish(P.Finish(rid="a", output=toks["a"][50:]))
    ctl._complete(["a"])  # room for one of them: the older
    ctl._all_window_checks()
    ctl._run_checks()
    assert ctl.reqs["old"].checked == 2 and ctl.reqs["x"].checked == 0
