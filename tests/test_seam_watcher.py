"""The step seam's finish watcher: it survives errors, and /health says when
it cannot work (its beat file goes stale or reports an error). No server, no SGLang import."""

import threading
import time
from types import SimpleNamespace

import pytest

from mg_server.config import FrontConfig
from mg_server.front.verdict import RuntimeView
from mg_server.wire.liveness import seam_beat_path, write_beat


@pytest.fixture(scope="module")
def hook_mod():
    from mg_server.launch import compat

    compat.install("cpu")
    from mg_server.seam import hook

    return hook


class Req:
    def __init__(self, rid, fail=0):
        self.rid, self.output_ids, self.finished_reason, self.fail = rid, [7, 8], None, fail
        self.sampling_params = SimpleNamespace(ignore_eos=True, stop_token_ids=None, stop_strs=[], max_new_tokens=8)
        self.eos_token_ids, self.grammar = None, None

    def finished(self):
        if self.fail:
            self.fail -= 1
            raise RuntimeError("injected fault")
        return True


class Client:
    def __init__(self, fail_first=0):
        self.finished, self.fail_first = [], fail_first

    def finish(self, msg):
        if self.fail_first:
            self.fail_first -= 1
            raise ConnectionError("injected controller fault")
        self.finished.append((msg.rid, msg.output, msg.aborted))


def start_link(hook_mod, tmp_path, client):
    """A ControllerLink without a controller: its watcher thread over a fake client."""
    link = object.__new__(hook_mod.ControllerLink)
    link.client, link.tracked = client, {}
    link.lock, link.rpc_lock = threading.Lock(), threading.Lock()
    link.beat_path, link._last_beat, link.watch_error = seam_beat_path(str(tmp_path / "controller.sock")), 0.0, ""
    threading.Thread(target=link._watch_finished, daemon=True).start()
    return link


def wait_for(cond, timeout=5.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_watcher_survives_a_broken_request_and_a_failing_controller(hook_mod, tmp_path):
    client = Client(fail_first=1)
    link = start_link(hook_mod, tmp_path, client)
    with link.lock:  # a request whose state raises when read, and one the controller first refuses
        link.tracked["broken"] = hook_mod.Tracked(Req("broken", fail=100), [1])
        link.tracked["lost"] = hook_mod.Tracked(Req("lost"), [1])
    assert wait_for(lambda: not link.tracked)
    with link.lock:  # the watcher still runs: a request finishing later is reported
        link.tracked["later"] = hook_mod.Tracked(Req("later"), [1])
    assert wait_for(lambda: ("later", [7, 8], False) in client.finished)
    # the broken request is reported as cut short (never verified), not left running forever
    assert ("broken", [], True) in client.finished


class FINISH_ABORT:  # noqa: N801 - SGLang's class name is what the seam reads
    message = "cut short"


def test_the_finish_reports_the_answer_through_its_stop_not_a_held_ends_surplus(hook_mod, tmp_path):
    client = Client()
    link = start_link(hook_mod, tmp_path, client)
    req = Req("ended")
    req.output_ids, req.finished_len = [7, 8, 9, 10], 2  # ended after 2 tokens; 9, 10 the surplus
    cut = Req("cut")  # aborted, its last output streamed first: SGLang set finished_len to what the hold showed
    cut.output_ids, cut.finished_len, cut.finished_reason = [7, 8, 9], 1, FINISH_ABORT()
    with link.lock:
        link.tracked["ended"] = hook_mod.Tracked(req, [1, 7, 8, 9, 10])
        link.tracked["cut"] = hook_mod.Tracked(cut, [1, 7, 8, 9])
    assert wait_for(lambda: ("ended", [7, 8], False) in client.finished)
    assert wait_for(lambda: ("cut", [7, 8, 9], True) in client.finished)  # whole: mg's tokens reconcile with it


def test_the_watcher_publishes_how_many_requests_it_tracks(hook_mod, tmp_path, monkeypatch):
    # mg_tracked_requests: the requests between their first step and their end's report, 0 once
    # traffic stops (a request that stays tracked after its end would be a leak the gauge shows);
    # set when the count changes (other tests' idle watchers never write it again)
    from mg_server import metrics

    published = []
    monkeypatch.setattr(metrics, "tracked_requests", lambda: SimpleNamespace(set=published.append))
    link = start_link(hook_mod, tmp_path, Client())
    running = Req("running")
    running.finished = lambda: False
    with link.lock:
        link.tracked["running"] = hook_mod.Tracked(running, [1])
        link.tracked["done"] = hook_mod.Tracked(Req("done"), [1])
    assert wait_for(lambda: "done" not in link.tracked and published[-1:] == [1])
    running.finished = lambda: True
    assert wait_for(lambda: published[-1:] == [0])
    time.sleep(0.05)  # no change, no write
    assert published[-2:] == [1, 0] and published.count(1) == 1


def test_a_held_request_mg_lost_track_of_fails_at_its_end(hook_mod):
    seam = object.__new__(hook_mod.StepSeam)
    seam.link = SimpleNamespace(tracked={}, lock=threading.Lock())
    req = SimpleNamespace(rid="gone", to_finish=None, finished_reason=None)
    assert seam.check_tail("gone", req, 3) is None
    assert type(req.finished_reason).__name__ == "FINISH_ABORT" and req.to_finish is None


def test_an_aborted_answer_streamed_after_its_end_is_reported_stops_at_the_checked_prefix(hook_mod, tmp_path):
    import gc

    from mg_server.seam import rollback

    client = Client()
    link = start_link(hook_mod, tmp_path, client)
    req = Req("cut")
    req.output_ids, req.finished_reason = [7, 8, 9, 10], FINISH_ABORT()
    with link.lock:  # 2 of its 4 tokens checked when the client went away
        t = hook_mod.Tracked(req, [1, 7, 8, 9, 10])
        t.hold = rollback.hold(req, lambda r: None, link.lock)
        t.hold.verified = 2
        link.tracked["cut"] = t
    # the watcher reports the end before SGLang streams the request's last output
    assert wait_for(lambda: ("cut", [7, 8, 9, 10], True) in client.finished)
    sent = []
    accept = rollback._accept(lambda self, *, req: sent.append(list(req.output_ids)))
    accept(None, req=req)
    assert sent == [[7, 8]]  # never the unchecked 9, 10
    assert list(req.output_ids) == [7, 8, 9, 10]
    # the hold ends with its Req: an object later at the same id() is not held
    key = id(req)
    del t, req
    gc.collect()
    assert key not in rollback._holds


def test_watcher_beats_and_reports_its_errors(hook_mod, tmp_path, monkeypatch):
    link = start_link(hook_mod, tmp_path, Client())
    view = RuntimeView(FrontConfig(noop_processor="", metrics_dir="", controller_ipc=str(tmp_path / "controller.sock")))
    write_beat(str(tmp_path / "controller.sock.beat"), "verifier up")
    assert wait_for(lambda: (tmp_path / "seam.beat").exists())
    assert view.problem() == ""

    def boom():
        raise RuntimeError("injected fault")

    monkeypatch.setattr(link, "_report_finished", boom)
    assert wait_for(lambda: "finish watcher is failing: RuntimeError: injected fault" in view.problem())
    monkeypatch.undo()
    assert wait_for(lambda: view.problem() == "")


def test_watcher_waiting_behind_the_finish_barrier_keeps_beating(hook_mod, tmp_path):
    from mg_server.wire.liveness import STALE_AFTER_S, read_beat

    link = start_link(hook_mod, tmp_path, Client())
    assert wait_for(lambda: (tmp_path / "seam.beat").exists())
    ages = []
    with link.lock:  # the finish barrier holds the lock through a verify call, longer than a stale beat
        end = time.monotonic() + STALE_AFTER_S + 1
        while time.monotonic() < end:
            ages.append(read_beat(link.beat_path).age_s)
            time.sleep(0.1)
    assert max(ages) < STALE_AFTER_S, max(ages)  # waiting, not dead: /health stays 200


def test_health_says_when_the_watcher_is_gone(tmp_path):
    ipc = str(tmp_path / "controller.sock")
    view = RuntimeView(FrontConfig(noop_processor="", metrics_dir="", controller_ipc=ipc))
    write_beat(ipc + ".beat", "verifier up")
    write_beat(seam_beat_path(ipc), "ok")
    assert view.problem() == ""
    with open(seam_beat_path(ipc), "w") as f:  # its last beat, 10 s ago: the thread is gone
        f.write(f"{time.monotonic() - 10:.3f} ok")
    assert view.problem() == "mg finish watcher is not running (no heartbeat for 10s)"


def test_a_verdict_wait_ends_when_the_watcher_stays_gone(tmp_path, monkeypatch):
    import mg_server.front.verdict as verdict

    ipc = str(tmp_path / "controller.sock")
    view = RuntimeView(FrontConfig(noop_processor="", metrics_dir="", controller_ipc=ipc, verdict_wait_s=60))
    view._local.client = SimpleNamespace(  # never finishes
        verdict=lambda rid, correct=False: SimpleNamespace(state="running", correction=None))
    monkeypatch.setattr(verdict, "PROBLEM_LOOKS", 2)
    write_beat(ipc + ".beat", "verifier up")
    with open(seam_beat_path(ipc), "w") as f:  # the watcher's last beat, long ago
        f.write(f"{time.monotonic() - 100:.3f} ok")
    t0 = time.monotonic()
    assert view._verdicts_blocking(["x#1"], False) == [("audit-timeout", None)]
    assert time.monotonic() - t0 < 10  # not the 60 s wait


def test_a_retracted_held_request_fails_at_its_next_step_on_either_path(hook_mod):
    """The lagged path classifies rows as the synchronous one does: a held request SGLang retracted
    (memory pressure) fails, since its re-prefill would resume from unchecked tokens."""
    from mg_server.seam import rollback

    seam = object.__new__(hook_mod.StepSeam)
    seam.link = SimpleNamespace(tracked={}, lock=threading.Lock())
    req = Req("r")
    t = seam.link.tracked["r"] = hook_mod.Tracked(req, [1, 2, 7, 8])
    t.hold = rollback.hold(req, lambda r, n: None, seam.link.lock)
    live, fails = seam._classify([(0, req, 3, 1.0, 9, "r")])
    assert len(live) == 1 and fails == []
    t.hold.retracted = True
    live, fails = seam._classify([(0, req, 3, 1.0, 9, "r")])
    assert live == [] and [f[1] for f in fails] == ["r"] and "retracted" in fails[0][2]



def test_an_end_the_scheduler_thread_reported_is_untracked_without_a_second_finish(hook_mod, tmp_path):
    client = Client()
    link = start_link(hook_mod, tmp_path, client)
    with link.lock:
        link.tracked["sent"] = hook_mod.Tracked(Req("sent"), [1, 7, 8], ended=True)
        link.tracked["other"] = hook_mod.Tracked(Req("other"), [1, 7, 8])
        # reported already, then its state cannot be read: not a second, cut-short Finish
        link.tracked["sent-broken"] = hook_mod.Tracked(Req("sent-broken", fail=100), [1, 7, 8], ended=True)
    assert wait_for(lambda: not link.tracked)
    assert wait_for(lambda: ("other", [7, 8], False) in client.finished)
    time.sleep(0.05)
    assert [f[0] for f in client.finished] == ["other"]


def test_a_checked_end_is_reported_from_the_finishing_thread_and_its_later_rows_are_not_steps(hook_mod):
    """The hold's on_end (wired by StepSeam.hold) sends one Finish, the answer through its stop, at
    once; the look-ahead forward's row after it is neither a step nor a failure. An end whose last
    step the seam has not reported yet (a forward processed late), or that the controller cannot
    take, is left to the finish watcher."""
    from mg_server.seam import rollback

    client = Client()
    seam = object.__new__(hook_mod.StepSeam)
    seam.link = link = object.__new__(hook_mod.ControllerLink)
    link.client, link.tracked, link.lock, link.rpc_lock = client, {}, threading.Lock(), threading.Lock()
    seam._released_first = set()

    def held(rid, tokens, output, finished_len=None):
        req = Req(rid)
        req.origin_input_ids, req.output_ids, req.finished_len = [1, 2], output, finished_len
        req.sampling_params.custom_params = None
        t = link.tracked[rid] = hook_mod.Tracked(req, tokens)
        seam.hold(req, t)
        return req, t

    req, t = held("r", [1, 2, 7, 8, 9], [7, 8, 9], finished_len=2)  # 9: a held end's surplus
    with link.lock:
        rollback.held(req).on_end(req, 2)
        rollback.held(req).on_end(req, 2)
    assert client.finished == [("r", [7, 8], False)] and t.ended
    live, fails = seam._classify([(0, req, 4, 1.0, 9, "r")])
    assert live == [] and fails == []
    late, t_late = held("late", [1, 2, 7], [7, 8])  # token 8's step not reported yet
    with link.lock:
        rollback.held(late).on_end(late, 2)
    assert not t_late.ended and [f[0] for f in client.finished] == ["r"]
    other, t2 = held("o", [1, 2, 7, 8], [7, 8])
    seam.link.client = Client(fail_first=1)
    with link.lock:
        rollback.held(other).on_end(other, 2)
    assert not t2.ended  # the watcher will report it
