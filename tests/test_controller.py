"""MarginGate policy and the controller's decisions, audit and verdicts (fake verifier)."""

import math
from types import SimpleNamespace

import pytest

from mg_server.runtime import protocol as P
from mg_server.runtime.controller.server import Controller, ControllerConfig
from mg_server.runtime.controller.window import CHECK_DELAY_FORWARDS
from mg_server.runtime.policy import Policy, resolve_tau


def test_policy_modes():
    assert not Policy("off", 1.0).should_verify(0.0)
    assert Policy("always", 1.0).should_verify(100.0)
    m = Policy("margin", 0.5)
    assert m.should_verify(0.49) and not m.should_verify(0.5) and not m.should_verify(3.0)
    assert m.should_verify(math.nan)  # broken logits are never fast-committed
    assert not Policy("margin", 0.0).should_verify(0.0)
    with pytest.raises(ValueError):
        Policy("sometimes", 1.0)
    with pytest.raises(ValueError):
        Policy("margin", -1.0)


def test_tau_from_flag_profile_or_error():
    assert resolve_tau("/x/SmolLM2-135M-Instruct", 0.3) == (0.3, "flag")
    tau, source = resolve_tau("/x/SmolLM2-135M-Instruct", None)
    assert tau > 0 and "profile" in source
    with pytest.raises(ValueError, match="no tau profile"):
        resolve_tau("/x/unknown-model", None)
    assert resolve_tau("/x/unknown-model", None, "always") == (0.0, "unused in mode always")
    # window commit: tau only orders the checks, so a model without a profile serves with tau 0
    assert resolve_tau("/x/unknown-model", None, "margin", window=True)[0] == 0.0


def ref_next(prefix: list[int]) -> int:
    """The fake verifier's greedy rule."""
    return (sum(prefix) * 31 + len(prefix)) % 50


class FakeVerifier:
    """Follows the protocol: catch-up from the known length, audit of t_{q+1} for q in [start-1, pos-1]."""

    def __init__(self, n_slots: int = 64):
        self.seen: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.items: list[P.VerifyItem] = []
        self.calls: list[list[str]] = []  # the rids of each verify_many call
        self.released: list[str] = []
        self.n_slots, self.last_gen = n_slots, 0  # each result takes the next slot of a ring (gen = count)

    def _slot(self) -> dict:
        self.last_gen += 1
        return {"slot": self.last_gen % self.n_slots, "gen": self.last_gen}

    def verify_many(self, items, timeout_s=None):
        out = []
        self.calls.append([it.rid for it in items])
        for it in items:
            self.items.append(it)
            hist = self.seen.setdefault(it.rid, [])
            start = it.pos + 1 - len(it.tokens)
            if it.rewind and start <= len(hist):
                del hist[start:]
            if start != len(hist):
                out.append(P.ErrorReply(code=P.ErrorCode.POSITION_MISMATCH, message="", rid=it.rid, expected_pos=len(hist)))
                continue
            if not hist:
                self.prompt_len[it.rid] = it.prompt_len or len(it.tokens)
            hist.extend(it.tokens)
            lo = max(start - 1, self.prompt_len[it.rid] - 1, 0)
            first = next((q for q in range(lo, it.pos) if ref_next(hist[: q + 1]) != hist[q + 1]), -1)
            audit = [ref_next(hist[: q + 1]) for q in range(start, it.pos)]  # predictions at start .. pos-1
            out.append(P.VerifyResult(rid=it.rid, pos=it.pos, token=ref_next(hist), margin=1.0, **self._slot(),
                                      audit_tokens=audit, first_mismatch=first))
            if it.chain >= 0 and out[-1].token != it.chain:  # VerifyItem.chain
                hist.append(out[-1].token)
                out[-1].next = P.VerifyResult(rid=it.rid, pos=it.pos + 1, token=ref_next(hist), margin=1.0,
                                              **self._slot())
        return out

    def release(self, rids, timeout_s=None):
        self.released += rids
        return len(rids)


class Alive:
    exitcode = None

    def __init__(self):
        self.alive = True

    def is_alive(self):
        return self.alive


@pytest.fixture()
def make_ctl(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    ctls = []

    def make(mode="margin", tau=0.5, chain=True):  # (chain: --mg-lag-chain, off by default; its tests want it)
        ctl = Controller(ControllerConfig(ipc_path=str(tmp_path / f"c{len(ctls)}.sock"), mode=mode, tau=tau,
                                          metrics_dir=str(tmp_path), chain=chain))
        ctl.vclient, ctl.verifier_proc = FakeVerifier(), Alive()
        ctl.vinfo = SimpleNamespace(shm=SimpleNamespace(n_slots=ctl.vclient.n_slots))  # (the slot ring's size)
        ctls.append(ctl)
        return ctl

    yield make
    for c in ctls:
        c.vclient, c.verifier_proc = None, None
        c.close()


def run_request(ctl, rid, prompt, n_steps, margins, flip_at=None, lookahead=0, aborted="", resumable=False, **end):
    """Drive a request like mg's seam does (the seam emits every decided token); returns the
    emitted tokens. `lookahead` extra steps are decided after the last token, as the overlap
    scheduler's look-ahead forward does, and not emitted."""
    tokens = list(prompt)
    for step in range(n_steps + lookahead):
        pos = len(tokens) - 1
        fast = ref_next(tokens) if step != flip_at else (ref_next(tokens) + 1) % 50
        row = P.StepRow(rid=rid, pos=pos, prompt=list(prompt) if step == 0 else [], margin=margins[step],
                        fast_token=fast, resumable=resumable)
        (d,) = ctl._step([row])
        assert not d.error, d.error
        assert d.token == (d.token if d.verified else fast)
        tokens.append(d.token)
    emitted = tokens[: len(tokens) - lookahead]
    ctl._finish(P.Finish(rid=rid, output=emitted[len(prompt):], aborted=bool(aborted), reason=aborted, **end))
    assert ctl.reqs[rid].state(ctl.cfg.mode) == "running"  # tail audit deferred ...
    return emitted  # ... until the verdict is asked for (or the controller is idle)


def test_margin_mode_verifies_low_margins_with_catch_up(make_ctl):
    ctl = make_ctl("margin", 0.5)
    margins = [2.0, 0.1, 3.0, 3.0, 0.2, 5.0]
    run_request(ctl, "a", [5, 6, 7], 6, margins)
    assert [it.pos for it in ctl.vclient.items] == [3, 6]  # the tail audit has not run yet
    v = ctl._verdict("a")
    items = ctl.vclient.items
    # two verified steps + the final audit of the tail
    assert [it.pos for it in items] == [3, 6, 7]
    # step 0 (pos 2, the prompt's last) was fast-committed; step 1 verifies pos 3 = its token
    assert items[0].tokens[:3] == [5, 6, 7] and len(items[0].tokens) == 4
    assert items[0].prompt_len == 3 and items[1].prompt_len == 0
    assert v.state == "verified" and v.steps == 6 and v.verified_steps == 2 and v.repairs == 0
    assert ctl.vclient.released == ["a"]


def test_flip_at_verified_step_is_repaired(make_ctl):
    ctl = make_ctl("margin", 0.5)
    run_request(ctl, "b", [1, 2], 4, [1.0, 0.1, 1.0, 1.0], flip_at=1)
    v = ctl._verdict("b")
    assert v.repairs == 1 and v.state == "verified"


def test_a_must_row_is_verified_and_repaired_whatever_its_margin(make_ctl):
    """StepRow.must (--mg-commit lag: the fast path read a corrected token): verified although its
    margin is high, and its K/V column repaired although the tokens agree."""
    ctl = make_ctl("margin", 0.5)
    (d,) = ctl._step([P.StepRow(rid="m", pos=1, prompt=[3, 4], margin=9.0, fast_token=ref_next([3, 4]))])
    assert not d.verified and not d.repair
    tok = ref_next([3, 4, d.token])
    (d,) = ctl._step([P.StepRow(rid="m", pos=2, margin=9.0, fast_token=tok, must=True)])
    assert d.verified and d.repair and d.token == tok and d.slot >= 0 and ctl.reqs["m"].repairs == [2]


def test_a_lag_correction_answers_the_next_must_row_from_the_same_verify_call(make_ctl):
    """StepRow.behind (--mg-commit lag): the verify item carries the fast token (VerifyItem.chain);
    on a disagreement the verifier also answers pos + 1 from its own token, and the request's must
    row there is decided from that answer without another verify call. A hold-mode row (not
    behind) and an agreeing behind row chain nothing."""
    ctl = make_ctl("margin", 0.5)
    v = ref_next([3, 4])
    (d,) = ctl._step([P.StepRow(rid="m", pos=1, prompt=[3, 4], margin=0.1, fast_token=(v + 1) % 50, behind=True)])
    assert d.verified and d.repair and d.token == v and ctl.vclient.items[-1].chain == (v + 1) % 50
    calls = len(ctl.vclient.items)
    (d,) = ctl._step([P.StepRow(rid="m", pos=2, margin=9.0, fast_token=ref_next([3, 4, (v + 1) % 50]), must=True)])
    assert len(ctl.vclient.items) == calls and not ctl.chained  # no verify call for the must row
    assert d.verified and d.repair and d.gen == ctl.vclient.last_gen and d.token == ref_next([3, 4, v])
    t = [3, 4, v, d.token]
    (d,) = ctl._step([P.StepRow(rid="m", pos=3, margin=0.1, fast_token=ref_next(t), behind=True)])
    assert d.verified and not d.repair and ctl.vclient.items[-1].tokens == [t[3]] and not ctl.chained
    ctl._finish(P.Finish(rid="m", output=t[2:] + [d.token]))
    v2 = ctl._verdict("m")
    assert v2.state == "verified" and v2.repairs == 2
    (d,) = ctl._step([P.StepRow(rid="h", pos=1, prompt=[3, 4], margin=0.1, fast_token=(v + 1) % 50)])
    assert d.repair and ctl.vclient.items[-1].chain == -1 and not ctl.chained


def test_without_the_chain_a_lag_correction_leaves_the_must_row_its_own_verify_call(make_ctl):
    """--mg-lag-chain off (the default): a behind row's item carries no fast token, and the must row
    after its correction is verified by a call of its own, from the verifier's token."""
    ctl = make_ctl("margin", 0.5, chain=False)
    v = ref_next([3, 4])
    (d,) = ctl._step([P.StepRow(rid="m", pos=1, prompt=[3, 4], margin=0.1, fast_token=(v + 1) % 50, behind=True)])
    assert d.verified and d.repair and d.token == v and ctl.vclient.items[-1].chain == -1 and not ctl.chained
    calls = len(ctl.vclient.items)
    (d,) = ctl._step([P.StepRow(rid="m", pos=2, margin=9.0, fast_token=ref_next([3, 4, (v + 1) % 50]), must=True)])
    assert len(ctl.vclient.items) == calls + 1 and ctl.vclient.items[-1].tokens == [v]
    assert d.verified and d.token == ref_next([3, 4, v])


def test_a_chained_answer_whose_slot_may_be_reused_is_verified_again(make_ctl):
    """The K/V slots are a ring: once enough results followed a chained answer, its slot may hold
    another column by the time the seam copies it, so the must row is verified again (a rewind
    to its position) instead."""
    ctl = make_ctl("margin", 0.5)
    v = ref_next([3, 4])
    ctl._step([P.StepRow(rid="r", pos=1, prompt=[3, 4], margin=0.1, fast_token=(v + 1) % 50, behind=True)])
    calls = len(ctl.vclient.items)
    ctl.vclient.last_gen += ctl.vclient.n_slots // 2  # (other requests' results meanwhile)
    (d,) = ctl._step([P.StepRow(rid="r", pos=2, margin=9.0, fast_token=0, must=True)])
    it = ctl.vclient.items[-1]
    assert len(ctl.vclient.items) == calls + 1 and it.rewind and it.pos == 2 and it.tokens == [v]
    assert d.verified and d.repair and d.gen == ctl.vclient.last_gen and d.token == ref_next([3, 4, v])
    assert ctl.reqs["r"].verifier_len == 3 and not ctl.reqs["r"].error


def test_a_fast_row_that_differs_from_its_chained_answer_is_a_missed_flip_at_once(make_ctl):
    """The request may end right after that row (no later verify call would audit it)."""
    ctl = make_ctl("margin", 0.5)
    v = ref_next([3, 4])
    ctl._step([P.StepRow(rid="f", pos=1, prompt=[3, 4], margin=0.1, fast_token=(v + 1) % 50, behind=True)])
    wrong = (ref_next([3, 4, v]) + 1) % 50
    (d,) = ctl._step([P.StepRow(rid="f", pos=2, margin=9.0, fast_token=wrong)])
    assert not d.verified
    ctl._finish(P.Finish(rid="f", output=[v, wrong]))
    verdict = ctl._verdict("f")
    assert verdict.state == "mismatch" and verdict.mismatch_positions == [2]


def test_an_unused_chained_answer_leaves_the_audit_to_the_verifier(make_ctl):
    """A chained answer whose row comes fast-committed (not a must row) is dropped; the verifier
    has seen the corrected token, so the next verify call starts after it and audits the fast
    token against its own prediction: a difference there is a missed flip."""
    ctl = make_ctl("margin", 0.5)
    v = ref_next([3, 4])
    ctl._step([P.StepRow(rid="u", pos=1, prompt=[3, 4], margin=0.1, fast_token=(v + 1) % 50, behind=True)])
    good = ref_next([3, 4, v])
    (d,) = ctl._step([P.StepRow(rid="u", pos=2, margin=9.0, fast_token=(good + 1) % 50)])
    assert not d.verified and not ctl.chained
    t = [3, 4, v, (good + 1) % 50]
    (d,) = ctl._step([P.StepRow(rid="u", pos=3, margin=0.1, fast_token=ref_next(t))])
    assert ctl.vclient.items[-1].tokens == [t[3]] and d.verified
    ctl._finish(P.Finish(rid="u", output=t[2:] + [d.token]))
    v2 = ctl._verdict("u")
    assert v2.state == "mismatch" and v2.mismatch_positions == [2]


def test_missed_flip_is_found_by_the_audit(make_ctl):
    ctl = make_ctl("margin", 0.5)
    # the fast path flips at a high-margin step (never verified): the final audit must see it
    run_request(ctl, "c", [3, 3], 5, [9.0] * 5, flip_at=2)
    v = ctl._verdict("c")
    assert v.state == "mismatch" and v.mismatch_positions == [3]


def test_finished_requests_tails_are_audited_together_and_fail_alone(make_ctl):
    """A verdict runs every pending tail audit in one verify call (one batched verifier forward);
    a request whose audit fails there fails alone, and all shadow caches are freed at once."""
    ctl = make_ctl("margin", 0.5)
    run_request(ctl, "p", [1, 2], 4, [9.0] * 4)
    run_request(ctl, "q", [3, 4], 5, [9.0] * 5, flip_at=1)  # a missed flip: the audit must see it
    run_request(ctl, "r", [5], 3, [9.0] * 3)
    ctl.vclient.seen["r"] = [0]  # the fake verifier now expects r to start at 1: its audit fails
    calls = []
    real = ctl.vclient.verify_many
    ctl.vclient.verify_many = lambda items, timeout_s=None: calls.append([it.rid for it in items]) or real(items)
    assert ctl._verdict("p").state == "verified"
    assert calls == [["p", "q", "r"]] and not ctl.pending
    assert ctl._verdict("q").state == "mismatch" and ctl._verdict("q").mismatch_positions == [2]
    v = ctl._verdict("r")
    assert v.state == "failed" and "final audit" in v.error and "position_mismatch" in v.error
    assert calls == [["p", "q", "r"]] and ctl.vclient.released == ["p", "q", "r"]


def reference(prompt, max_new, stop=()):
    out = list(prompt)
    while len(out) - len(prompt) < max_new:
        out.append(ref_next(out))
        if out[-1] in stop and len(out) - len(prompt) < max_new:
            break
    return out[len(prompt):]


def test_a_missed_flip_is_completed_by_the_verifier_when_the_answer_can_be_replaced(make_ctl):
    ctl = make_ctl("margin", 0.5)
    end = dict(max_new=6, stop_ids=[], correctable=True)
    emitted = run_request(ctl, "c", [3, 3], 6, [9.0] * 6, flip_at=2, **end)
    assert emitted[2:] != reference([3, 3], 6)
    v = ctl._verdict("c", correct=True)
    assert v.state == "verified" and v.mismatch_positions == [3]
    c = v.correction
    assert c.output == reference([3, 3], 6) and c.original == emitted[2:] and c.first == 2 and c.finish == "length"
    assert ctl.m.corrections._value.get() == 1
    # the corrector's own shadow cache started from the agreed prefix and was released after
    items = [it for it in ctl.vclient.items if it.rid == "c#correct"]
    assert items[0].tokens == [3, 3, *emitted[2:4]] and items[0].prompt_len == 2
    assert "c#correct" in ctl.vclient.released
    # a stream cannot take it: the same answer asked without `correct` says mismatch
    run_request(ctl, "s", [3, 3], 6, [9.0] * 6, flip_at=2, **end)
    assert ctl._verdict("s").state == "mismatch" and ctl._verdict("s").correction is None


def test_a_completion_runs_in_slices_and_steps_are_served_between(make_ctl, monkeypatch):
    """audit.CORRECTION_SLICE_S 0: each verdict ask makes one verify call of the completion and
    reads `running` until the answer is complete; another request's steps go through meanwhile,
    and the completed answer is the one the one-shot completion gives."""
    from mg_server.runtime.controller import audit

    monkeypatch.setattr(audit, "CORRECTION_SLICE_S", 0.0)
    ctl = make_ctl("margin", 0.5)
    end = dict(max_new=6, stop_ids=[], correctable=True)
    run_request(ctl, "c", [3, 3], 6, [9.0] * 6, flip_at=2, **end)
    before = ctl.m.corrections._value.get()  # (the counters are the process's)
    states, asks = [], 0
    while True:
        v = ctl._verdict("c", correct=True)
        asks += 1
        states.append(v.state)
        if v.state != "running":
            break
        assert v.correction is None and v.mismatch_positions == [3]
        if asks == 2:  # another deterministic request decides its steps between two slices
            run_request(ctl, "d", [4, 4], 3, [9.0] * 3, max_new=3, stop_ids=[], correctable=True)
            assert ctl._verdict("d").state == "verified"
    assert states[-1] == "verified" and asks == 4  # the 4 tokens after the flip, one call each
    assert v.correction.output == reference([3, 3], 6) and "c" not in ctl.completing
    assert "c#correct" in ctl.vclient.released and ctl.m.corrections._value.get() == before + 1


def test_a_correction_ends_by_sglangs_rules_and_not_without_them(make_ctl):
    ctl = make_ctl("margin", 0.5)
    ref = reference([1, 2], 40)
    stop = ref[5]  # a token the corrected answer reaches: it ends there
    run_request(ctl, "e", [1, 2], 8, [9.0] * 8, flip_at=1, max_new=40, stop_ids=[stop], correctable=True)
    c = ctl._verdict("e", correct=True).correction
    assert c.finish == "stop" and c.output == ref[: ref.index(stop) + 1]
    # stop strings (a text rule) or a cut answer: no correction, the verdict says so
    run_request(ctl, "f", [1, 2], 8, [9.0] * 8, flip_at=1, max_new=40, correctable=False)
    assert ctl._verdict("f", correct=True).state == "mismatch"
    run_request(ctl, "g", [1, 2], 8, [9.0] * 8, flip_at=1, aborted="cut", max_new=40, correctable=True)
    v = ctl._verdict("g", correct=True)
    assert v.state == "aborted" and v.correction is None


def test_always_mode_verifies_every_step(make_ctl):
    ctl = make_ctl("always", 0.5)
    run_request(ctl, "d", [4], 5, [9.0] * 5, flip_at=3)
    assert [it.pos for it in ctl.vclient.items] == [0, 1, 2, 3, 4]
    v = ctl._verdict("d")
    assert v.verified_steps == 5 and v.repairs == 1 and v.state == "verified"


def test_position_mismatch_and_dead_verifier_fail_the_request(make_ctl):
    ctl = make_ctl("margin", 0.5)
    (d,) = ctl._step([P.StepRow(rid="e", pos=5, prompt=[1, 2], margin=0.1, fast_token=0)])
    assert "position mismatch" in d.error
    assert ctl._verdict("e").state == "failed"
    ctl.verifier_proc.alive = False
    (d,) = ctl._step([P.StepRow(rid="f", pos=0, prompt=[1], margin=9.0, fast_token=0)])
    assert "not running" in d.error


def test_step_without_a_start_and_a_second_start_fail(make_ctl):
    ctl = make_ctl("margin", 0.5)
    (d,) = ctl._step([P.StepRow(rid="h", pos=3, margin=9.0, fast_token=0)])
    assert "never saw start" in d.error
    ctl._step([P.StepRow(rid="i", pos=1, prompt=[1, 2], margin=9.0, fast_token=0)])
    (d,) = ctl._step([P.StepRow(rid="i", pos=1, prompt=[1, 2], margin=9.0, fast_token=0)])
    assert "started twice" in d.error


def test_lookahead_steps_after_the_last_token_are_dropped(make_ctl):
    # overlap scheduler: one forward runs after the request's last token; SGLang drops its token
    ctl = make_ctl("always", 0.5)
    emitted = run_request(ctl, "la", [2, 3], 4, [9.0] * 5, lookahead=1)
    v = ctl._verdict("la")
    assert v.state == "verified" and v.steps == 4 and v.verified_steps == 4
    assert ctl.reqs["la"].tokens == emitted
    assert [it.pos for it in ctl.vclient.items] == [1, 2, 3, 4, 5]  # no final audit: all were verified


def test_emitted_tokens_that_differ_from_the_decisions_fail(make_ctl):
    ctl = make_ctl("margin", 0.5)
    ctl._step([P.StepRow(rid="x", pos=1, prompt=[4, 5], margin=9.0, fast_token=7)])
    ctl._finish(P.Finish(rid="x", output=[8]))  # SGLang emitted another token than mg decided
    assert ctl._verdict("x").state == "failed"
    ctl._step([P.StepRow(rid="y", pos=1, prompt=[4, 5], margin=9.0, fast_token=7)])
    ctl._finish(P.Finish(rid="y", output=[7, 9]))  # a token mg never decided: a step was missed
    v = ctl._verdict("y")
    assert v.state == "failed" and "not seen" in v.error


def test_off_mode_never_calls_the_verifier(make_ctl):
    ctl = make_ctl("off", 0.5)
    run_request(ctl, "g", [1], 3, [0.0] * 3)
    assert ctl.vclient.items == []
    assert ctl._verdict("g").state == "unverified"
    assert ctl._verdict("nope").state == "unknown"


def test_a_one_way_report_updates_state_and_gets_no_reply(make_ctl):
    ctl = make_ctl("margin", 0.5)
    assert ctl.handle(P.Step(rows=[P.StepRow(rid="r", pos=1, prompt=[3, 4], margin=9.0, fast_token=6)],
                             reply=False)) is None
    assert ctl.reqs["r"].tokens == [3, 4, 6]
    (d,) = ctl.handle(P.Step(rows=[P.StepRow(rid="r", pos=2, margin=0.1, fast_token=1)])).decisions
    assert d.verified and ctl.reqs["r"].tokens[:3] == [3, 4, 6]


def test_an_aborted_answer_is_never_verified(make_ctl):
    # tau 0: every step fast-committed, the third one a flip; the request is then aborted
    # (/abort_request): its tokens were never all checked, and it is cut short
    ctl = make_ctl("margin", 0.0)
    run_request(ctl, "ab", [2, 5], 4, [1.0] * 4, flip_at=2, aborted="Abort in waiting queue")
    v = ctl._verdict("ab")
    assert v.state == "aborted" and "Abort" in v.error
    assert ctl.vclient.items == []  # a cut answer gets no tail audit
    # a fully verified answer that is aborted is still not `verified`
    ctl = make_ctl("always", 0.5)
    run_request(ctl, "ab2", [2, 5], 3, [1.0] * 3, aborted="cut")
    assert ctl._verdict("ab2").state == "aborted"


def test_an_empty_answer_is_not_a_mismatch(make_ctl):
    # max_new_tokens 0 in a batch the sampler runs: mg sees the prefill step, SGLang emits nothing
    ctl = make_ctl("margin", 0.5)
    (d,) = ctl._step([P.StepRow(rid="z", pos=2, prompt=[9, 9, 9], margin=9.0, fast_token=4)])
    assert d.token == 4
    ctl._finish(P.Finish(rid="z", output=[]))
    v = ctl._verdict("z")
    assert v.state == "verified" and v.steps == 0
    assert ctl.vclient.items == []  # nothing audited: the prompt's own tokens are not an answer


def test_a_verifier_that_dies_mid_call_fails_the_rows_and_reports_down(make_ctl):
    from mg_server.runtime.verifier.client import VerifierError

    ctl = make_ctl("always", 0.5)

    def dies(items, timeout_s=None):
        ctl.verifier_proc.alive = False
        raise VerifierError(P.ErrorCode.PEER_DOWN, "the verifier process exited (code -9)")

    ctl.vclient.verify_many = dies
    (d,) = ctl._step([P.StepRow(rid="k", pos=0, prompt=[1], margin=9.0, fast_token=0)])
    assert "peer_down" in d.error and "[peer_down] [peer_down]" not in d.error
    assert ctl._verdict("k").state == "failed"
    assert not ctl.verifier_up() and "exited" in ctl.down_reason
    (d,) = ctl._step([P.StepRow(rid="l", pos=0, prompt=[1], margin=9.0, fast_token=0)])
    assert "not running" in d.error


def test_a_controller_whose_verifier_did_not_start_says_why_and_stops(make_ctl):
    ctl = make_ctl("margin", 0.5)
    ctl.start_error = P.ErrorReply(code=P.ErrorCode.LOAD_FAILED, message="the deterministic verifier did not start: x")
    reply = ctl.handle(P.ControllerHello(protocol_version=P.PROTOCOL_VERSION))
    assert isinstance(reply, P.Error) and reply.error.code == P.ErrorCode.LOAD_FAILED
    assert not ctl.running


def test_long_catch_up_goes_to_the_verifier_in_bounded_chunks(make_ctl, monkeypatch):
    # issue 12, item 9: a long prompt is prefilled (and a long fast-committed stretch audited) in
    # calls of at most catchup_chunk tokens, so the verify timeout bounds one chunk, not all
    from dataclasses import replace

    ctl = make_ctl("margin", 0.5)
    ctl.cfg = replace(ctl.cfg, catchup_chunk=8)
    prompt = [(3 * i) % 50 for i in range(30)]
    margins = [0.1] + [5.0] * 20 + [0.1, 5.0]
    emitted = run_request(ctl, "long", prompt, len(margins), margins, flip_at=10)  # a missed flip at step 10
    v = ctl._verdict("long")
    items = ctl.vclient.items
    assert max(len(it.tokens) for it in items) <= 8 and len(items) > 6
    # the verifier saw every token exactly once, in order, and audited the missed flip
    assert sum(len(it.tokens) for it in items) == len(emitted) - 1
    assert v.state == "mismatch" and v.mismatch_positions == [len(prompt) - 1 + 10]
    assert items[0].prompt_len == len(prompt) and all(it.prompt_len == 0 for it in items[1:])


def test_a_chunk_error_fails_the_request(make_ctl):
    ctl = make_ctl("always", 0.0)
    fake = ctl.vclient
    calls = []

    def failing(items, timeout_s=None):
        calls.append(items)
        return [P.ErrorReply(code=P.ErrorCode.TIMEOUT, message="deadline passed", rid=it.rid) for it in items]

    fake.verify_many = failing
    from dataclasses import replace

    ctl.cfg = replace(ctl.cfg, catchup_chunk=4)
    (d,) = ctl._step([P.StepRow(rid="x", pos=9, prompt=list(range(10)), margin=0.0, fast_token=1)])
    assert "catch-up" in d.error and len(calls) == 1 and len(calls[0][0].tokens) == 4
    assert ctl._verdict("x").state == "failed"


def test_resumable_steps_commit_fast_and_low_margins_are_checked_behind(make_ctl):
    ctl = make_ctl("margin", 0.5)
    prompt, toks = [4, 4], [4, 4]
    for margin in (3.0, 0.1, 3.0):  # the low-margin step is committed fast, like the others
        (d,) = ctl._step([P.StepRow(rid="r", pos=len(toks) - 1, prompt=list(toks) if len(toks) == 2 else [],
                                    margin=margin, fast_token=ref_next(toks), resumable=True)])
        assert d.token == ref_next(toks) and not d.verified
        toks.append(d.token)
    assert ctl.vclient.items == [] and ctl.checks == {"r": [2]}
    ctl._run_checks()  # idle: one call audits every token decided so far
    (it,) = ctl.vclient.items
    assert it.pos == len(toks) - 2 and it.tokens == toks[:-1] and it.prompt_len == 2
    assert ctl.checks == {} and ctl.stops == {} and ctl.reqs["r"].verified == [2]
    ctl._finish(P.Finish(rid="r", output=toks[2:], max_new=3, stop_ids=[], correctable=True))
    assert ctl._verdict("r", correct=True).state == "verified" and ctl.reqs["r"].correction is None
    assert prompt == [4, 4]


@pytest.mark.parametrize("where", ["step", "checked token"])
def test_a_checked_divergence_stops_the_fast_path_and_resumes_from_the_verifiers_token(make_ctl, where):
    ctl = make_ctl("margin", 0.5)
    corrections = ctl.m.corrections._value.get()  # (the metrics live as long as the process)
    prompt = [2, 9]
    toks = list(prompt)
    ref = reference(prompt, 12)
    flip = 3 if where == "step" else 4  # answer index of the flipped token
    for k in range(6):
        fast = ref_next(toks) if k != flip else (ref_next(toks) + 1) % 50
        (d,) = ctl._step([P.StepRow(rid="d", pos=len(toks) - 1, prompt=list(toks) if k == 0 else [],
                                    margin=0.1 if k in (2, 4) else 3.0, fast_token=fast, resumable=True)])
        toks.append(d.token)
        if k == 2 and where == "step":
            ctl._run_checks()  # checked up to answer token 2: agrees
            assert ctl.stops == {}
    ctl._run_checks()  # a flip below the checked token (audit) or at it (its own prediction)
    assert ctl.stops == {"d": None} and ctl.reqs["d"].flip_token == ref[flip]
    assert ctl.handle(P.Stops()).rids == ["d"] and ctl.handle(P.Stops()).rids == []  # told once
    # the seam ends the request: it emitted 6 tokens; its verdict resumes from the flip
    ctl._finish(P.Finish(rid="d", output=toks[2:], max_new=12, stop_ids=[49], correctable=True))
    v = ctl._verdict("d", correct=True)
    c = v.correction
    assert v.state == "verified" and c.resume and c.finish == ""
    assert c.original == toks[2:] and c.first == flip and c.output == ref[:flip + 1]
    assert c.resume_ids == prompt + ref[:flip + 1] and c.max_new == 12 - flip - 1 and c.stop_ids == [49]
    assert ctl.m.corrections._value.get() == corrections + 1
    # no tail audit after the divergence: the verifier saw nothing beyond the check
    assert max(it.pos for it in ctl.vclient.items if it.rid == "d") == len(toks) - 2


def test_a_resume_point_that_ends_the_answer_needs_no_continuation(make_ctl):
    ctl = make_ctl("margin", 0.5)
    prompt = [7, 1]
    ref = reference(prompt, 8)
    emitted = run_request(ctl, "x", prompt, 4, [9.0] * 4, flip_at=3, resumable=True, max_new=4, stop_ids=[],
                          correctable=True)
    c = ctl._verdict("x", correct=True).correction  # found by the tail audit, at the last token
    assert not c.resume and c.finish == "length" and c.output == ref[:4] and c.original == emitted[2:]
    run_request(ctl, "y", prompt, 4, [9.0] * 4, flip_at=1, resumable=True, max_new=6, stop_ids=[ref[1]],
                correctable=True)
    c = ctl._verdict("y", correct=True).correction
    assert not c.resume and c.finish == "stop" and c.output == ref[:2]


def _ahead_ctl(make_ctl, n=8, chunk=16):
    from dataclasses import replace

    ctl = make_ctl("margin", 0.5)
    ctl.cfg = replace(ctl.cfg, prefill_ahead=n, catchup_chunk=chunk)
    return ctl


def _steps(ctl, rid, tokens, margins, first, flip_at=None, idle=0):
    """Decide len(margins) steps of request rid (tokens: its tokens so far, extended), with `idle`
    of the controller's idle turns (prefill ahead) after the first step."""
    for k, m in enumerate(margins):
        fast = ref_next(tokens) if k != flip_at else (ref_next(tokens) + 1) % 50
        (d,) = ctl._step([P.StepRow(rid=rid, pos=len(tokens) - 1, prompt=list(tokens) if first and k == 0 else [],
                                    margin=m, fast_token=fast)])
        assert not d.error, d.error
        tokens.append(d.token)
        for _ in range(idle if k == 0 else 0):
            ctl._prefill_ahead()
    return tokens


def test_a_prompt_is_taught_ahead_in_idle_turns_so_its_first_check_carries_only_what_followed(make_ctl):
    ctl = _ahead_ctl(make_ctl)
    prompt = [(7 * i) % 50 for i in range(30)]
    emitted = _steps(ctl, "a", list(prompt), [3.0, 3.0, 0.1, 3.0], first=True, idle=3)
    items = ctl.vclient.items
    # two chunks of the prompt (16 + 14 tokens; the second audits the first decided token), then
    # the low-margin check at step 2 with only the two tokens that followed
    assert [len(it.tokens) for it in items] == [16, 14, 2] and items[0].prompt_len == 30
    assert "a" not in ctl.ahead and ctl.m.prefill_ahead._value.get() == 30
    ctl._finish(P.Finish(rid="a", output=emitted[len(prompt):]))
    v = ctl._verdict("a")
    assert v.state == "verified" and v.verified_steps == 1
    assert sum(len(it.tokens) for it in ctl.vclient.items) == len(emitted) - 1  # each token once, in order


def test_the_prefill_ahead_audits_the_first_decided_token(make_ctl):
    ctl = _ahead_ctl(make_ctl)
    prompt = [(7 * i) % 50 for i in range(30)]
    emitted = _steps(ctl, "m", list(prompt), [3.0, 3.0], first=True, flip_at=0, idle=2)  # a missed flip at step 0
    assert ctl.reqs["m"].mismatches == [29] and "m" not in ctl.ahead
    ctl._finish(P.Finish(rid="m", output=emitted[len(prompt):]))
    assert ctl._verdict("m").state == "mismatch"


def test_short_prompts_other_modes_and_a_failing_verifier_are_left_to_the_checks(make_ctl):
    ctl = _ahead_ctl(make_ctl)
    _steps(ctl, "short", [1, 2, 3], [3.0], first=True)
    assert not ctl.ahead  # below --mg-prefill-ahead
    fake, calls = ctl.vclient, []

    def failing(items, timeout_s=None):
        calls.append(items)
        return [P.ErrorReply(code=P.ErrorCode.TIMEOUT, message="deadline passed", rid=it.rid) for it in items]

    ctl.vclient = type("Failing", (), {"verify_many": staticmethod(failing)})()
    tokens = _steps(ctl, "f", list(range(20)), [3.0], first=True, idle=2)
    assert len(calls) == 1 and not ctl.ahead  # one try, then dropped: no retry loop
    ctl.vclient = fake  # the request's own check catches up the whole prompt
    _steps(ctl, "f", tokens, [0.1], first=False)
    assert [len(it.tokens) for it in fake.items if it.rid == "f"] == [16, 5] and not ctl.reqs["f"].error
    ctl2 = _ahead_ctl(make_ctl)
    ctl2.cfg = type(ctl2.cfg)(**{**ctl2.cfg.__dict__, "mode": "always"})
    _steps(ctl2, "x", list(range(20)), [0.0], first=True)
    assert not ctl2.ahead  # mode always checks every step anyway


def test_one_idle_turn_teaches_at_most_one_chunk_in_all(make_ctl):
    # the verify timeout bounds a call of catchup_chunk tokens, and a Step arriving during an idle
    # turn's call waits for it: the chunk is shared by the waiting requests, in order
    ctl = _ahead_ctl(make_ctl, n=8, chunk=16)
    calls = []
    fake = ctl.vclient
    ctl.vclient = type("Recording", (), {"verify_many": staticmethod(
        lambda items, timeout_s=None: calls.append([len(it.tokens) for it in items]) or fake.verify_many(items))})()
    _steps(ctl, "a", list(range(1, 21)), [3.0], first=True)
    _steps(ctl, "b", list(range(2, 22)), [3.0], first=True)
    while ctl.ahead:
        ctl._prefill_ahead()
    assert calls == [[16], [4, 12], [8]]
    assert ctl.reqs["a"].verifier_len == ctl.reqs["b"].verifier_len == 20


def test_a_step_verified_ahead_is_answered_without_a_verify_call(make_ctl):
    """--mg-verify-ahead (controller/ahead.py): the verifier answers a step when the seam launches
    it; the Step then takes that answer (no call), a stale or unknown row costs nothing, and a
    fast-committed token that differs from the answer is a missed flip found at its Step."""
    ctl = make_ctl("margin", 0.5, chain=False)
    prompt = [5, 6, 7]
    (d,) = ctl._step([P.StepRow(rid="a", pos=2, prompt=prompt, margin=3.0, fast_token=ref_next(prompt))])
    tokens = prompt + [d.token]
    assert ctl.handle(P.VerifyAhead(rows=[P.AheadRow(rid="a", pos=3)])) is None  # one-way
    calls = len(ctl.vclient.items)
    assert calls == 1 and ctl.vclient.items[0].tokens == tokens  # the catch-up from the prompt on
    assert (ctl.chained["a"].pos, ctl.chained["a"].token) == (3, ref_next(tokens))
    wrong = (ref_next(tokens) + 1) % 50
    (d,) = ctl._step([P.StepRow(rid="a", pos=3, margin=0.1, fast_token=wrong)])  # below tau: verified
    assert d.verified and d.repair and d.token == ref_next(tokens) and len(ctl.vclient.items) == calls
    tokens.append(d.token)
    ctl.handle(P.VerifyAhead(rows=[P.AheadRow(rid="a", pos=3), P.AheadRow(rid="zz", pos=0)]))  # stale, unknown
    assert len(ctl.vclient.items) == calls and "a" not in ctl.chained
    ctl.handle(P.VerifyAhead(rows=[P.AheadRow(rid="a", pos=4)]))
    assert ctl.vclient.items[-1].tokens == [tokens[4]]  # one token: the verifier had seen the rest
    (d,) = ctl._step([P.StepRow(rid="a", pos=4, margin=3.0, fast_token=(ref_next(tokens) + 1) % 50)])
    assert not d.verified and ctl.reqs["a"].mismatches == [4]  # above tau: committed fast, found at once
    tokens.append(d.token)
    ctl._finish(P.Finish(rid="a", output=tokens[len(prompt):]))
    assert ctl._verdict("a").state == "mismatch" and ctl.m.verify_ahead._value.get() >= 2


def test_a_lag_row_above_tau_that_differs_from_its_answer_ahead_is_corrected_not_missed(make_ctl):
    """A behind row (its token not yet emitted) above tau whose kept answer differs: verified
    from that answer, no call (every behind row is verified), so the seam can swap it; the same row
    committed fast (not behind) stays a missed flip."""
    ctl = make_ctl("margin", 0.5, chain=False)
    prompt = [5, 6, 7]
    for rid in ("b", "f"):
        ctl._step([P.StepRow(rid=rid, pos=2, prompt=prompt, margin=3.0, fast_token=ref_next(prompt))])
    tokens = prompt + [ref_next(prompt)]
    ctl.handle(P.VerifyAhead(rows=[P.AheadRow(rid="b", pos=3), P.AheadRow(rid="f", pos=3)]))
    calls, wrong = len(ctl.vclient.items), (ref_next(tokens) + 1) % 50
    (db, df) = ctl._step([P.StepRow(rid="b", pos=3, margin=3.0, fast_token=wrong, behind=True),
                          P.StepRow(rid="f", pos=3, margin=3.0, fast_token=wrong)])
    assert db.verified and db.repair and db.token == ref_next(tokens) and len(ctl.vclient.items) == calls
    assert not ctl.reqs["b"].mismatches and ctl.m.flips_above_tau._value.get() == 1
    assert not df.verified and df.token == wrong and ctl.reqs["f"].mismatches == [3]
    # behind and agreeing with its answer: verified, no repair, no flip counted
    ctl.handle(P.VerifyAhead(rows=[P.AheadRow(rid="b", pos=4)]))
    tokens.append(db.token)
    (db,) = ctl._step([P.StepRow(rid="b", pos=4, margin=3.0, fast_token=ref_next(tokens), behind=True)])
    assert db.verified and not db.repair and ctl.m.flips_above_tau._value.get() == 1
    # behind with no answer kept: verified by a call of its own, never committed unchecked
    tokens.append(db.token)
    calls = len(ctl.vclient.items)
    (db,) = ctl._step([P.StepRow(rid="b", pos=5, margin=3.0, fast_token=(ref_next(tokens) + 1) % 50, behind=True)])
    assert db.verified and db.token == ref_next(tokens) and len(ctl.vclient.items) == calls + 1
    assert ctl.m.flips_above_tau._value.get() == 2


def test_an_answer_verified_ahead_without_its_column_serves_only_where_no_repair_needs_it(make_ctl):
    """Ahead rows that are not MUST rows ask for no K/V column (VerifyItem.column): the answer
    serves a behind row's correction (its repair is deferred and may be skipped) and a row the
    verifier agrees with; a row whose repair would need the column is verified again."""
    ctl = make_ctl("margin", 0.5, chain=False)
    prompt = [5, 6, 7]
    for rid in ("b", "h"):
        ctl._step([P.StepRow(rid=rid, pos=2, prompt=prompt, margin=3.0, fast_token=ref_next(prompt))])
    tokens = prompt + [ref_next(prompt)]
    ctl.handle(P.VerifyAhead(rows=[P.AheadRow(rid="b", pos=3), P.AheadRow(rid="h", pos=3, must=False)]))
    assert [it.column for it in ctl.vclient.items] == [False, False]
    ctl.vclient.items.clear()
    ctl.chained["b"].slot = ctl.chained["b"].gen = ctl.chained["h"].slot = ctl.chained["h"].gen = -1  # (no column)
    wrong = (ref_next(tokens) + 1) % 50
    (db, dh) = ctl._step([P.StepRow(rid="b", pos=3, margin=0.1, fast_token=wrong, behind=True),
                          P.StepRow(rid="h", pos=3, margin=0.1, fast_token=wrong)])
    assert db.verified and db.repair and db.token == ref_next(tokens) and db.slot == -1  # the kept answer
    assert dh.verified and dh.repair and dh.slot >= 0  # verified again, with its column
    assert [(it.rid, it.rewind, it.column) for it in ctl.vclient.items] == [("h", True, True)]


def _window_row(toks, k, fast, margin, epoch=0, rid="w"):
    return P.StepRow(rid=rid, pos=len(toks) - 1, prompt=list(toks) if k == 0 else [], margin=margin,
                     fast_token=fast, window=True, epoch=epoch)


def test_a_window_request_is_rolled_back_where_the_verifier_disagrees(make_ctl):
    ctl = make_ctl("margin", 0.5)
    prompt, flip = [2, 9], 3
    toks, ref = list(prompt), reference(prompt, 12)
    for k in range(6):  # every step committed fast; the flip at answer index 3, a low margin at 4
        fast = ref_next(toks) if k != flip else (ref_next(toks) + 1) % 50
        (d,) = ctl._step([_window_row(toks, k, fast, 0.1 if k == 4 else 3.0)])
        assert d.token == fast and not d.verified
        toks.append(d.token)
    assert list(ctl.checks) == ["w"]  # the low margin asked for a check, a few forwards later
    assert not ctl._checks_due() and ctl.window_due == 5 + CHECK_DELAY_FORWARDS
    ctl.forwards = ctl.window_due  # (that many forwards later)
    ctl._idle_turn()
    assert ctl.window_due is None and ctl.checks == {}
    st = ctl.reqs["w"]
    assert st.tokens == prompt + ref[:flip + 1] and st.epoch == 1 and st.checked == flip + 1
    reply = ctl.handle(P.Stops())
    assert reply.rids == [] and reply.rollbacks == [P.Rollback(rid="w", index=flip, token=ref[flip], epoch=1)]
    assert reply.verified == {"w": [1, flip + 1]} and ctl.handle(P.Stops()).rollbacks == []  # told once
    # the seam's rows of the old timeline are dropped until it applies the rollback
    stale = ctl._step([_window_row(toks, 6, 7, 3.0)])
    assert not stale[0].error and st.tokens == prompt + ref[:flip + 1]
    toks = prompt + ref[:flip + 1]
    for k in range(flip + 1, 8):  # then the new timeline, from the verifier's token
        (d,) = ctl._step([_window_row(toks, k, ref_next(toks), 3.0, epoch=1)])
        toks.append(d.token)
    tail = ctl._check_tail("w")  # the finish barrier: everything checked, the rollback told again
    assert not tail.error and tail.epoch == 1 and tail.verified == 8 and tail.rollback.epoch == 1
    # the verifier dropped its positions past the flip and caught up from the verifier's token
    assert any(it.rewind for it in ctl.vclient.items) and ctl.vclient.seen["w"][:len(toks) - 1] == toks[:-1]
    ctl._finish(P.Finish(rid="w", output=toks[2:], max_new=12, stop_ids=[]))
    assert ctl._verdict("w").state == "verified" and toks[2:] == ref[:8]


def test_a_window_request_is_checked_every_window_and_at_its_finish_barrier(make_ctl):
    ctl = make_ctl("margin", 0.5)
    prompt = [3, 1]
    toks = list(prompt)
    for k in range(ctl.cfg.window + 3):  # high margins only: a check once `window` tokens wait
        (d,) = ctl._step([_window_row(toks, k, ref_next(toks), 9.0)])
        toks.append(d.token)
        assert ctl._checks_due() == (k == ctl.cfg.window - 1)
        if k == ctl.cfg.window - 1:
            ctl._idle_turn()
            assert ctl.reqs["w"].checked == ctl.cfg.window
    tail = ctl._check_tail("w")
    assert tail.rollback is None and tail.verified == ctl.cfg.window + 3 and ctl.checks == {}


def test_the_finish_barrier_checks_every_window_request_in_one_call(make_ctl):
    # requests of one batch end in the same forward: the first barrier's call takes all of them
    ctl = make_ctl("margin", 0.5)
    toks = {"a": [3, 1], "b": [4, 1, 5]}
    for k in range(5):  # high margins, fewer than a window: nothing checked yet
        for rid in ("a", "b"):
            (d,) = ctl._step([_window_row(toks[rid], k, ref_next(toks[rid]), 9.0, rid=rid)])
            toks[rid].append(d.token)
    assert ctl.vclient.calls == [] and not ctl._checks_due()
    tail = ctl._check_tail("a")
    assert not tail.error and tail.verified == 5 and ctl.reqs["b"].checked == 5
    assert [sorted(c) for c in ctl.vclient.calls] == [["a", "b"]]
    assert ctl._check_tail("b").verified == 5 and len(ctl.vclient.calls) == 1  # nothing left to check


def test_a_wrong_token_a_stream_let_leave_early_is_a_missed_flip_not_a_rollback(make_ctl):
    ctl = make_ctl("margin", 0.5)
    prompt, flip = [2, 9], 2
    toks = list(prompt)
    for k in range(5):  # high margins, every token released early (StepRow.released)
        fast = ref_next(toks) if k != flip else (ref_next(toks) + 1) % 50
        row = _window_row(toks, k, fast, 3.0)
        row.released = True
        ctl._step([row])
        toks.append(fast)
    st = ctl.reqs["w"]
    assert st.released == 5
    tail = ctl._check_tail("w")  # the check finds the flip among the released tokens
    assert tail.rollback is None and tail.verified >= 1 << 30 and st.epoch == 0 and ctl.rollbacks == {}
    ctl._finish(P.Finish(rid="w", output=toks[2:], max_new=5, stop_ids=[]))
    assert ctl._verdict("w").state == "mismatch"
