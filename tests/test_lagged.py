# ruff: noqa: F811 - the fixtures hook_mod and runner come from test_hook
"""The lagged control path's host logic (mg_server/sglang_ext/lagged.py) on CPU tensors: what the
device is told (which rows need the verifier, the gate), what the host does one forward later
(reports, verify steps, repairs, the tokens written before the gate opens, failures). The device
gate itself is tested on a GPU (tests/test_gate_gpu.py); here it is recorded."""

from types import SimpleNamespace

import pytest
import torch

from mg_server.runtime import protocol as P
from mg_server.runtime.policy import Policy
from test_hook import LAYERS, VOCAB, FakeReq, fast, hook_mod, make_seam, runner, sampler_args  # noqa: F401 - fixtures


@pytest.fixture()
def gates(monkeypatch):
    from mg_server.kernels import gate as device_gate

    log = SimpleNamespace(gates=[], releases=[])
    monkeypatch.setattr(device_gate, "gate", lambda flag, need_any, target, timeout_ns, status:
                        log.gates.append((int(need_any), target)))
    monkeypatch.setattr(device_gate, "release", lambda flag, target: log.releases.append(target))
    return log


def lagged_seam(hook_mod, runner, decide, tmp_path, monkeypatch, policy):
    from mg_server.sglang_ext.lagged import LaggedControl

    seam = make_seam(hook_mod, runner, decide, tmp_path, monkeypatch, policy=policy)
    seam.lagged = LaggedControl(seam, torch.device("cpu"))
    return seam


def logits_with(top: int, margin: float) -> torch.Tensor:
    row = torch.zeros(1, VOCAB)
    row[0, top], row[0, (top + 1) % VOCAB] = 5.0, 5.0 - margin
    return row


def test_fast_steps_are_reported_one_forward_late_and_never_gate(hook_mod, runner, tmp_path, monkeypatch, gates):
    seam = lagged_seam(hook_mod, runner, fast, tmp_path, monkeypatch, Policy("margin", 0.5))
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
                                                                              monkeypatch, gates):
    def verify(row):
        return P.StepDecision(rid=row.rid, token=(row.fast_token + 1) % VOCAB, verified=True, repair=True,
                              slot=5, gen=9)

    seam = lagged_seam(hook_mod, runner, verify, tmp_path, monkeypatch, Policy("margin", 0.5))
    req = FakeReq("v", [4, 5])
    seam(None, sampler_args([(req, True)], logits_with(20, 0.1), [1]))
    assert gates.gates == [(1, 1)] and gates.releases == []  # the device holds; nothing released yet
    f = seam.lagged.pending[0]
    seam.lagged.drain(wait=True)
    assert [r.pos for r in seam.link.client.rows] == [1] and gates.releases == [1]
    assert f.override.tolist() == [21]  # the verifier's token, written before the gate opened
    assert seam.link.tracked["v"].tokens == [4, 5, 21]
    pool = runner.token_to_kv_pool
    for layer in range(LAYERS):  # position 1 of pool row 0 is slot 11
        assert torch.equal(pool.k_buffer[layer][11], seam.link.slots.col[layer, 0])


def test_always_gates_every_step_but_not_prefill_chunks(hook_mod, runner, tmp_path, monkeypatch, gates):
    seam = lagged_seam(hook_mod, runner, fast, tmp_path, monkeypatch, Policy("always", 0.0))
    req = FakeReq("a", [1, 2, 3, 4])
    seam(None, sampler_args([(req, True)], logits_with(3, 9.0), [1]))  # a non-final prefill chunk
    seam.lagged.drain(wait=True)
    assert gates.gates == [(0, 1)] and seam.link.client.rows == [] and seam.link.client.reported == []
    seam(None, sampler_args([(req, True)], logits_with(3, 9.0), [3]))
    seam.lagged.drain(wait=True)
    assert gates.gates[-1] == (1, 2) and gates.releases == [2] and [r.pos for r in seam.link.client.rows] == [3]
    assert seam.lagged.pending == type(seam.lagged.pending)()


def test_a_missed_step_and_a_failed_controller_fail_the_request_and_open_the_gate(hook_mod, runner, tmp_path,
                                                                                   monkeypatch, gates):
    def broken(row):
        return P.StepDecision(rid=row.rid, error="verifier: [internal] boom")

    seam = lagged_seam(hook_mod, runner, broken, tmp_path, monkeypatch, Policy("margin", 0.5))
    skip = FakeReq("s", [1, 2])
    seam(None, sampler_args([(skip, True)], logits_with(3, 9.0), [5]))  # position 5, mg holds 2 tokens
    seam.lagged.drain(wait=True)
    assert skip.to_finish is not None and gates.gates == [(0, 1)]
    low = FakeReq("l", [1, 2])
    seam(None, sampler_args([(low, True)], logits_with(8, 0.0), [1]))
    f = seam.lagged.pending[0]
    seam.lagged.drain(wait=True)
    assert gates.releases == [2] and f.override.tolist() == [8]  # opened, with the fast token
    assert low.to_finish is not None and "failed" in low.to_finish.message
    # later forwards of a failed request are not steps: no gate holds for them
    seam(None, sampler_args([(low, True)], logits_with(8, 0.0), [2]))
    seam.lagged.drain(wait=True)
    assert gates.gates[-1] == (0, 3)


def test_the_finish_watcher_drains_before_it_reports_an_end(hook_mod, runner, tmp_path, monkeypatch, gates):
    seam = lagged_seam(hook_mod, runner, fast, tmp_path, monkeypatch, Policy("margin", 0.5))
    req = FakeReq("w", [1, 2])
    seam(None, sampler_args([(req, True)], logits_with(6, 4.0), [1]))
    order = []
    seam.link.client.report = lambda rows: order.append(("report", rows[0].pos))
    link = SimpleNamespace(tracked={"w": SimpleNamespace(req=req)}, lock=seam.link.lock, before_finish=seam.lagged.drain,
                           _finish=lambda rid, *rest: order.append(("finish", rid)))
    req.finished = lambda: True
    req.finished_reason, req.output_ids = None, [6]
    monkeypatch.setattr(hook_mod, "end_rules", lambda req: {})
    hook_mod.ControllerLink._report_finished(link)
    assert order == [("report", 1), ("finish", "w")]


def test_mg_processor_is_skipped_for_the_forward_and_a_foreign_one_keeps_the_synchronous_path(
        hook_mod, runner, tmp_path, monkeypatch, gates):
    seam = lagged_seam(hook_mod, runner, fast, tmp_path, monkeypatch, Policy("margin", 0.5))
    req = FakeReq("p", [1, 2])
    args = sampler_args([(req, True)], logits_with(4, 3.0), [1])
    seam(None, args)
    assert args[1].has_custom_logit_processor is False and len(seam.lagged.pending) == 1  # lagged
    seam.restore(None, args, None)
    assert args[1].has_custom_logit_processor is True
    seam.lagged.drain(wait=True)
    # a user's processor in the batch: SGLang's processor path waits for the device, so no gate
    other = FakeReq("q", [1, 2])
    args = sampler_args([(other, True)], logits_with(4, 3.0), [1])
    args[1].custom_logit_processor[2] = (object(), None)
    seam(None, args)
    assert args[1].has_custom_logit_processor is True and not seam.lagged.pending
    assert [r.rid for r in seam.link.client.reported] == ["p", "q"] and len(gates.gates) == 1
