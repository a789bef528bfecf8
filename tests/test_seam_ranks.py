# ruff: noqa: F811 - the fixtures hook_mod and runner come from test_hook
"""The seam under TP (mg_server/seam/ranks.py) with two ranks in threads and fakes of SGLang's
state: rank 0 decides (its controller link a fake), rank 1 applies rank 0's plan to its own Req,
K/V slots and logits, and takes rank 0's finish outcome. The plan crosses a pickle, as it does
over SGLang's gloo group."""

import pickle
import threading
from types import SimpleNamespace

import pytest
import torch

from mg_server.config import HookConfig
from mg_server.policy import Policy
from mg_server.seam import rollback
from mg_server.wire import protocol as P
from test_hook import VOCAB, FakeReq, ScriptedClient, hook_mod, marked_server, sampler_args  # noqa: F401 - fixtures


class FakeRanks:
    """One rank of a two-rank group whose collectives meet at a barrier (ranks.SeamRanks' calls)."""

    def __init__(self, shared, rank):
        self.shared, self.rank, self.size = shared, rank, 2

    @property
    def leader(self):
        return self.rank == 0

    def share(self, obj):
        s = self.shared
        if self.rank == 0:
            s.box = pickle.dumps(obj)
        s.barrier.wait()
        out = pickle.loads(s.box)
        s.barrier.wait()
        return out

    def union(self, items):
        s = self.shared
        s.parts[self.rank] = list(items)
        s.barrier.wait()
        out = s.parts[0] + s.parts[1]
        s.barrier.wait()
        return out


def pair():
    shared = SimpleNamespace(barrier=threading.Barrier(2, timeout=10), box=None, parts=[None, None])
    return FakeRanks(shared, 0), FakeRanks(shared, 1)


def runner_of():
    """A runner with a recording slot allocator; request row 0 holds positions p at slot 10 + p."""
    req_to_token = torch.zeros(2, 32, dtype=torch.int64)
    req_to_token[0, :20] = torch.arange(10, 30)
    freed = []
    return SimpleNamespace(req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                           token_to_kv_pool_allocator=SimpleNamespace(free=lambda s: freed.extend(s.tolist())),
                           freed=freed)


def req_of(rid, prompt):
    req = FakeReq(rid, prompt)
    n = len(prompt)
    req.kv = SimpleNamespace(req_pool_idx=0, cache_protected_len=0, kv_allocated_len=n, kv_committed_len=n)
    req.send_token_offset = 0
    return req


@pytest.fixture()
def seams(hook_mod, tmp_path, monkeypatch):
    """(rank 0's seam, rank 1's seam), rank 0 with a fake controller link, each with its runner."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setattr(rollback, "ranks", None)  # (the seams set it; restored after the test)
    monkeypatch.setattr(rollback, "install", lambda: None)  # (SGLang's classes stay unwrapped here)
    link = SimpleNamespace(client=ScriptedClient(), tracked={}, lock=threading.Lock(), published_tracked=-1,
                           rpc_lock=threading.Lock(), policy=Policy("always", 0.0),
                           info=SimpleNamespace(verifier_pool_tokens=1024))
    monkeypatch.setattr(hook_mod, "ControllerLink", lambda cfg: link)
    cfg = HookConfig(metrics_dir=str(tmp_path), controller_ipc=str(tmp_path / "controller.sock"), tp=2)
    r0, r1 = pair()
    lead, follow = hook_mod.StepSeam(cfg, runner_of(), r0), hook_mod.StepSeam(cfg, runner_of(), r1)
    assert lead.link is link and follow.follower and follow.link is None
    return lead, follow


def forward(seams, reqs, logits, positions):
    """Both ranks' pre-hook on the same batch (each its own Req copies and logits), in threads."""
    errors = []

    def call(seam, rs, lg):
        try:
            seam(None, sampler_args([(r, True) for r in rs], lg, positions))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(s, rs, lg)) for s, rs, lg in zip(seams, reqs, logits)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    assert not errors and not any(t.is_alive() for t in threads), errors


def forced(logits):
    """The token each row of edited logits is forced to (one finite entry)."""
    assert all(int(torch.isfinite(r).sum()) == 1 for r in logits)
    return [int(r.argmax()) for r in logits]


def test_the_follower_takes_rank_0s_tokens_rollbacks_and_failures(seams):
    lead, follow = seams
    a0, a1 = req_of("a", [1, 2, 3]), req_of("a", [1, 2, 3])
    # first step: rank 0 commits its fast token; the follower forces that one, whatever its own logits say
    l0, l1 = torch.randn(1, VOCAB), torch.randn(1, VOCAB)
    l1[0, int(l0[0].argmax())] = -100.0
    fast = int(l0[0].argmax())
    forward(seams, [[a0], [a1]], [l0, l1], [2])
    assert forced(l0) == forced(l1) == [fast]
    assert rollback.held(a1) is not None and isinstance(a1.output_ids, rollback.HeldOutputs)
    for r in (a0, a1):  # SGLang appends the sampled token and grows the request's K/V
        r.output_ids.append(fast)
        r.kv.kv_allocated_len = r.kv.kv_committed_len = 4
    # the controller's rollback to answer index 0 (token 9): both ranks cut the request and free its slots
    lead.link.tracked["a"].rollback = P.Rollback(rid="a", index=0, token=9, epoch=1)
    l0, l1 = torch.randn(1, VOCAB), torch.randn(1, VOCAB)
    forward(seams, [[a0], [a1]], [l0, l1], [3])
    assert forced(l0) == forced(l1) == [9]
    for r, seam in ((a0, lead), (a1, follow)):
        assert list(r.output_ids) == [] and r.kv.kv_allocated_len == 3 and seam.runner.freed == [13]
        assert rollback.held(r).verified == 1  # the rollback's token counts as checked on both ranks
    # a missed step (position 6, rank 0 holds 4 tokens): the request fails on both ranks, same reason
    for r in (a0, a1):
        r.output_ids.append(9)
    forward(seams, [[a0], [a1]], [torch.randn(1, VOCAB), torch.randn(1, VOCAB)], [6])
    assert a0.to_finish is not None and a1.to_finish is not None
    assert a0.to_finish.message == a1.to_finish.message and "failed" in a1.to_finish.message


def test_a_rollback_a_follower_cannot_apply_fails_the_request_on_every_rank(seams):
    lead, follow = seams
    b0, b1 = req_of("b", [4, 5]), req_of("b", [4, 5])
    forward(seams, [[b0], [b1]], [torch.randn(1, VOCAB), torch.randn(1, VOCAB)], [1])
    for r in (b0, b1):
        r.output_ids.append(0)
        r.kv.kv_allocated_len = r.kv.kv_committed_len = 3
    b1.send_token_offset = 1  # this rank streamed the token already: it cannot roll it back
    lead.link.tracked["b"].rollback = P.Rollback(rid="b", index=0, token=7, epoch=1)
    forward(seams, [[b0], [b1]], [torch.randn(1, VOCAB), torch.randn(1, VOCAB)], [2])
    assert b0.to_finish is not None and b1.to_finish is not None and lead.link.tracked["b"].failed


def both_finish(reqs, holds, ranks):
    """Both ranks through mg's agreed finish rules (rollback._agree_finish), in threads."""
    threads = [threading.Thread(target=rollback._agree_finish, args=(r, h, False, rk))
               for r, h, rk in zip(reqs, holds, ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(15)
    return threads


class EndingReq(FakeReq):
    def finished(self):
        return self.finished_reason is not None


def test_the_follower_takes_rank_0s_finish_outcome():
    """SGLang ends a held request whose tail is unchecked: rank 0's barrier finds a disagreement and
    undoes the end; the follower (whose hold cannot check anything) does the same."""
    ranks = pair()
    reqs = [EndingReq("c", [1, 2]), EndingReq("c", [1, 2])]
    tails = []

    def check_tail(req, upto):
        tails.append(upto)
        return (0, 5)  # a disagreement at answer index 0: the end is undone, the rollback queued

    holds = [rollback.hold(reqs[0], check_tail, threading.Lock()), rollback.hold(reqs[1], None, threading.Lock())]
    for r in reqs:
        r.output_ids.extend([3, 4])
        r.finished_reason, r.finished_len = "length", None  # SGLang's rules ended it by length
    threads = both_finish(reqs, holds, ranks)
    assert tails == [2] and not any(t.is_alive() for t in threads)
    assert reqs[0].finished_reason is None and reqs[1].finished_reason is None
    # and a checked end: rank 0 finishes it, and so does the follower
    holds[0].verified = 2
    for r in reqs:
        r.finished_reason = "length"
    threads = both_finish(reqs, holds, ranks)
    assert tails == [2] and reqs[1].finished_reason == "length" and holds[1].verified == 2


def test_one_rank_takes_no_collective(hook_mod, tmp_path, monkeypatch):
    from mg_server.seam.ranks import SeamRanks

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    seam = hook_mod.StepSeam(HookConfig(metrics_dir=str(tmp_path)), runner_of())
    assert isinstance(seam.ranks, SeamRanks) and seam.ranks.size == 1 and not seam.follower
