# ruff: noqa: F811 - the fixtures hook_mod and runner come from test_hook
"""The lagged control path's host logic (mg_server/sglang_ext/lagged.py) on CPU tensors: what the
device is told (which rows need the verifier, the gate), what the host does one forward later
(reports, verify steps, repairs, the tokens written before the gate opens, failures). The device
gate is kernels.gate's CPU reference here (its CUDA kernel is checked against that reference in
tests/test_gate_gpu.py)."""

import sys
import threading
import time
from types import SimpleNamespace

import torch

from mg_server.runtime import protocol as P
from mg_server.sglang_ext import link as link_mod
from mg_server.runtime.policy import Policy
from test_hook import LAYERS, VOCAB, FakeReq, entry, fast, hook_mod, make_seam, runner, sampler_args  # noqa: F401 - fixtures


class Slots:
    """The verifier's slot buffer as the lagged path reads it: data [n, L, 2, Hkv, D], gens [n]."""

    def __init__(self, col):
        self.data = torch.zeros(8, *col.shape, dtype=col.dtype)
        self.data[5] = col
        self.gens = torch.full((8,), -1, dtype=torch.int64)
        self.gens[5] = 9

    def read(self, slot, gen):  # (the synchronous seam's repair reads a column this way)
        assert int(self.gens[slot]) == gen
        return self.data[slot].clone()


def lagged_seam(hook_mod, runner, decide, tmp_path, monkeypatch, policy, early=False, lag=False, ahead=None):
    """A seam on the lagged path with the CPU reference gate, its launches and answers recorded
    in seam.gates = SimpleNamespace(gates=[(need_any, target)], releases=[target]). `ahead`:
    answer(rid, pos) -> the controller's kept VerifyResult or None (--mg-verify-ahead)."""
    from mg_server.sglang_ext.lagged import LaggedControl

    seam = make_seam(hook_mod, runner, decide, tmp_path, monkeypatch, policy=policy)
    seam.link.slots = Slots(seam.link.slots.col)
    if ahead is not None:  # the hosted controller's client: ahead calls answered at once
        client = seam.link.client
        client.ahead_rows = []

        def verify_ahead(rows):
            client.ahead_rows.append([(r.rid, r.pos) for r in rows])
            done = threading.Event()
            done.set()
            return done
        client.verify_ahead, client.ahead_answer = verify_ahead, ahead
    seam.lagged = LaggedControl(seam, torch.device("cpu"), early=early, lag=lag, ahead=ahead is not None)
    log = seam.gates = SimpleNamespace(gates=[], releases=[], threads=[])
    gate = seam.lagged.gate
    launch, release = gate.launch, gate.release

    def rec_launch(margin, fast, pos, need, chosen, target):
        log.gates.append((int((need == 1).any()), target))  # (need 2: verified behind, no hold)
        launch(margin, fast, pos, need, chosen, target)

    def rec_release(target, tokens, repairs):
        log.releases.append(target)
        log.threads.append(threading.current_thread().name)
        release(target, tokens, repairs)

    monkeypatch.setattr(gate, "launch", rec_launch)
    monkeypatch.setattr(gate, "release", rec_release)
    return seam


def logits_with(top: int, margin: float) -> torch.Tensor:
    row = torch.zeros(1, VOCAB)
    row[0, top], row[0, (top + 1) % VOCAB] = 5.0, 5.0 - margin
    return row


def test_fast_steps_are_reported_one_forward_late_and_never_gate(hook_mod, runner, tmp_path, monkeypatch):
    seam = lagged_seam(hook_mod, runner, fast, tmp_path, monkeypatch, Policy("margin", 0.5))
    gates = seam.gates
    req = FakeReq("f", [1, 2, 3])
    client = seam.link.client
    logits = logits_with(7, 2.0)
    seam(None, sampler_args([(req, True)], logits, [2]))
    assert gates.gates == [(0, 1)] and client.reported == [] and len(seam.lagged.pending) == 1
    assert int(logits[0].argmax()) == 7 and torch.isinf(logits[0]).sum() == VOCAB - 1  # forced to fast
    seam(None, sampler_args([(req, True)], logits_with(11, 3.0), [3]))  # the next forward drains the first
    assert [(r.pos, r.prompt, r.fast_token) for r in client.reported] == [(2, [1, 2, 3], 7)]
    seam.lagged.drain(wait=True)
    assert [r.pos for r in client.reported] == [2, 3] and client.rows == [] and gates.releases == []
    assert seam.link.tracked["f"].tokens == [1, 2, 3, 7, 11] and req.to_finish is None


def test_a_low_margin_step_holds_the_gate_until_the_verified_token_is_written(hook_mod, runner, tmp_path,
                                                                              monkeypatch):
    def verify(row):
        return P.StepDecision(rid=row.rid, token=(row.fast_token + 1) % VOCAB, verified=True, repair=True,
                              slot=5, gen=9)

    seam = lagged_seam(hook_mod, runner, verify, tmp_path, monkeypatch, Policy("margin", 0.5))
    gates = seam.gates
    req = FakeReq("v", [4, 5])
    seam(None, sampler_args([(req, True)], logits_with(20, 0.1), [1]))
    assert gates.gates == [(1, 1)] and gates.releases == []  # the device holds; nothing released yet
    assert seam.lagged.gate.acked(1) is None  # holding
    seam.lagged.drain(wait=True)
    assert [r.pos for r in seam.link.client.rows] == [1] and gates.releases == [1]
    assert seam.lagged.chosen[:1].tolist() == [21] and seam.lagged.gate.acked(1) == 1  # the verifier's token
    assert seam.link.tracked["v"].tokens == [4, 5, 21]
    pool = runner.token_to_kv_pool
    for layer in range(LAYERS):  # position 1 of pool row 0 is slot 11
        assert torch.equal(pool.k_buffer[layer][11], seam.link.slots.data[5, layer, 0])
        assert torch.equal(pool.v_buffer[layer][11], seam.link.slots.data[5, layer, 1])


def test_always_gates_every_step_but_not_prefill_chunks(hook_mod, runner, tmp_path, monkeypatch):
    seam = lagged_seam(hook_mod, runner, fast, tmp_path, monkeypatch, Policy("always", 0.0))
    gates = seam.gates
    req = FakeReq("a", [1, 2, 3, 4])
    seam(None, sampler_args([(req, True)], logits_with(3, 9.0), [1]))  # a non-final prefill chunk
    seam.lagged.drain(wait=True)
    assert gates.gates == [(0, 1)] and seam.link.client.rows == [] and seam.link.client.reported == []
    seam(None, sampler_args([(req, True)], logits_with(3, 9.0), [3]))
    seam.lagged.drain(wait=True)
    assert gates.gates[-1] == (1, 2) and gates.releases == [2] and [r.pos for r in seam.link.client.rows] == [3]
    assert seam.lagged.pending == type(seam.lagged.pending)()


def test_a_missed_step_and_a_failed_controller_fail_the_request_and_open_the_gate(hook_mod, runner, tmp_path,
                                                                                   monkeypatch):
    def broken(row):
        return P.StepDecision(rid=row.rid, error="verifier: [internal] boom")

    seam = lagged_seam(hook_mod, runner, broken, tmp_path, monkeypatch, Policy("margin", 0.5))
    gates = seam.gates
    skip = FakeReq("s", [1, 2])
    seam(None, sampler_args([(skip, True)], logits_with(3, 9.0), [5]))  # position 5, mg holds 2 tokens
    seam.lagged.drain(wait=True)
    assert skip.to_finish is not None and gates.gates == [(0, 1)]
    low = FakeReq("l", [1, 2])
    seam(None, sampler_args([(low, True)], logits_with(8, 0.0), [1]))
    seam.lagged.drain(wait=True)
    assert gates.releases == [2] and seam.lagged.chosen[:1].tolist() == [8]  # opened, with the fast token
    assert low.to_finish is not None and "failed" in low.to_finish.message
    # later forwards of a failed request are not steps: no gate holds for them
    seam(None, sampler_args([(low, True)], logits_with(8, 0.0), [2]))
    seam.lagged.drain(wait=True)
    assert gates.gates[-1] == (0, 3)


def test_the_finish_watcher_drains_before_it_reports_an_end(hook_mod, runner, tmp_path, monkeypatch):
    seam = lagged_seam(hook_mod, runner, fast, tmp_path, monkeypatch, Policy("margin", 0.5))
    req = FakeReq("w", [1, 2])
    seam(None, sampler_args([(req, True)], logits_with(6, 4.0), [1]))
    order = []
    seam.link.client.report = lambda rows: order.append(("report", rows[0].pos))
    link = SimpleNamespace(tracked={"w": SimpleNamespace(req=req)}, lock=seam.link.lock, before_finish=seam.lagged.drain,
                           _finish=lambda rid, *rest: order.append(("finish", rid)))
    req.finished = lambda: True
    req.finished_reason, req.output_ids = None, [6]
    monkeypatch.setattr(link_mod, "end_rules", lambda req: {})
    hook_mod.ControllerLink._report_finished(link)
    assert order == [("report", 1), ("finish", "w")]


def test_a_finished_requests_last_forward_is_processed_while_mg_still_tracks_it(hook_mod, runner, tmp_path,
                                                                                monkeypatch):
    """The watcher sees a request finished while its last forward is still pending: that forward
    is processed as the request's step (not as a new request's), then the Finish goes out."""
    seam = lagged_seam(hook_mod, runner, fast, tmp_path, monkeypatch, Policy("margin", 0.5))
    req = FakeReq("z", [1, 2])
    seam(None, sampler_args([(req, True)], logits_with(6, 4.0), [1]))
    seam(None, sampler_args([(req, True)], logits_with(9, 4.0), [2]))  # processes the first
    assert len(seam.lagged.pending) == 1
    finished = []
    seam.link.before_finish = seam.lagged.drain
    seam.link._finish = lambda rid, *rest: finished.append(rid)
    req.finished = lambda: True
    req.finished_reason, req.output_ids = None, [6, 9]
    monkeypatch.setattr(link_mod, "end_rules", lambda req: {})
    hook_mod.ControllerLink._report_finished(seam.link)
    assert req.to_finish is None and finished == ["z"] and "z" not in seam.link.tracked
    assert [r.pos for r in seam.link.client.reported] == [1, 2]  # both steps of z, none refused


def test_mg_processor_alone_takes_the_lagged_path_and_a_foreign_one_keeps_the_synchronous_path(
        hook_mod, runner, tmp_path, monkeypatch):
    seam = lagged_seam(hook_mod, runner, fast, tmp_path, monkeypatch, Policy("margin", 0.5))
    gates = seam.gates
    req = FakeReq("p", [1, 2])
    args = sampler_args([(req, True)], logits_with(4, 3.0), [1])
    seam(None, args)
    assert len(seam.lagged.pending) == 1  # lagged
    seam.lagged.drain(wait=True)
    # a user's processor in the batch (it may read the logits on the host), so no gate
    other = FakeReq("q", [1, 2])
    args = sampler_args([(other, True)], logits_with(4, 3.0), [1])
    args[1].custom_logit_processor[2] = entry(object())
    seam(None, args)
    assert not seam.lagged.pending
    assert [r.rid for r in seam.link.client.reported] == ["p", "q"] and len(gates.gates) == 1


def _verify(row):
    """The controller with tau 0.5: a low-margin row verified (the verifier disagrees), others fast."""
    if row.margin >= 0.5:
        return P.StepDecision(rid=row.rid, token=row.fast_token)
    return P.StepDecision(rid=row.rid, token=(row.fast_token + 1) % VOCAB, verified=True, repair=True, slot=5, gen=9)


def test_a_gate_that_timed_out_fails_the_rows_it_held(hook_mod, runner, tmp_path, monkeypatch):
    seam = lagged_seam(hook_mod, runner, _verify, tmp_path, monkeypatch, Policy("margin", 0.5))
    gate = seam.lagged.gate
    monkeypatch.setattr(gate, "release", lambda target, tokens, repairs: gate.ack[:2].copy_(torch.tensor([target, 2])))
    low, high = FakeReq("t", [4, 5]), FakeReq("h", [4, 5], pool_idx=1)
    logits = torch.cat([logits_with(20, 0.1), logits_with(30, 4.0)])
    seam(None, sampler_args([(low, True), (high, True)], logits, [1, 1]))
    before = seam.lagged.timeouts._value.get()
    seam.lagged.drain(wait=True)
    assert seam.lagged.timeouts._value.get() == before + 1
    assert low.to_finish is not None and "status" not in low.to_finish.message  # internal detail stays in the log
    assert seam.link.tracked["t"].failed and high.to_finish is None  # the fast row passed the gate untouched
    assert not runner.token_to_kv_pool.k_buffer[0][11].any()  # nothing repaired


def test_a_slot_reused_during_the_repair_fails_the_request(hook_mod, runner, tmp_path, monkeypatch):
    seam = lagged_seam(hook_mod, runner, _verify, tmp_path, monkeypatch, Policy("margin", 0.5))
    gate, slots = seam.lagged.gate, seam.link.slots
    release = gate.release

    def racing(target, tokens, repairs):
        release(target, tokens, repairs)
        slots.gens[5] = 10  # the verifier wrote the slot again before the copy was acknowledged

    monkeypatch.setattr(gate, "release", racing)
    req = FakeReq("r", [4, 5])
    seam(None, sampler_args([(req, True)], logits_with(20, 0.1), [1]))
    seam.lagged.drain(wait=True)
    assert req.to_finish is not None and seam.link.tracked["r"].failed


def test_a_stale_slot_is_never_copied(hook_mod, runner, tmp_path, monkeypatch):
    seam = lagged_seam(hook_mod, runner, _verify, tmp_path, monkeypatch, Policy("margin", 0.5))
    seam.link.slots.gens[5] = 11
    req = FakeReq("s", [4, 5])
    seam(None, sampler_args([(req, True)], logits_with(20, 0.1), [1]))
    seam.lagged.drain(wait=True)
    assert req.to_finish is not None and seam.gates.releases == [1]
    assert not runner.token_to_kv_pool.k_buffer[0][11].any()


def test_a_released_requests_lookahead_step_is_not_repaired(hook_mod, runner, tmp_path, monkeypatch):
    """Processed one forward late, the overlap scheduler's step after a request's last token can
    find the request already released by SGLang (req_pool_idx None): nothing to repair, no failure."""
    seam = lagged_seam(hook_mod, runner, _verify, tmp_path, monkeypatch, Policy("margin", 0.5))
    req = FakeReq("e", [4, 5])
    seam(None, sampler_args([(req, True)], logits_with(20, 0.1), [1]))
    req.kv.req_pool_idx = None
    seam.lagged.drain(wait=True)
    assert req.to_finish is None and seam.gates.releases == [1] and seam.lagged.chosen[:1].tolist() == [21]
    assert not runner.token_to_kv_pool.k_buffer[0][11].any()


def test_the_schedulers_drain_waits_for_a_forward_the_watcher_is_processing(hook_mod, runner, tmp_path, monkeypatch):
    """The next launch reads mg's token counts: a forward the finish watcher has taken up must be
    finished before the scheduler's drain returns."""
    import threading

    seam = lagged_seam(hook_mod, runner, fast, tmp_path, monkeypatch, Policy("margin", 0.5))
    req = FakeReq("c", [1, 2])
    seam(None, sampler_args([(req, True)], logits_with(6, 4.0), [1]))
    entered, go = threading.Event(), threading.Event()
    report = seam.link.client.report

    def slow(rows):
        entered.set()
        go.wait(5)
        report(rows)

    seam.link.client.report = slow
    watcher = threading.Thread(target=seam.lagged.drain, args=(False,))
    watcher.start()
    assert entered.wait(5)
    scheduler = threading.Thread(target=seam.lagged.drain, args=(True,))
    scheduler.start()
    scheduler.join(0.2)
    assert scheduler.is_alive()  # waiting for the watcher's forward
    go.set()
    watcher.join(5)
    scheduler.join(5)
    assert not scheduler.is_alive() and seam.link.tracked["c"].tokens == [1, 2, 6] and not seam.lagged.pending


def test_the_watchdog_opens_a_gate_left_unanswered(hook_mod, runner, tmp_path, monkeypatch):
    from mg_server.sglang_ext import lagged

    seam = lagged_seam(hook_mod, runner, _verify, tmp_path, monkeypatch, Policy("margin", 0.5))
    req = FakeReq("g", [4, 5])
    seam(None, sampler_args([(req, True)], logits_with(20, 0.1), [1]))
    now = [100.0]
    with monkeypatch.context() as m:
        m.setattr(lagged.time, "monotonic", lambda: now[0])
        seam.lagged.watchdog()  # first sight
        limit = seam.lagged.gate_timeout_s
        assert limit == max(lagged.GATE_TIMEOUT_S, seam.config.step_timeout_s)  # a verify call's own bound
        now[0] += limit / 2
        seam.lagged.watchdog()
        assert seam.lagged.gate.acked(1) is None  # still held
        now[0] += limit
        seam.lagged.watchdog()
    assert seam.lagged.gate.acked(1) == 2 and seam.lagged.chosen[:1].tolist() == [20]  # opened, fast token
    seam.lagged.drain(wait=True)
    assert req.to_finish is not None and seam.link.tracked["g"].failed
    assert not runner.token_to_kv_pool.k_buffer[0][11].any()


def test_a_forward_is_pending_before_its_gate_is_enqueued(hook_mod, runner, tmp_path, monkeypatch):
    """Once a holding gate is enqueued, the scheduler thread's next CUDA call may block until it
    opens; only a forward in `pending` gets answered, so it must be there first."""
    seam = lagged_seam(hook_mod, runner, _verify, tmp_path, monkeypatch, Policy("margin", 0.5))
    gate = seam.lagged.gate
    launch, seen = gate.launch, []

    def check(margin, fast, pos, need, chosen, target):
        seen.append([f.target for f in seam.lagged.pending])
        launch(margin, fast, pos, need, chosen, target)

    monkeypatch.setattr(gate, "launch", check)
    seam(None, sampler_args([(FakeReq("p", [4, 5]), True)], logits_with(20, 0.1), [1]))
    assert seen == [[1]]
    monkeypatch.setattr(gate, "launch", lambda *a: (_ for _ in ()).throw(RuntimeError("launch failed")))
    try:
        seam.lagged.launch(logits_with(20, 0.1), torch.tensor([2]), [(0, FakeReq("q", [4, 5]), "q")])
    except RuntimeError:
        pass
    assert [f.target for f in seam.lagged.pending] == [1]  # the failed launch left nothing to wait for


def test_a_host_failure_opens_the_gate_unanswered_and_fails_the_forwards_rows(hook_mod, runner, tmp_path,
                                                                            monkeypatch):
    """An exception while the host processes a holding forward must not leave the stream held nor
    let the fast tokens through as an answer: status 2 (opened unanswered), every row failed."""
    seam = lagged_seam(hook_mod, runner, _verify, tmp_path, monkeypatch, Policy("margin", 0.5))
    low, high = FakeReq("x", [4, 5]), FakeReq("y", [4, 5], pool_idx=1)
    seam(None, sampler_args([(low, True), (high, True)], torch.cat([logits_with(20, 0.1), logits_with(30, 4.0)]),
                            [1, 1]))
    monkeypatch.setattr(seam, "decide", lambda *a: (_ for _ in ()).throw(RuntimeError("controller link broke")))
    seam.lagged.drain(wait=True)
    assert seam.lagged.gate.acked(1) == 2 and seam.gates.releases == [] and not seam.lagged.pending
    assert seam.lagged.chosen[:2].tolist() == [20, 30]  # the fast tokens, nothing the host wrote
    assert low.to_finish is not None and high.to_finish is not None  # both aborted, loudly
    assert not {"x", "y"} & set(seam.link.tracked)  # never committed: nothing to mark


def test_a_resumable_low_margin_step_never_holds_the_gate(hook_mod, runner, tmp_path, monkeypatch):
    from mg_server.config import RESUME_PARAM

    seam = lagged_seam(hook_mod, runner, fast, tmp_path, monkeypatch, Policy("margin", 0.5))
    gates, client = seam.gates, seam.link.client
    lazy = FakeReq("z", [1, 2], custom_params={RESUME_PARAM: True}, stop_strs=None)
    held = FakeReq("h", [1, 2], pool_idx=1)  # the same low margin without the flag holds
    seam(None, sampler_args([(lazy, True)], logits_with(9, 0.1), [1]))
    seam.lagged.drain(wait=True)
    assert gates.gates == [(0, 1)] and gates.releases == [] and client.rows == []
    assert [(r.pos, r.fast_token, r.resumable) for r in client.reported] == [(1, 9, True)]
    assert seam.link.tracked["z"].tokens == [1, 2, 9] and seam.link.tracked["z"].resumable
    seam(None, sampler_args([(held, True)], logits_with(9, 0.1), [1]))
    seam.lagged.drain(wait=True)
    assert gates.gates[-1] == (1, 2) and [r.resumable for r in client.rows] == [False]
    # stop strings (a text rule the resume cannot follow): never resumable, whatever the flag
    text = FakeReq("t", [1, 2], pool_idx=2, custom_params={RESUME_PARAM: True}, stop_strs=["\n"])
    assert not hook_mod.resumable(text) and hook_mod.resumable(lazy)


def test_early_verify_answers_a_holding_gate_without_waiting_for_the_next_sampler_call(hook_mod, runner, tmp_path,
                                                                                       monkeypatch):
    """--mg-early-verify: the thread verifies a holding forward once it is published (the
    scheduler thread never drains here), repairs and answers it; fast-only forwards are left to
    the scheduler's next drain, as without it."""
    from mg_server.sglang_ext import lagged

    switch = sys.getswitchinterval()
    try:
        seam = lagged_seam(hook_mod, runner, _verify, tmp_path, monkeypatch, Policy("margin", 0.5), early=True)
        gates, client, gate = seam.gates, seam.link.client, seam.lagged.gate
        req = FakeReq("e", [4, 5])
        seam(None, sampler_args([(req, True)], logits_with(20, 0.1), [1]))
        deadline = time.monotonic() + 5
        while seam.lagged.pending and time.monotonic() < deadline:  # (popped once the thread is done)
            time.sleep(0.005)
        with seam.lagged.lock:
            assert gate.acked(1) == 1 and gates.threads == ["mg-early-verify"]  # released by the thread
        assert seam.lagged.chosen[:1].tolist() == [21] and [r.pos for r in client.rows] == [1]
        assert not seam.lagged.pending and seam.link.tracked["e"].tokens == [4, 5, 21]
        pool = runner.token_to_kv_pool
        assert torch.equal(pool.k_buffer[0][11], seam.link.slots.data[5, 0, 0])  # repaired
        assert sys.getswitchinterval() <= lagged.EARLY_SWITCH_S
        # a fast-only forward: not the thread's (the next sampler call reports it, as before)
        seam(None, sampler_args([(req, True)], logits_with(7, 3.0), [2]))
        time.sleep(0.3)
        assert client.reported == [] and len(seam.lagged.pending) == 1
        seam.lagged.drain(wait=True)
        assert [r.pos for r in client.reported] == [2] and [r.pos for r in client.rows] == [1]
        assert gates.releases == [1] and seam.link.tracked["e"].tokens == [4, 5, 21, 7]
    finally:
        sys.setswitchinterval(switch)


def test_lag_lets_the_fast_token_through_and_corrects_it_before_sglang_emits_it(hook_mod, runner, tmp_path,
                                                                                 monkeypatch):
    """--mg-commit lag (lagcommit.py): a low-margin row never holds; the verifier, asked one
    forward late, disagrees; the token SGLang appends is the verifier's, and the request's next
    forward (computed from the fast token) holds as a MUST row: verified whatever its margin,
    forced to the verifier's token, its K/V column and the deferred one repaired."""
    def verify(row):
        if row.must:
            return P.StepDecision(rid=row.rid, token=33, verified=True, repair=True, slot=5, gen=9)
        return P.StepDecision(rid=row.rid, token=(row.fast_token + 1) % VOCAB, verified=True, repair=True,
                              slot=5, gen=9)

    seam = lagged_seam(hook_mod, runner, verify, tmp_path, monkeypatch, Policy("margin", 0.5), lag=True)
    gates, client, lag = seam.gates, seam.link.client, seam.lagged
    req = FakeReq("g", [4, 5])
    logits = logits_with(20, 0.1)
    seam(None, sampler_args([(req, True)], logits, [1]))
    assert gates.gates == [(0, 1)] and int(logits[0].argmax()) == 20  # no hold: the fast token goes through
    assert client.rows == [] and lag.gate.acked(1) == 0
    # the next forward (input: the fast token 20) drains the first: the verifier says 21
    seam(None, sampler_args([(req, True)], logits_with(7, 9.0), [2]))
    assert [(r.pos, r.must) for r in client.rows] == [(1, False)] and seam.link.tracked["g"].tokens == [4, 5, 21]
    assert gates.gates[-1] == (1, 2) and gates.releases == []  # a MUST row, whatever its margin: held
    req.output_ids.append(20)  # SGLang processes the first forward after launching the second
    assert list(req.output_ids) == [21] and type(req.output_ids).__name__ == "Outputs"
    # the swap also answered the MUST forward: SGLang may release the request in this same call
    # (when 21 ends it), and its columns must be repaired while it still holds them
    assert gates.releases == [2] and not lag.pending
    req.kv.req_pool_idx = None  # (released: nothing is left to do with its slots)
    lag.drain(wait=True)
    # the verify-behind row says so (the controller chains its MUST step: StepRow.behind)
    assert [(r.pos, r.must, r.behind) for r in client.rows] == [(1, False, True), (2, True, False)]
    assert gates.releases == [2] and lag.chosen[:1].tolist() == [33] and seam.link.tracked["g"].tokens == [4, 5, 21, 33]
    pool = runner.token_to_kv_pool
    for pos in (1, 2):  # the deferred repair of position 1 and the MUST row's own (pool row 0: slot 10 + pos)
        for layer in range(LAYERS):
            assert torch.equal(pool.k_buffer[layer][10 + pos], seam.link.slots.data[5, layer, 0])
    req.output_ids.extend([33])  # (a decode step's tokens come as a list)
    assert list(req.output_ids) == [21, 33] and lag.fixups == {} and lag.corrections == {} and lag.unsettled == {}
    assert req.to_finish is None


def test_lag_ahead_answers_the_must_forward_at_the_swap_without_waiting_for_it(hook_mod, runner, tmp_path,
                                                                               monkeypatch):
    """--mg-verify-ahead: the MUST forward's answer (the verifier's token for it and its K/V
    column) was asked for at its launch, so the swap writes it to that forward's gate at once
    (lagcommit.answer_ahead) instead of waiting for the forward's values; the forward is then
    processed as any other, its Step committing the same answer, and nothing is released twice."""
    def verify(row):
        token = 33 if row.must else (row.fast_token + 1) % VOCAB
        return P.StepDecision(rid=row.rid, token=token, verified=True, repair=True, slot=5, gen=9)

    def answer(rid, pos):  # the controller's kept answer for the MUST step (position 2)
        return P.VerifyResult(rid=rid, pos=pos, token=33, margin=1.0, slot=5, gen=9) if pos == 2 else None

    seam = lagged_seam(hook_mod, runner, verify, tmp_path, monkeypatch, Policy("margin", 0.5), lag=True,
                       ahead=answer)
    gates, client, lag = seam.gates, seam.link.client, seam.lagged
    req = FakeReq("g", [4, 5])
    seam(None, sampler_args([(req, True)], logits_with(20, 0.1), [1]))
    assert client.ahead_rows == []  # (its first step: the controller does not know it yet)
    seam(None, sampler_args([(req, True)], logits_with(7, 9.0), [2]))  # drains the first: 21; a MUST row
    assert client.ahead_rows == [[("g", 2)]] and gates.gates[-1] == (1, 2) and gates.releases == []
    req.output_ids.append(20)  # the swap: answered from the kept answer, the forward still pending
    assert list(req.output_ids) == [21] and gates.releases == [2] and len(lag.pending) == 1 and lag.fixups == {}
    assert lag.chosen[:1].tolist() == [33] and lag.answered_ahead._value.get() == 1
    pool = runner.token_to_kv_pool
    for pos in (1, 2):  # the deferred repair and the MUST row's own, written by that answer
        for layer in range(LAYERS):
            assert torch.equal(pool.k_buffer[layer][10 + pos], seam.link.slots.data[5, layer, 0])
    seam(None, sampler_args([(req, True)], logits_with(3, 9.0), [3]))  # processed as any forward
    assert [(r.pos, r.must) for r in client.rows] == [(1, False), (2, True)] and gates.releases == [2]
    assert seam.link.tracked["g"].tokens == [4, 5, 21, 33] and client.ahead_rows[-1] == [("g", 3)]
    req.output_ids.append(33)
    assert list(req.output_ids) == [21, 33] and lag.corrections == {} and req.to_finish is None


def test_lag_ahead_a_fast_row_that_differs_from_its_answer_is_corrected_behind(hook_mod, runner, tmp_path,
                                                                              monkeypatch):
    """--mg-verify-ahead: a lag row above tau (no gate, no verify call) whose step the verifier
    answered ahead with another token is sent to the Step as a behind row (LagCommit.promote_ahead),
    so its correction swaps the token before SGLang appends it and its next step is a MUST row."""
    kept = {2: (21, -1, -1), 3: (3, 5, 9)}  # position -> the verifier's token and K/V column (slot, gen)

    def verify(row):
        token, slot, gen = kept[row.pos]
        return P.StepDecision(rid=row.rid, token=token, verified=True, repair=True, slot=slot, gen=gen)

    def answer(rid, pos):  # the controller's kept answers (position 2: the fast path says 7)
        token, slot, gen = kept[pos]
        return P.VerifyResult(rid=rid, pos=pos, token=token, margin=1.0, slot=slot, gen=gen)

    seam = lagged_seam(hook_mod, runner, verify, tmp_path, monkeypatch, Policy("margin", 0.5), lag=True,
                       ahead=answer)
    gates, client, lag = seam.gates, seam.link.client, seam.lagged
    req = FakeReq("p", [4, 5])
    seam(None, sampler_args([(req, True)], logits_with(20, 9.0), [1]))  # its first step: no answer ahead
    seam(None, sampler_args([(req, True)], logits_with(7, 9.0), [2]))
    req.output_ids.append(20)
    assert client.rows == [] and client.ahead_rows == [[("p", 2)]]
    seam(None, sampler_args([(req, True)], logits_with(30, 9.0), [3]))  # processes position 2: 7 differs
    assert [(r.pos, r.behind, r.must) for r in client.rows] == [(2, True, False)]
    assert client.ahead_rows[-1] == [("p", 3)] and gates.gates[-1] == (1, 3)  # a MUST row: it holds
    req.output_ids.extend([7])  # the swap; the MUST forward is answered from its answer kept ahead
    assert list(req.output_ids) == [20, 21] and gates.releases == [3] and lag.chosen[:1].tolist() == [3]
    lag.drain(wait=True)
    assert [(r.pos, r.behind, r.must) for r in client.rows] == [(2, True, False), (3, False, True)]
    assert seam.link.tracked["p"].tokens == [4, 5, 20, 21, 3] and lag.fixups == {} and req.to_finish is None


def test_lag_agreement_costs_nothing_and_an_early_append_drains_its_forward(hook_mod, runner, tmp_path,
                                                                            monkeypatch):
    def agree(row):
        return P.StepDecision(rid=row.rid, token=row.fast_token, verified=True, slot=5, gen=9)

    seam = lagged_seam(hook_mod, runner, agree, tmp_path, monkeypatch, Policy("margin", 0.5), lag=True)
    gates, client, lag = seam.gates, seam.link.client, seam.lagged
    req = FakeReq("h", [4, 5])
    seam(None, sampler_args([(req, True)], logits_with(20, 0.1), [1]))
    # SGLang appends before any later sampler call (e.g. two prefills in a row): the append drains
    req.output_ids.append(20)
    assert [r.pos for r in client.rows] == [1] and list(req.output_ids) == [20] and not lag.pending
    seam(None, sampler_args([(req, True)], logits_with(9, 0.1), [2]))
    seam(None, sampler_args([(req, True)], logits_with(3, 9.0), [3]))
    assert gates.gates == [(0, 1), (0, 2), (0, 3)] and gates.releases == []  # never held
    assert [(r.pos, r.must) for r in client.rows] == [(1, False), (2, False)] and lag.fixups == {}
    assert seam.link.tracked["h"].tokens == [4, 5, 20, 9]


def test_lag_a_must_step_on_the_synchronous_path_is_verified_and_repaired(hook_mod, runner, tmp_path,
                                                                           monkeypatch):
    """The request's next forward takes the synchronous seam (a user's logit processor joined the
    batch): its MUST step is still verified whatever its margin, and both columns repaired."""
    def verify(row):
        token = 33 if row.must else (row.fast_token + 1) % VOCAB
        return P.StepDecision(rid=row.rid, token=token, verified=True, repair=True, slot=5, gen=9)

    seam = lagged_seam(hook_mod, runner, verify, tmp_path, monkeypatch, Policy("margin", 0.5), lag=True)
    client, lag = seam.link.client, seam.lagged
    req = FakeReq("s", [4, 5])
    seam(None, sampler_args([(req, True)], logits_with(20, 0.1), [1]))
    args = sampler_args([(req, True)], logits_with(7, 9.0), [2])
    args[1].custom_logit_processor[2] = entry(object())  # not mg's: the synchronous path
    seam(None, args)
    assert [(r.pos, r.must) for r in client.rows] == [(1, False), (2, True)] and len(seam.gates.gates) == 1
    assert int(args[0].next_token_logits[0].argmax()) == 33 and seam.link.tracked["s"].tokens == [4, 5, 21, 33]
    pool = runner.token_to_kv_pool
    for pos in (1, 2):
        for layer in range(LAYERS):
            assert torch.equal(pool.k_buffer[layer][10 + pos], seam.link.slots.data[5, layer, 0])
    assert lag.fixups == {} and req.to_finish is None
