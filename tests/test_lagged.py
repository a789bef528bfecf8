# ruff: noqa: F811 - the fixtures hook_mod and runner come from test_hook
"""The lagged control path's host logic (mg_server/seam/lagged.py) on CPU tensors: what the
device is told (every row a window row: the gate never holds), what the host does one forward
later (reports, the tokens committed, failures), and which forwards take the synchronous path
instead. The device publisher is seam.publish's CPU reference here (its CUDA kernel is checked
against that reference in tests/test_publish_gpu.py)."""

from types import SimpleNamespace

import torch

from mg_server.policy import Policy
from mg_server.seam import link as link_mod
from mg_server.wire import protocol as P
from test_hook import VOCAB, FakeReq, entry, hook_mod, make_seam, marked_server, runner, sampler_args  # noqa: F401 - fixtures


def lagged_seam(hook_mod, runner, tmp_path, monkeypatch, policy):
    """A seam on the lagged path with the CPU reference publisher, its launches recorded in
    seam.gates = SimpleNamespace(gates=[(need_any, target)])."""
    from mg_server.seam.lagged import LaggedControl

    seam = make_seam(hook_mod, runner, tmp_path, monkeypatch, policy=policy)
    seam.lagged = LaggedControl(seam, torch.device("cpu"))
    log = seam.gates = SimpleNamespace(gates=[])
    gate = seam.lagged.gate
    launch = gate.launch

    def rec_launch(margin, fast, pos, need, target):
        log.gates.append((int((need != 0).any()), target))
        launch(margin, fast, pos, need, target)

    monkeypatch.setattr(gate, "launch", rec_launch)
    return seam


def logits_with(top: int, margin: float) -> torch.Tensor:
    row = torch.zeros(1, VOCAB)
    row[0, top], row[0, (top + 1) % VOCAB] = 5.0, 5.0 - margin
    return row


def test_steps_are_reported_one_forward_late_and_never_gate_whatever_their_margin(hook_mod, runner, tmp_path,
                                                                                 monkeypatch):
    seam = lagged_seam(hook_mod, runner, tmp_path, monkeypatch, Policy("margin", 0.5))
    gates = seam.gates
    req = FakeReq("f", [1, 2, 3])
    client = seam.link.client
    logits = logits_with(7, 2.0)
    seam(None, sampler_args([(req, True)], logits, [2]))
    assert gates.gates == [(0, 1)] and client.rows == [] and len(seam.lagged.pending) == 1
    assert int(logits[0].argmax()) == 7 and torch.isinf(logits[0]).sum() == VOCAB - 1  # forced to fast
    low = logits_with(11, 0.1)  # below tau: committed fast all the same (checked behind)
    seam(None, sampler_args([(req, True)], low, [3]))  # the next forward drains the first
    assert [(r.pos, r.prompt, r.fast_token) for r in client.rows] == [(2, [1, 2, 3], 7)]
    assert int(low[0].argmax()) == 11 and gates.gates[-1] == (0, 2) and seam.lagged.gate.published(2, 1)
    seam.lagged.drain(wait=True)
    assert [r.pos for r in client.rows] == [2, 3] and seam.link.tracked["f"].tokens == [1, 2, 3, 7, 11]
    assert req.to_finish is None and seam.link.tracked["f"].hold is not None


def test_always_never_gates_either(hook_mod, runner, tmp_path, monkeypatch):
    """Mode always: every step counts as low-margin, and is committed fast and checked behind."""
    seam = lagged_seam(hook_mod, runner, tmp_path, monkeypatch, Policy("always", 0.0))
    req = FakeReq("a", [1, 2, 3, 4])
    seam(None, sampler_args([(req, True)], logits_with(3, 9.0), [1]))  # a non-final prefill chunk
    seam.lagged.drain(wait=True)
    assert seam.link.client.rows == [] and "a" not in seam.link.tracked
    seam(None, sampler_args([(req, True)], logits_with(3, 0.0), [3]))
    seam.lagged.drain(wait=True)
    assert seam.gates.gates == [(0, 1), (0, 2)] and [r.pos for r in seam.link.client.rows] == [3]
    assert seam.lagged.pending == type(seam.lagged.pending)()


def test_a_forward_with_a_due_rollback_takes_the_synchronous_path(hook_mod, runner, tmp_path, monkeypatch):
    """A rollback is applied in place by the synchronous seam (window.py): the forward that next
    carries the request does not launch a gate; the others go on on the lagged path."""
    seam = lagged_seam(hook_mod, runner, tmp_path, monkeypatch, Policy("margin", 0.5))
    req = FakeReq("r", [1, 2])
    seam(None, sampler_args([(req, True)], logits_with(6, 4.0), [1]))
    seam.lagged.drain(wait=True)
    rolled = []
    monkeypatch.setattr(seam, "_roll_back", lambda live, fails: rolled.append([k for *_, k in live]) or [])
    seam.link.tracked["r"].rollback = P.Rollback(rid="r", index=0, token=9, epoch=1)
    seam(None, sampler_args([(req, True)], logits_with(7, 4.0), [2]))
    assert len(seam.gates.gates) == 1 and not seam.lagged.pending and rolled == [["r"]]
    seam.link.tracked["r"].rollback = None
    seam(None, sampler_args([(req, True)], logits_with(8, 4.0), [3]))
    assert len(seam.gates.gates) == 2 and len(seam.lagged.pending) == 1


def test_a_missed_step_and_an_unreachable_controller_fail_the_request(hook_mod, runner, tmp_path, monkeypatch):
    seam = lagged_seam(hook_mod, runner, tmp_path, monkeypatch, Policy("margin", 0.5))
    skip = FakeReq("s", [1, 2])
    seam(None, sampler_args([(skip, True)], logits_with(3, 9.0), [5]))  # position 5, mg holds 2 tokens
    seam.lagged.drain(wait=True)
    assert skip.to_finish is not None
    seam.link.client.down = TimeoutError("no reply")
    down = FakeReq("l", [1, 2])
    seam(None, sampler_args([(down, True)], logits_with(8, 0.0), [1]))
    seam.lagged.drain(wait=True)
    assert down.to_finish is not None and "failed" in down.to_finish.message
    # later forwards of a failed request are not steps: nothing more is reported for it
    seam.link.client.down = None
    seam(None, sampler_args([(down, True)], logits_with(8, 0.0), [2]))
    seam.lagged.drain(wait=True)
    assert seam.link.client.rows == [] and seam.link.tracked["l"].failed


def test_the_finish_watcher_drains_before_it_reports_an_end(hook_mod, runner, tmp_path, monkeypatch):
    seam = lagged_seam(hook_mod, runner, tmp_path, monkeypatch, Policy("margin", 0.5))
    req = FakeReq("w", [1, 2])
    seam(None, sampler_args([(req, True)], logits_with(6, 4.0), [1]))
    order = []
    seam.link.client.report = lambda rows: order.append(("report", rows[0].pos))
    link = SimpleNamespace(tracked={"w": SimpleNamespace(req=req, epoch=0, ended=False)}, lock=seam.link.lock,
                           published_tracked=-1,
                           before_finish=seam.lagged.drain, finish_of=hook_mod.ControllerLink.finish_of,
                           _finish=lambda msg: order.append(("finish", msg.rid)))
    req.finished = lambda: True
    req.finished_reason, req.output_ids = None, [6]
    monkeypatch.setattr(link_mod, "end_rules", lambda req: {})
    hook_mod.ControllerLink._report_finished(link)
    assert order == [("report", 1), ("finish", "w")]


def test_a_finished_requests_last_forward_is_processed_while_mg_still_tracks_it(hook_mod, runner, tmp_path,
                                                                                monkeypatch):
    """The watcher sees a request finished while its last forward is still pending: that forward
    is processed as the request's step (not as a new request's), then the Finish goes out."""
    seam = lagged_seam(hook_mod, runner, tmp_path, monkeypatch, Policy("margin", 0.5))
    req = FakeReq("z", [1, 2])
    seam(None, sampler_args([(req, True)], logits_with(6, 4.0), [1]))
    seam(None, sampler_args([(req, True)], logits_with(9, 4.0), [2]))  # processes the first
    assert len(seam.lagged.pending) == 1
    finished = []
    seam.link.before_finish = seam.lagged.drain
    seam.link._finish, seam.link.finish_of = lambda msg: finished.append(msg.rid), hook_mod.ControllerLink.finish_of
    req.finished = lambda: True
    req.finished_reason, req.output_ids = None, [6, 9]
    monkeypatch.setattr(link_mod, "end_rules", lambda req: {})
    hook_mod.ControllerLink._report_finished(seam.link)
    assert req.to_finish is None and finished == ["z"] and "z" not in seam.link.tracked
    assert [r.pos for r in seam.link.client.rows] == [1, 2]  # both steps of z, none refused


def test_mg_processor_alone_takes_the_lagged_path_and_a_foreign_one_keeps_the_synchronous_path(
        hook_mod, runner, tmp_path, monkeypatch):
    seam = lagged_seam(hook_mod, runner, tmp_path, monkeypatch, Policy("margin", 0.5))
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
    assert [r.rid for r in seam.link.client.rows] == ["p", "q"] and len(gates.gates) == 1


def test_the_schedulers_drain_waits_for_a_forward_the_watcher_is_processing(hook_mod, runner, tmp_path, monkeypatch):
    """The next launch reads mg's token counts: a forward the finish watcher has taken up must be
    finished before the scheduler's drain returns."""
    import threading

    seam = lagged_seam(hook_mod, runner, tmp_path, monkeypatch, Policy("margin", 0.5))
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


def test_a_forward_is_pending_before_its_gate_is_enqueued(hook_mod, runner, tmp_path, monkeypatch):
    """Only a forward in `pending` is processed (by the watcher too), so it must be there before
    its gate is enqueued; a failed launch leaves nothing behind."""
    seam = lagged_seam(hook_mod, runner, tmp_path, monkeypatch, Policy("margin", 0.5))
    gate = seam.lagged.gate
    launch, seen = gate.launch, []

    def check(margin, fast, pos, need, target):
        seen.append([f.target for f in seam.lagged.pending])
        launch(margin, fast, pos, need, target)

    monkeypatch.setattr(gate, "launch", check)
    seam(None, sampler_args([(FakeReq("p", [4, 5]), True)], logits_with(20, 0.1), [1]))
    assert seen == [[1]]
    monkeypatch.setattr(gate, "launch", lambda *a: (_ for _ in ()).throw(RuntimeError("launch failed")))
    try:
        seam.lagged.launch(logits_with(20, 0.1), torch.tensor([2]), [(0, FakeReq("q", [4, 5]), "q")], [(0.0, 0)])
    except RuntimeError:
        pass
    assert [f.target for f in seam.lagged.pending] == [1]  # the failed launch left nothing to wait for


def test_a_host_failure_fails_the_forwards_rows(hook_mod, runner, tmp_path, monkeypatch):
    """An exception while the host processes a forward fails every row of it, loudly."""
    seam = lagged_seam(hook_mod, runner, tmp_path, monkeypatch, Policy("margin", 0.5))
    a, b = FakeReq("x", [4, 5]), FakeReq("y", [4, 5], pool_idx=1)
    seam(None, sampler_args([(a, True), (b, True)], torch.cat([logits_with(20, 0.1), logits_with(30, 4.0)]),
                            [1, 1]))
    monkeypatch.setattr(seam, "report", lambda *a: (_ for _ in ()).throw(RuntimeError("controller link broke")))
    seam.lagged.drain(wait=True)
    assert not seam.lagged.pending and seam.lagged.fast[:2].tolist() == [20, 30]  # the fast tokens
    assert a.to_finish is not None and b.to_finish is not None  # both aborted, loudly
    assert not {"x", "y"} & set(seam.link.tracked)  # never committed: nothing to mark


def test_seeded_rows_take_the_lagged_path_and_sample_as_the_synchronous_seam_does(hook_mod, runner, tmp_path,
                                                                                   monkeypatch):
    """A seeded row beside a greedy one goes lagged: its fast token and margin (logit units) are
    sampling.sampled_choice's at its position, and its logits are forced to that token; the
    greedy row keeps its argmax."""
    from mg_server.config import DETERMINISTIC_PARAM, SEED_PARAM, TEMPERATURE_PARAM
    from mg_server.verifier.sampling import sampled_choice

    seam = lagged_seam(hook_mod, runner, tmp_path, monkeypatch, Policy("margin", 0.5))
    seeded = FakeReq("s", [1, 2, 3], custom_params={DETERMINISTIC_PARAM: True, TEMPERATURE_PARAM: 0.8, SEED_PARAM: 11})
    greedy = FakeReq("g", [1, 2, 3], pool_idx=1)
    want, picked = [], set()
    for pos in (2, 3, 4, 5):
        logits = torch.cat([torch.zeros(1, VOCAB), logits_with(9, 2.0)])  # row 0 all tied: greedy picks id 0
        want.append(sampled_choice(logits[0].clone(), 0.8, 11, pos))
        seam(None, sampler_args([(seeded, True), (greedy, True)], logits, [pos, pos]))
        assert len(seam.lagged.pending) == 1 and seam.gates.gates[-1][0] == 0  # lagged, no gate
        assert int(logits[0].argmax()) == want[-1][0] and int(logits[1].argmax()) == 9  # forced
        seam.lagged.drain(wait=True)
        picked.add(want[-1][0])
    rows = [r for r in seam.link.client.rows if r.rid == "s"]
    assert [(r.fast_token, r.margin) for r in rows] == want
    assert seam.link.tracked["s"].tokens == [1, 2, 3] + [t for t, _ in want]
    assert len(picked) > 1  # the noise, not the (tied) logits, chose
