"""The verifier's K/V pool is sized to the deterministic load: a request whose shadow K/V it
evicted for others' is computed again from position 0 by the controller (fake verifier), with
the same answer; requests the pool has no room for wait until one leaves it (controller/pool.py)."""

from test_controller import FakeVerifier, _due_check_calls, _window_row, make_ctl, ref_next  # noqa: F401

from mg_server.wire import protocol as P


class EvictingVerifier(FakeVerifier):
    """Forgets the requests named in `evict` (what the engine does to idle ones when it is full)."""

    def __init__(self):
        super().__init__()
        self.evict: set[str] = set()

    def verify_many(self, items, timeout_s=None):
        out = []
        for it in items:
            if it.rid in self.evict:
                self.evict.discard(it.rid)
                self.seen.pop(it.rid, None)
            if it.rid not in self.seen and it.pos + 1 - len(it.tokens) != 0:
                out.append(P.ErrorReply(code=P.ErrorCode.UNKNOWN_REQUEST, message="evicted", rid=it.rid))
            else:
                out += super().verify_many([it], timeout_s)
        return out


def test_an_evicted_request_is_computed_again_from_position_0(make_ctl):  # noqa: F811 - the fixture
    ctl = make_ctl("margin", 0.5)
    ctl.vclient = fake = EvictingVerifier()
    recomputes = ctl.m.recomputes._value.get()  # (the counter is the process's)
    toks = {"a": [1, 2, 3, 4], "b": [5, 6, 7]}
    _due_check_calls(ctl, toks, 3)
    assert ctl.reqs["a"].checked == 3 and ctl.m.recomputes._value.get() == recomputes
    fake.evict.add("a")
    for _ in range(2):  # two more low-margin steps each, then the due check
        for rid, t in toks.items():
            ctl._step([_window_row(t, 1, ref_next(t), 0.1, rid=rid)])
            t.append(ref_next(t))
    ctl.forwards = ctl.window_due
    ctl._idle_turn()
    st = ctl.reqs["a"]
    assert not st.error and st.checked == 5 and ctl.m.recomputes._value.get() == recomputes + 1
    assert fake.seen["a"] == toks["a"][:-1]  # every token seen again, from position 0
    emitted = toks["a"]
    ctl._finish(P.Finish(rid="a", output=emitted[4:]))
    assert ctl._verdict("a").state == "verified"


def test_requests_the_pool_has_no_room_for_wait_until_one_leaves_it(make_ctl):  # noqa: F811
    """A pool of 20 tokens holds two of these requests: the others' checks are parked, and go
    (two at a time) once those it holds have ended; none is computed twice."""
    from types import SimpleNamespace

    ctl = make_ctl("margin", 0.5)
    ctl.vinfo = SimpleNamespace(pool_tokens=20)
    recomputes = ctl.m.recomputes._value.get()  # (the counter is the process's)
    toks = {r: [1 + k, 2, 3, 4, 5, 6] for k, r in enumerate("abcde")}  # 5 requests of ~8 tokens
    calls = _due_check_calls(ctl, toks, 2)
    assert [set(c) for c in ctl.vclient.calls] == [{"a", "b"}] and max(len(c) for c in calls) == 2
    assert set(ctl.parked) == {"c", "d", "e"} and not ctl.checks
    ctl._idle_turn()  # nothing is due while the pool is full
    assert len(ctl.vclient.calls) == 1
    for done in ("ab", "cd"):
        for r in done:
            ctl._finish(P.Finish(rid=r, output=toks[r][6:]))
        ctl._complete(list(done))  # their K/V released: the parked checks are due again
        ctl._idle_turn()
    assert [set(c) for c in ctl.vclient.calls] == [{"a", "b"}, {"c", "d"}, {"e"}]
    assert all(ctl.reqs[r].checked == 2 and not ctl.reqs[r].error for r in toks)
    assert ctl.m.recomputes._value.get() == recomputes


def test_the_finish_barrier_checks_its_own_request_first_when_the_pool_is_full(make_ctl):  # noqa: F811
    """Measured on a GPU at mg's default pool (16,640 tokens, 16 deterministic 8k-token prompts in
    flight): the barrier's request was the one a full pool deferred, and it failed ("1 of 16
    tokens checked"). The barrier's request goes first; the others wait for room in the pool."""
    from types import SimpleNamespace

    ctl = make_ctl("margin", 0.5)
    ctl.vinfo = SimpleNamespace(pool_tokens=20)
    toks = {r: [1 + k, 2, 3, 4, 5, 6] for k, r in enumerate("abcde")}
    for k in range(2):  # two low-margin steps each, no check yet
        for rid, t in toks.items():
            ctl._step([_window_row(t, k, ref_next(t), 0.1, rid=rid)])
            t.append(ref_next(t))
    reply = ctl._check_tail("e")  # the last of five: a pool of 20 holds two of them
    assert not reply.error and reply.verified == 2 and reply.rollback is None
    assert "e" not in ctl.checks and "e" not in ctl.parked and set(ctl.parked)  # others wait, not the barrier's
