"""MarginGate policy and the controller's decisions, audit and verdicts (fake verifier)."""

import math

import pytest

from mg_server.controller.server import Controller, ControllerConfig
from mg_server.controller.window import CHECK_DELAY_FORWARDS
from mg_server.policy import PROFILE_DIR, Policy, read_profile, resolve_tau
from mg_server.wire import protocol as P


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
    smol = read_profile(PROFILE_DIR / "SmolLM2-135M-Instruct.cpu.json")["model_id"]  # found by this identity
    assert resolve_tau(smol, 0.3) == (0.3, "flag")
    # the shipped profile of the serving device: the GPU's kernels drift further from the verifier's
    assert resolve_tau(smol, None) == (0.546875, "profile SmolLM2-135M-Instruct.cpu.json")
    assert resolve_tau(smol, None, device="cuda") == (0.578125, "profile SmolLM2-135M-Instruct.cuda.json")
    # tau only orders the checks (every token is checked), so a model without a profile serves with tau 0;
    # the source says which identity was looked for and what is shipped
    tau, source = resolve_tau("0" * 32, None)
    assert tau == 0.0 and source.startswith(f"no cpu profile for model identity {'0' * 32}; shipped: ")
    assert f"SmolLM2-135M-Instruct.cpu.json (model 'SmolLM2-135M-Instruct', cpu, id {smol})" in source
    assert source.endswith(": steps are checked in windows only")
    assert resolve_tau("0" * 32, None, "always") == (0.0, "unused in mode always")


def ref_next(prefix: list[int]) -> int:
    """The fake verifier's greedy rule."""
    return (sum(prefix) * 31 + len(prefix)) % 50


class FakeVerifier:
    """Follows the protocol: catch-up from the known length, audit of t_{q+1} for q in [start-1, pos-1]."""

    def __init__(self):
        self.seen: dict[str, list[int]] = {}
        self.prompt_len: dict[str, int] = {}
        self.items: list[P.VerifyItem] = []
        self.calls: list[list[str]] = []  # the rids of each verify_many call
        self.released: list[str] = []

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
            out.append(P.VerifyResult(rid=it.rid, pos=it.pos, token=ref_next(hist), margin=1.0,
                                      audit_tokens=audit, first_mismatch=first))
        return out

    def release(self, rids, timeout_s=None):
        self.released += rids
        return len(rids)

    def close(self):
        pass


class Alive:
    exitcode = None
    pid = 0

    def __init__(self):
        self.alive = True

    def is_alive(self):
        return self.alive

    def kill(self):
        self.alive = False
        self.exitcode = -9

    def join(self, timeout=None):
        pass


class NoStart:
    """A verifier start that never ends (a lost fake verifier stays down)."""

    def done(self):
        return False

    def abandon(self):
        pass


@pytest.fixture()
def make_ctl(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    ctls = []

    def make(mode="margin", tau=0.5):
        ctl = Controller(ControllerConfig(ipc_path=str(tmp_path / f"c{len(ctls)}.sock"), mode=mode, tau=tau,
                                          metrics_dir=str(tmp_path)))
        ctl.vclient, ctl.verifier_proc = FakeVerifier(), Alive()
        ctl._begin_start = lambda predecessor=0: NoStart()
        ctls.append(ctl)
        return ctl

    yield make
    for c in ctls:
        c.vclient, c.verifier_proc = None, None
        c.close()


def run_request(ctl, rid, prompt, n_steps, margins, flip_at=None, lookahead=0, aborted="", **end):
    """Drive a request like mg's seam does (every step committed fast and reported; no idle turn,
    so no check runs before its Finish: what the tail audit sees); returns the emitted tokens.
    `lookahead` extra steps are decided after the last token, as the overlap scheduler's
    look-ahead forward does, and not emitted."""
    tokens = list(prompt)
    for step in range(n_steps + lookahead):
        pos = len(tokens) - 1
        fast = ref_next(tokens) if step != flip_at else (ref_next(tokens) + 1) % 50
        ctl._step([P.StepRow(rid=rid, pos=pos, prompt=list(prompt) if step == 0 else [], margin=margins[step],
                             fast_token=fast)])
        assert not ctl.reqs[rid].error, ctl.reqs[rid].error
        tokens.append(fast)
    emitted = tokens[: len(tokens) - lookahead]
    ctl._finish(P.Finish(rid=rid, output=emitted[len(prompt):], aborted=bool(aborted), reason=aborted, **end))
    assert ctl.reqs[rid].state(ctl.cfg.mode) == "running"  # tail audit deferred ...
    return emitted  # ... until the verdict is asked for (or the controller is idle)


def test_missed_flip_is_found_by_the_audit(make_ctl):
    ctl = make_ctl("margin", 0.5)
    # the fast path flips at a high-margin step (never verified): the final audit must see it
    before = ctl.m.flip_margin._sum.get()
    run_request(ctl, "c", [3, 3], 5, [9.0] * 2 + [7.5] + [9.0] * 2, flip_at=2)
    v = ctl._verdict("c")
    assert v.state == "mismatch" and v.mismatch_positions == [3]
    assert ctl.m.flip_margin._sum.get() == before + 7.5  # the missed flip's fast margin (mg_flip_margin)


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
    from mg_server.controller import audit

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


def test_always_mode_counts_every_step_as_low_margin(make_ctl):
    """Mode always: whatever its margin, every step is queued for the check a few forwards later."""
    ctl = make_ctl("always", 0.5)
    run_request(ctl, "d", [4], 3, [9.0] * 3)
    assert ctl.checks == {"d": [0, 1, 2]} and ctl.window_due == 1 + CHECK_DELAY_FORWARDS
    ctl = make_ctl("margin", 0.5)
    run_request(ctl, "d", [4], 3, [9.0] * 3)
    assert ctl.checks == {} and ctl.window_due is None


def test_position_mismatch_and_dead_verifier_fail_the_request(make_ctl):
    ctl = make_ctl("margin", 0.5)
    ctl._step([P.StepRow(rid="e", pos=5, prompt=[1, 2], margin=0.1, fast_token=0)])
    assert "position mismatch" in ctl.reqs["e"].error
    assert ctl._verdict("e").state == "failed"
    ctl.verifier_proc.alive = False
    ctl._step([P.StepRow(rid="f", pos=0, prompt=[1], margin=9.0, fast_token=0)])
    assert "not running" in ctl.reqs["f"].error


def test_step_without_a_start_and_a_second_start_fail(make_ctl):
    ctl = make_ctl("margin", 0.5)
    ctl._step([P.StepRow(rid="h", pos=3, margin=9.0, fast_token=0)])
    assert "never saw start" in ctl.reqs["h"].error
    ctl._step([P.StepRow(rid="i", pos=1, prompt=[1, 2], margin=9.0, fast_token=0)])
    ctl._step([P.StepRow(rid="i", pos=1, prompt=[1, 2], margin=9.0, fast_token=0)])
    assert "started twice" in ctl.reqs["i"].error


def test_lookahead_steps_after_the_last_token_are_dropped(make_ctl):
    # overlap scheduler: one forward runs after the request's last token; SGLang drops its token
    ctl = make_ctl("margin", 0.5)
    emitted = run_request(ctl, "la", [2, 3], 4, [9.0] * 5, lookahead=1)
    v = ctl._verdict("la")
    assert v.state == "verified" and v.steps == 4
    assert ctl.reqs["la"].tokens == emitted and ctl.reqs["la"].margins == [9.0] * 4  # (dropped with its token)
    assert [it.pos for it in ctl.vclient.items] == [4]  # the tail audit ends at the last emitted token


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
    assert ctl.handle(P.Step(rows=[P.StepRow(rid="r", pos=1, prompt=[3, 4], margin=9.0, fast_token=6)])) is None
    assert ctl.reqs["r"].tokens == [3, 4, 6]
    assert ctl.handle(P.Step(rows=[P.StepRow(rid="r", pos=2, margin=0.1, fast_token=1)])) is None
    assert ctl.reqs["r"].tokens == [3, 4, 6, 1] and ctl.checks == {"r": [2]}  # checked behind, not now
    assert ctl.vclient.items == []


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
    ctl._step([P.StepRow(rid="z", pos=2, prompt=[9, 9, 9], margin=9.0, fast_token=4)])
    assert ctl.reqs["z"].tokens == [9, 9, 9, 4]
    ctl._finish(P.Finish(rid="z", output=[]))
    v = ctl._verdict("z")
    assert v.state == "verified" and v.steps == 0
    assert ctl.vclient.items == []  # nothing audited: the prompt's own tokens are not an answer


def test_a_verifier_that_dies_mid_call_fails_the_rows_and_reports_down(make_ctl):
    from mg_server.verifier.client import VerifierError

    ctl = make_ctl("always", 0.5)

    def dies(items, timeout_s=None):
        ctl.verifier_proc.alive = False
        raise VerifierError(P.ErrorCode.PEER_DOWN, "the verifier process exited (code -9)")

    ctl.vclient.verify_many = dies
    ctl._step([P.StepRow(rid="k", pos=0, prompt=[1], margin=9.0, fast_token=0)])
    ctl.forwards = ctl.window_due  # (the check is due)
    ctl._idle_turn()
    err = ctl.reqs["k"].error
    assert "peer_down" in err and "[peer_down] [peer_down]" not in err
    assert "exited" in ctl.down_reason  # published by the failed call itself (/health, mg_verifier_up)
    assert ctl._verdict("k").state == "failed"
    assert not ctl.verifier_up() and "exited" in ctl.down_reason
    ctl._step([P.StepRow(rid="l", pos=0, prompt=[1], margin=9.0, fast_token=0)])
    assert "not running" in ctl.reqs["l"].error


def test_a_controller_whose_verifier_did_not_start_says_why_and_stops(make_ctl):
    ctl = make_ctl("margin", 0.5)
    ctl.start_error = P.ErrorReply(code=P.ErrorCode.LOAD_FAILED, message="the deterministic verifier did not start: x")
    reply = ctl.handle(P.ControllerHello(protocol_version=P.PROTOCOL_VERSION))
    assert isinstance(reply, P.Error) and reply.error.code == P.ErrorCode.LOAD_FAILED
    assert not ctl.running


def test_the_live_requests_gauge_counts_requests_without_their_end(make_ctl):
    # mg_live_requests: 0 once every request's Finish came (else a leak it shows), whatever the
    # verdicts the controller still keeps
    ctl = make_ctl("margin", 0.5)
    for rid in ("a", "b"):
        ctl._step([P.StepRow(rid=rid, pos=1, prompt=[3, 3], margin=9.0, fast_token=ref_next([3, 3]))])
    run_request(ctl, "c", [3, 3], 3, [9.0] * 3)
    assert ctl._verdict("c").state == "verified"
    assert ctl.m.live_requests._value.get() == 2
    ctl._finish(P.Finish(rid="a", output=[ref_next([3, 3])]))
    ctl._finish(P.Finish(rid="b", output=[ref_next([3, 3])]))
    assert ctl._verdict("a").state == "verified" and ctl._verdict("b").state == "verified"
    assert ctl.m.live_requests._value.get() == 0 and len(ctl.reqs) == 3
    ctl._step([P.StepRow(rid="d", pos=1, prompt=[3, 3], margin=9.0, fast_token=ref_next([3, 3]))])
    ctl._idle_turn()  # nothing pending, nothing due: an idle turn counts too
    assert ctl.m.live_requests._value.get() == 1


def test_long_catch_up_goes_to_the_verifier_in_bounded_chunks(make_ctl, monkeypatch):
    # a long prompt is prefilled (and a long fast-committed stretch audited) in
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
    ctl._step([P.StepRow(rid="x", pos=9, prompt=list(range(10)), margin=0.0, fast_token=1)])
    ctl.forwards = ctl.window_due  # (the check is due)
    ctl._idle_turn()
    assert "catch-up" in ctl.reqs["x"].error and len(calls) == 1 and len(calls[0][0].tokens) == 4
    assert ctl._verdict("x").state == "failed"


def test_a_prompt_that_fits_a_call_goes_in_its_checks_own_item(make_ctl):
    # on a GPU verifier a catch-up chunk is a whole call's rows: the prompts of requests checked
    # together go in their checks' items, packed into a few calls (one read of the weights each),
    # not in calls of catchup_chunk tokens of one request after another; a prompt longer than a
    # call still goes in chunks first
    from dataclasses import replace
    from types import SimpleNamespace

    ctl = make_ctl("margin", 0.5)
    ctl.cfg = replace(ctl.cfg, catchup_chunk=8, verifier=SimpleNamespace(max_batch_items=64, device="cuda"))  # 128 rows a call
    prompts = {"a": [(3 * i) % 50 + 1 for i in range(60)], "b": [(7 * i) % 50 + 1 for i in range(60)],
               "c": [(5 * i) % 50 + 1 for i in range(60)], "long": [(11 * i) % 50 + 1 for i in range(300)]}
    toks = {rid: list(p) for rid, p in prompts.items()}
    calls = _due_check_calls(ctl, toks, 3)
    assert all(sum(len(it.tokens) for it in c) <= 128 for c in calls)
    assert len(calls) <= 5  # 362 + 3 x 62 rows (one request after another: 59 calls)
    assert [it.rid for it in calls[0]] == ["long"] == [it.rid for it in calls[1]]  # its first 256 tokens, 2 rounds
    assert sorted(it.rid for c in calls[2:] for it in c) == ["a", "b", "c", "long"]
    for rid, t in toks.items():  # every token seen once, in order, and checked
        assert ctl.vclient.seen[rid] == t[:-1] and ctl.reqs[rid].checked == 3 and not ctl.reqs[rid].error


def _window_row(toks, k, fast, margin, epoch=0, rid="w"):
    return P.StepRow(rid=rid, pos=len(toks) - 1, prompt=list(toks) if k == 0 else [], margin=margin,
                     fast_token=fast, epoch=epoch)


def _due_check_calls(ctl, toks: dict[str, list[int]], steps: int) -> list[list[P.VerifyItem]]:
    """Each request of `toks` commits `steps` low-margin steps fast (its list grows with them),
    then the due check runs: the items of each verify call it made."""
    for k in range(steps):
        for rid, t in toks.items():
            ctl._step([_window_row(t, k, ref_next(t), 0.1, rid=rid)])
            t.append(ref_next(t))
    ctl.forwards = ctl.window_due
    ctl._idle_turn()
    items = iter(ctl.vclient.items)
    return [[next(items) for _ in c] for c in ctl.vclient.calls]


def test_a_window_request_is_rolled_back_where_the_verifier_disagrees(make_ctl):
    ctl = make_ctl("margin", 0.5)
    prompt, flip = [2, 9], 3
    toks, ref = list(prompt), reference(prompt, 12)
    for k in range(6):  # every step committed fast; the flip at answer index 3, a low margin at 4
        fast = ref_next(toks) if k != flip else (ref_next(toks) + 1) % 50
        ctl._step([_window_row(toks, k, fast, 0.1 if k == 4 else 3.0)])
        toks.append(fast)
    assert list(ctl.checks) == ["w"]  # the low margin asked for a check, a few forwards later
    assert not ctl._checks_due() and ctl.window_due == 5 + CHECK_DELAY_FORWARDS
    ctl.forwards = ctl.window_due  # (that many forwards later)
    margin_sum, dropped = ctl.m.flip_margin._sum.get(), ctl.m.dropped_steps._value.get()
    ctl._idle_turn()
    assert ctl.window_due is None and ctl.checks == {}
    st = ctl.reqs["w"]
    assert st.tokens == prompt + ref[:flip + 1] and st.epoch == 1 and st.checked == flip + 1
    # the overturned step's fast margin is observed (mg_flip_margin); the verifier's token has none
    assert ctl.m.flip_margin._sum.get() == margin_sum + 3.0 and st.margins == [3.0] * flip + [-1.0]
    assert ctl.m.dropped_steps._value.get() == dropped + 2  # answer tokens 4 and 5, after the flip
    reply = ctl.handle(P.WindowNews())
    assert reply.rollbacks == [P.Rollback(rid="w", index=flip, token=ref[flip], epoch=1)]
    assert reply.verified == {"w": [1, flip + 1]} and ctl.handle(P.WindowNews()).rollbacks == []  # told once
    # the seam's rows of the old timeline are dropped until it applies the rollback
    ctl._step([_window_row(toks, 6, 7, 3.0)])
    assert not st.error and st.tokens == prompt + ref[:flip + 1]
    toks = prompt + ref[:flip + 1]
    for k in range(flip + 1, 8):  # then the new timeline, from the verifier's token
        ctl._step([_window_row(toks, k, ref_next(toks), 3.0, epoch=1)])
        toks.append(ref_next(toks))
    tail = ctl._check_tail("w")  # the finish barrier: everything checked, the rollback told again
    assert not tail.error and tail.epoch == 1 and tail.verified == 8 and tail.rollback.epoch == 1
    # the verifier dropped its positions past the flip and caught up from the verifier's token
    assert any(it.rewind for it in ctl.vclient.items) and ctl.vclient.seen["w"][:len(toks) - 1] == toks[:-1]
    ctl._finish(P.Finish(rid="w", output=toks[2:], max_new=12, stop_ids=[]))
    assert ctl._verdict("w").state == "verified" and toks[2:] == ref[:8]


def test_an_abort_before_the_seam_applied_a_rollback_ends_aborted_not_failed(make_ctl):
    # the check cut the answer at a flip; SGLang aborted the request before its next forward, so
    # its answer still holds the old timeline past the cut (Finish.epoch 0 < the controller's 1)
    ctl = make_ctl("margin", 0.5)
    prompt, flip = [2, 9], 2
    toks = list(prompt)
    for k in range(6):
        fast = ref_next(toks) if k != flip else (ref_next(toks) + 1) % 50
        ctl._step([_window_row(toks, k, fast, 0.1)])
        toks.append(fast)
    ctl.forwards = ctl.window_due
    ctl._idle_turn()
    st = ctl.reqs["w"]
    assert st.epoch == 1 and st.steps == flip + 1 and "w" in ctl.rollbacks
    ctl._finish(P.Finish(rid="w", output=toks[2:], aborted=True, reason="client gone", epoch=0))
    v = ctl._verdict("w")
    assert v.state == "aborted" and not st.error and ctl.rollbacks == {}
    # the same answer with the rollback applied (epoch 1) must agree with mg's tokens: it fails
    ctl._step([_window_row([5, 5], 0, 1, 9.0, rid="x")])
    ctl._finish(P.Finish(rid="x", output=[1, 2, 3], aborted=True, reason="cut", epoch=0))
    assert ctl._verdict("x").state == "failed"


def test_a_window_request_is_checked_every_window_and_at_its_finish_barrier(make_ctl):
    ctl = make_ctl("margin", 0.5)
    prompt = [3, 1]
    toks = list(prompt)
    for k in range(ctl.cfg.window + 3):  # high margins only: a check once `window` tokens wait
        ctl._step([_window_row(toks, k, ref_next(toks), 9.0)])
        toks.append(ref_next(toks))
        assert ctl._checks_due() == (k == ctl.cfg.window - 1)
        if k == ctl.cfg.window - 1:
            ctl._idle_turn()
            assert ctl.reqs["w"].checked == ctl.cfg.window
    tail = ctl._check_tail("w")
    assert tail.rollback is None and tail.verified == ctl.cfg.window + 3 and ctl.checks == {}


def test_a_row_after_its_requests_finish_is_dropped_as_a_look_ahead(make_ctl):
    """The seam reports a checked end at once from the scheduler thread, so a look-ahead row
    classified before it may arrive after the Finish: never emitted, not a position error."""
    ctl = make_ctl("margin", 0.5)
    emitted = run_request(ctl, "a", [5], 3, [9.0] * 3)
    before = ctl.m.lookahead._value.get()
    ctl._step([P.StepRow(rid="a", pos=len(emitted) - 1, margin=9.0, fast_token=1)])
    assert not ctl.reqs["a"].error and ctl.m.lookahead._value.get() == before + 1
    assert ctl._verdict("a").state == "verified"


def test_the_finish_barrier_checks_every_window_request_in_one_call(make_ctl):
    # requests of one batch end in the same forward: the first barrier's call takes all of them
    ctl = make_ctl("margin", 0.5)
    toks = {"a": [3, 1], "b": [4, 1, 5]}
    for k in range(5):  # high margins, fewer than a window: nothing checked yet
        for rid in ("a", "b"):
            ctl._step([_window_row(toks[rid], k, ref_next(toks[rid]), 9.0, rid=rid)])
            toks[rid].append(ref_next(toks[rid]))
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


def test_missed_flips_count_answers_no_rollback_could_fix_not_repairs(make_ctl):
    # mg_audit_mismatch: a disagreement rolled back before anyone saw it is a repair only; a
    # stream's token let out before its check, and a flip the final audit finds, are missed flips
    ctl = make_ctl("margin", 0.5)
    counts = lambda: (ctl.m.missed_flips._value.get(), ctl.m.repair._value.get())
    missed, repairs = counts()
    toks = {}
    for rid, margin, released in (("held", 0.1, False), ("stream", 3.0, True)):
        toks[rid] = t = [2, 9]
        for k in range(5):  # a flip at answer index 2
            row = _window_row(t, k, ref_next(t) if k != 2 else (ref_next(t) + 1) % 50, margin, rid=rid)
            row.released = released
            ctl._step([row])
            t.append(row.fast_token)
        ctl._check_tail(rid)
    assert ctl.reqs["held"].epoch == 1 and ctl.reqs["stream"].epoch == 0
    assert counts() == (missed + 1, repairs + 1)
    run_request(ctl, "c", [3, 3], 5, [9.0] * 5, flip_at=2)  # high margins, unchecked until the final audit
    assert ctl._verdict("c").state == "mismatch" and counts() == (missed + 2, repairs + 1)
    t = toks["stream"]
    for k in range(5, 7):  # the stream runs on unchecked; its final audit finds it wrong again
        ctl._step([_window_row(t, k, ref_next(t), 3.0, rid="stream")])
        t.append(ref_next(t))
    ctl._finish(P.Finish(rid="stream", output=t[2:], max_new=7, stop_ids=[]))
    assert ctl._verdict("stream").state == "mismatch" and counts() == (missed + 2, repairs + 1)  # once an answer


def test_a_held_ends_surplus_is_checked_at_once_and_a_flip_in_it_leaves_the_answer_verified(make_ctl):
    # SGLang ended the request after 4 tokens (unchecked: high margins, fewer than a window); the
    # seam holds the end and SGLang decodes on, its surplus rows marked due; the surplus' first
    # token is a flip
    ctl = make_ctl("margin", 0.5)
    prompt, n = [3, 1], 4
    toks = list(prompt)
    for k in range(n):
        ctl._step([_window_row(toks, k, ref_next(toks), 9.0)])
        toks.append(ref_next(toks))
    assert not ctl._checks_due()
    row = _window_row(toks, n, (ref_next(toks) + 1) % 50, 9.0)  # the surplus' first row
    row.due = True
    ctl._step([row])
    toks.append(row.fast_token)
    assert ctl._checks_due()  # at once, not a window or a check delay later
    ctl._idle_turn()
    st = ctl.reqs["w"]
    assert st.checked >= n and len(ctl.vclient.calls) == 1
    rb = ctl.handle(P.WindowNews()).rollbacks
    assert [r.index for r in rb] == [n] and st.epoch == 1  # past the end: the seam finds it moot
    ctl._finish(P.Finish(rid="w", output=toks[2:2 + n], max_new=n, stop_ids=[], epoch=0))
    ctl._complete(["w"])
    assert ctl._verdict("w").state == "verified" and not st.error and st.tokens == toks[:2 + n]


def test_a_held_ends_later_surplus_rows_ask_for_no_check_once_its_end_is_checked(make_ctl):
    # the end's check came back while SGLang decoded two more surplus rows (the seam has not heard
    # yet): checking those would only be another verifier call for tokens no one will see
    ctl = make_ctl("margin", 0.5)
    toks = [3, 1]
    for k in range(7):
        row = _window_row(toks, k, ref_next(toks), 9.0)
        row.due = k >= 4  # SGLang ended it after 4 tokens
        ctl._step([row])
        toks.append(ref_next(toks))
        assert ctl._checks_due() == (k == 4)
        ctl._idle_turn()
    assert len(ctl.vclient.calls) == 1 and ctl.reqs["w"].checked == 5


def test_a_check_of_many_requests_is_split_into_calls_the_verifier_accepts(make_ctl):
    # 70 requests due together: at most 64 items (the verifier's slots) and, beyond one item,
    # at most catchup_chunk rows per call, so the verify timeout bounds each call
    ctl = make_ctl("margin", 0.5)
    toks = {f"r{i}": [i % 40 + 1, 2] for i in range(70)}
    calls = _due_check_calls(ctl, toks, 5)
    assert len(calls) >= 2 and sum(len(c) for c in calls) == 70
    assert all(len(c) <= 64 and sum(len(it.tokens) for it in c) <= ctl.cfg.catchup_chunk for c in calls)
    assert all(ctl.reqs[rid].checked == 5 and not ctl.reqs[rid].error for rid in toks)


def test_an_arrived_prompt_is_computed_after_sglangs_prefill_and_its_first_token_checked_without_a_call(
        make_ctl):
    """Arrive (a deterministic request reached SGLang's scheduler): its prompt is computed at the
    first idle turn after its first step (SGLang's prefill is over), and that step's token is
    checked against the prediction in the same turn: no check call, no check delay."""
    ctl = make_ctl("margin", 0.5)
    prompt = [2, 9, 4]
    assert ctl.handle(P.Arrive(rid="a", prompt=prompt)) is None  # one way
    assert ctl._verdict("a").state == P.VerdictState.UNKNOWN  # no step yet: as if unseen
    ctl._idle_turn()
    assert ctl.vclient.items == [] and "a" in ctl.arrivals  # SGLang prefills it: the verifier waits
    ctl._step([_window_row(prompt, 0, ref_next(prompt), 0.1, rid="a")])  # a low margin
    ctl._idle_turn()
    (item,) = ctl.vclient.items
    assert (item.pos, item.tokens, item.prompt_len) == (2, prompt, 3) and not ctl.arrivals
    st = ctl.reqs["a"]
    assert st.pred == ref_next(prompt)
    assert st.checked == 1 and st.verified == [2] and ctl.checks == {} and len(ctl.vclient.items) == 1
    assert ctl.handle(P.WindowNews()).verified == {"a": [0, 1]}
    toks = prompt + [ref_next(prompt)]
    for k in range(1, 4):
        ctl._step([_window_row(toks, k, ref_next(toks), 3.0, rid="a")])
        toks.append(ref_next(toks))
    ctl._finish(P.Finish(rid="a", output=toks[3:], max_new=4, stop_ids=[]))
    assert ctl._verdict("a").state == "verified"
    assert ctl.vclient.items[1].tokens == toks[3:-1]  # the tail audit went on from the prompt's end


def test_a_first_token_that_differs_from_the_arrivals_prediction_is_rolled_back(make_ctl):
    ctl = make_ctl("margin", 0.5)
    prompt = [5, 1]
    ctl.handle(P.Arrive(rid="a", prompt=prompt))
    wrong = (ref_next(prompt) + 1) % 50
    ctl._step([_window_row(prompt, 0, wrong, 0.1, rid="a")])
    ctl._idle_turn()  # the prompt, then the first token against its prediction
    st = ctl.reqs["a"]
    assert st.epoch == 1 and st.tokens == prompt + [ref_next(prompt)] and st.checked == 1
    assert ctl.handle(P.WindowNews()).rollbacks == [P.Rollback(rid="a", index=0, token=ref_next(prompt), epoch=1)]


def test_a_step_before_the_arrivals_prefill_keeps_its_state_and_another_prompt_starts_afresh(make_ctl):
    ctl = make_ctl("margin", 0.5)
    prompt = [3, 3, 7]
    ctl.handle(P.Arrive(rid="a", prompt=prompt))
    ctl._step([_window_row(prompt, 0, ref_next(prompt), 3.0, rid="a")])  # before any idle turn
    assert not ctl.reqs["a"].arrived_at and not ctl.reqs["a"].error
    ctl._idle_turn()  # the prefill, then the first token's check
    assert ctl.reqs["a"].checked == 1
    ctl.handle(P.Arrive(rid="b", prompt=[1, 2]))
    ctl._idle_turn()
    ctl._step([_window_row([1, 4], 0, ref_next([1, 4]), 3.0, rid="b")])  # not the prompt that arrived
    st = ctl.reqs["b"]
    assert st.tokens == [1, 4, ref_next([1, 4])] and st.verifier_len == 0 and st.rewind and not st.error


def test_an_arrival_that_never_steps_is_forgotten_and_released(make_ctl, monkeypatch):
    from mg_server.controller import arrivals

    ctl = make_ctl("margin", 0.5)
    ctl.handle(P.Arrive(rid="gone", prompt=[4, 4]))
    ctl._idle_turn()
    assert ctl.vclient.items == []  # held while SGLang may prefill it
    monkeypatch.setattr(arrivals, "PREFILL_HOLD_S", 0.0)  # the hold is bounded: computed once it ends
    ctl._idle_turn()
    assert [it.rid for it in ctl.vclient.items] == ["gone"]
    monkeypatch.setattr(arrivals, "ARRIVAL_TTL_S", 0.0)
    ctl._arrivals_swept = 0.0  # (the held turn swept already: sweeps are a second apart)
    ctl._sweep_arrivals()
    assert "gone" not in ctl.reqs and ctl.vclient.released == ["gone"]
    assert ctl._verdict("gone").state == P.VerdictState.UNKNOWN


def test_arrivals_in_mode_off_are_ignored(make_ctl):
    ctl = make_ctl("off", 0.0)
    ctl.handle(P.Arrive(rid="a", prompt=[1, 2]))
    assert not ctl.arrivals and "a" not in ctl.reqs


def test_one_arrival_in_sglangs_prefill_holds_every_arrived_prompt(make_ctl):
    """While any arrival waits for its first step, no arrived prompt is computed (the verifier's
    prefill would take turns with SGLang's); the last first step releases them all."""
    ctl = make_ctl("margin", 0.5)
    ctl.handle(P.Arrive(rid="a", prompt=[1, 5]))
    ctl.handle(P.Arrive(rid="b", prompt=[2, 5]))
    ctl._step([_window_row([1, 5], 0, ref_next([1, 5]), 3.0, rid="a")])
    ctl._idle_turn()
    assert ctl.vclient.items == [] and not ctl._arrivals_ready()  # b is still in SGLang's prefill
    ctl._step([_window_row([2, 5], 0, ref_next([2, 5]), 3.0, rid="b")])
    ctl._idle_turn()
    assert sorted(it.rid for it in ctl.vclient.items) == ["a", "b"] and not ctl.arrivals
    assert ctl.reqs["a"].checked == ctl.reqs["b"].checked == 1


def test_arrivals_and_due_checks_take_turns(make_ctl, monkeypatch):
    """A stream of arrivals never holds back the running requests' due checks: idle turns alternate."""
    from mg_server.controller import arrivals

    monkeypatch.setattr(arrivals, "PREFILL_HOLD_S", 0.0)  # (the arrivals are ready: no hold)
    ctl = make_ctl("margin", 0.5)
    toks = [4, 2]
    ctl._step([_window_row(toks, 0, ref_next(toks), 0.1, rid="run")])  # a low margin: a check queued
    ctl.forwards = ctl.window_due
    for k in range(3):
        ctl.handle(P.Arrive(rid=f"a{k}", prompt=[k + 1, 7]))
    ctl._rows_per_call = lambda: 2  # one arrival per turn
    ctl._idle_turn()  # an arrival
    assert ctl.vclient.calls[-1] == ["a0"] and "run" in ctl.checks
    ctl._idle_turn()  # the due check
    assert ctl.vclient.calls[-1] == ["run"] and not ctl.checks
    ctl._idle_turn()
    assert ctl.vclient.calls[-1] == ["a1"]
