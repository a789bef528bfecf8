"""Restarts of mg's workers, without a model: the restart rules (wire.liveness), the controller's
supervision of its verifier (fake workers), the beat a restart writes, and a caller's view of a
peer that was replaced."""

import threading
import time

import pytest
import zmq

from mg_server.controller.client import ControllerClient
from mg_server.controller.server import Controller, ControllerConfig
from mg_server.controller.worker import differs
from mg_server.verifier.server import VerifierConfig
from mg_server.wire import protocol as P
from mg_server.wire.liveness import (GAVE_UP_EXIT, NO_PROCESS, WEDGED_AFTER_S, PeerWatch, Restarts, read_beat,
                                     write_beat)
from test_controller import Alive, FakeVerifier, ref_next, run_request


def test_restarts_back_off_and_give_up_after_failures_in_a_row():
    r = Restarts()
    assert [r.failed(t) for t in (0.0, 1.0, 3.0, 6.0)] == [0.0, 1.0, 2.0, 4.0]
    assert r.failed(11.0) is None  # the fifth in a row: give up
    r = Restarts()
    r.failed(0.0)
    r.up(1.0)
    assert r.failed(30.0) == 1.0  # up for less than RESTART_STABLE_S: still in a row
    r.up(31.0)
    assert r.failed(100.0) == 0.0 and r.in_a_row == 1  # a worker that ran a while: the count starts again


def hello_reply(**kw) -> P.HelloReply:
    return P.HelloReply(protocol_version=P.PROTOCOL_VERSION, **{
        "model_id": "m", "kernel_config_id": "k", "family": "llama", "n_layers": 2, "n_kv_heads": 1, "head_dim": 4,
        "vocab": 50, "dtype": "bfloat16", "device": "cpu", "max_seq_len": 64, "max_requests": 8,
        "pool_tokens": 256, **kw})


class Start:
    """A worker start that ends when told to (`finish`), with a fresh fake worker or an error."""

    def __init__(self, error: str = "", info: P.HelloReply | None = None):
        self.proc, self.client, self.info, self.error = Alive(), FakeVerifier(), info or hello_reply(), None
        self.reserved = None  # (a CPU start: no stage 1)
        self.proc.pid = 4242
        self.ended, self.abandoned = threading.Event(), False
        if error:
            self.error = P.ErrorReply(code=P.ErrorCode.LOAD_FAILED, message=error)

    def done(self):
        return self.ended.is_set()

    def abandon(self):
        self.abandoned = True


class Lifeline:
    status = ""

    def set_status(self, status):
        self.status = status


@pytest.fixture()
def supervised(tmp_path, monkeypatch):
    """A controller whose verifier is up (a fake) and whose next starts are `Start`s queued in
    `ctl.starts` (each taken when due)."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    vcfg = VerifierConfig(model_path="/m", ipc_path=str(tmp_path / "v.sock"))
    ctl = Controller(ControllerConfig(ipc_path=str(tmp_path / "c.sock"), mode="margin", tau=0.5,
                                      metrics_dir=str(tmp_path), verifier=vcfg), Lifeline())
    ctl.vclient, ctl.verifier_proc, ctl.vinfo = FakeVerifier(), Alive(), hello_reply()
    ctl.starts, ctl.begun = [], []
    ctl._begin_start = lambda predecessor=0: ctl.begun.append(ctl.starts.pop(0)) or ctl.begun[-1]
    yield ctl
    ctl.vclient = ctl.verifier_proc = None
    ctl.close()


def test_a_lost_verifier_fails_the_requests_it_held_and_comes_back(supervised):
    ctl = supervised
    restarts = ctl.m.verifier_restarts._value.get()
    run_request(ctl, "done", [3, 3], 3, [9.0] * 3)
    assert ctl._verdict("done").state == "verified"
    run_request(ctl, "ended", [4, 1], 3, [9.0] * 3)  # finished, its tail audit not run yet
    ctl._step([P.StepRow(rid="live", pos=1, prompt=[5, 5], margin=9.0, fast_token=ref_next([5, 5]))])
    ctl.starts.append(Start())
    ctl.verifier_proc.kill()  # kill -9
    assert not ctl.verifier_up()
    assert ctl.lifeline.status == "verifier down: restarting after: the verifier process exited (code -9)"
    assert ctl.m.verifier_up._value.get() == 0
    # its shadow K/V is gone: whatever it held fails; a verdict it had given stands
    for rid in ("ended", "live"):
        assert ctl._verdict(rid).state == "failed" and "verifier is not running" in ctl.reqs[rid].error
    assert ctl._verdict("done").state == "verified"
    ctl._step([P.StepRow(rid="new", pos=1, prompt=[6, 6], margin=9.0, fast_token=ref_next([6, 6]))])
    assert "not running" in ctl.reqs["new"].error  # while it restarts: new requests fail at once
    assert len(ctl.begun) == 1 and ctl.m.verifier_restarts._value.get() == restarts + 1  # due at once (no backoff)
    ctl.begun[0].ended.set()
    assert ctl.verifier_up() and ctl.lifeline.status == "verifier up" and ctl.m.verifier_up._value.get() == 1
    assert ctl.vclient is ctl.begun[0].client and ctl.vclient.seen == {}
    run_request(ctl, "after", [6, 6], 4, [9.0] * 4)
    assert ctl._verdict("after").state == "verified"


def test_a_verifier_that_keeps_failing_to_start_backs_off_then_stops_the_controller(supervised):
    ctl = supervised
    ctl.restarts = Restarts(backoff_s=(0.0, 0.3), limit=3)
    ctl.starts += [Start(error="verifier failed to load: OSError: disk"), Start(error="still broken")]
    ctl.verifier_proc.kill()
    assert not ctl.verifier_up() and len(ctl.begun) == 1
    ctl.begun[0].ended.set()
    t0 = time.monotonic()
    assert not ctl.verifier_up() and ctl.begun[0].abandoned
    assert ctl.lifeline.status == ("verifier down: restarting after: the new verifier did not start: verifier "
                                   "failed to load: OSError: disk")
    while len(ctl.begun) < 2:  # the second start waits for its backoff
        assert time.monotonic() - t0 < 5
        ctl.verifier_up()
        time.sleep(0.01)
    assert time.monotonic() - t0 >= 0.3 and ctl.running
    ctl.begun[1].ended.set()
    ctl.verifier_up()
    assert not ctl.running and ctl.exit_code == GAVE_UP_EXIT  # the third failure in a row: the server stops
    assert ctl.lifeline.status.startswith("verifier down: gave up after 3 failures in a row; the last: the new "
                                          "verifier did not start: still broken")


def test_a_stopped_verifier_is_down_until_it_beats_and_replaced_once_wedged(supervised):
    ctl = supervised
    ctl._verifier_beat = beat = ctl.cfg.verifier.ipc_path + ".beat"
    ctl.verifier_proc.pid = 4242

    def beat_age(s):
        with open(beat, "w") as f:
            f.write(f"{time.monotonic() - s:.3f}@4242 ")
        ctl._beat_checked = 0.0  # (read at most 4 times a second)

    run_request(ctl, "a", [3, 3], 3, [9.0] * 3)
    beat_age(5)  # SIGSTOP'ed for 5 s: down, its state kept
    assert not ctl.verifier_up() and "no heartbeat" in ctl.down_reason and ctl.begun == []
    beat_age(0)  # SIGCONT
    assert ctl.verifier_up() and ctl._verdict("a").state == "verified"
    ctl.starts.append(Start())
    beat_age(WEDGED_AFTER_S + 1)
    assert not ctl.verifier_up()
    assert ctl.verifier_proc is None and len(ctl.begun) == 1 and "killed after" in ctl.lifeline.status


def test_a_restarted_verifier_must_be_the_first_one():
    first = hello_reply()
    assert differs(first, hello_reply(memory_bytes=5)) == ""
    assert "model" in differs(first, hello_reply(model_id="other"))
    assert "K/V pool" in differs(first, hello_reply(pool_tokens=512))


def test_the_launchers_hello_waits_for_the_first_start_and_hears_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    vcfg = VerifierConfig(model_path="/m", ipc_path=str(tmp_path / "v.sock"))
    results = []
    for error in ("", "verifier failed to load '/m': ValueError: unsupported rope_type 'dynamic'"):
        ipc = str(tmp_path / f"c{len(results)}.sock")
        ctl = Controller(ControllerConfig(ipc_path=ipc, mode="margin", tau=0.5, metrics_dir=str(tmp_path),
                                          verifier=vcfg))
        start = Start(error=error)
        ctl._begin_start = lambda predecessor=0, start=start: start
        ctl.start_verifier()
        threading.Timer(0.5, start.ended.set).start()
        serving = threading.Thread(target=ctl.serve_forever)
        serving.start()
        t0 = time.monotonic()
        with ControllerClient(ipc, timeout_s=10) as client:
            try:
                results.append((client.hello().verifier_up, time.monotonic() - t0))
                client.shutdown()
            except Exception as e:  # noqa: BLE001
                results.append((str(e), time.monotonic() - t0))
        serving.join(5)
        assert not serving.is_alive()
        ctl.vclient = ctl.verifier_proc = None
        ctl.close()
    (up, t_up), (err, t_err) = results
    assert up is True and t_up >= 0.5
    assert "the deterministic verifier did not start: verifier failed to load" in err and t_err >= 0.5


def test_a_caller_gives_up_on_a_replaced_or_missing_peer(tmp_path):
    path = str(tmp_path / "c.sock.beat")
    watch = PeerWatch(path)
    assert watch() == ""  # not started yet
    write_beat(path, "verifier up", pid=100)
    assert watch() == "" and watch.pid == 100
    write_beat(path, "verifier up", pid=101)  # another controller serves the socket now
    assert watch() == "process 100 was replaced by process 101"
    watch.reset()
    assert watch() == ""
    write_beat(path, "verifier down: controller restarting after: the controller exited (code -9)", pid=NO_PROCESS)
    assert watch() == "verifier down: controller restarting after: the controller exited (code -9)"
    with open(path, "w") as f:  # a beat that names no process (older files): age and status only
        f.write(f"{time.monotonic():.3f} ok")
    assert read_beat(path).pid is None and watch() == ""


def test_a_call_to_a_restarting_controller_fails_at_once(tmp_path):
    ipc = str(tmp_path / "c.sock")
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("ipc://" + ipc)  # bound, but nobody answers: the controller that served it is gone
    try:
        write_beat(ipc + ".beat", "verifier down: controller restarting after: the controller exited (code -9)",
                   pid=NO_PROCESS)
        t0 = time.monotonic()
        with ControllerClient(ipc, timeout_s=60) as client, pytest.raises(Exception, match="controller restarting"):
            client.verdict("r")
        assert time.monotonic() - t0 < 1  # not the call's 60 s
    finally:
        sock.close(0)
        ctx.term()


def test_one_way_reports_never_block_while_the_controller_restarts(tmp_path):
    # the seam's Steps go one way from SGLang's scheduler thread: past zmq's default queue (1000)
    # a send to a peer that is gone blocked that thread until a new controller came up
    ipc = str(tmp_path / "c.sock")
    ctx = zmq.Context()
    old = ctx.socket(zmq.ROUTER)
    old.bind("ipc://" + ipc)
    client = ControllerClient(ipc)
    try:
        client.report([P.StepRow(rid="a", pos=0, margin=1.0, fast_token=1)])
        assert old.poll(5000)
        old.close(0)  # the controller is gone
        sent = threading.Thread(target=lambda: [client.report([P.StepRow(rid="a", pos=k, margin=1.0, fast_token=1)])
                                                for k in range(3000)], daemon=True)
        sent.start()
        sent.join(10)
        assert not sent.is_alive()
        new = ctx.socket(zmq.ROUTER)  # the restarted one, on the same path: the queue goes to it
        new.bind("ipc://" + ipc)
        while new.poll(2000):
            new.recv_multipart()
        # what was sent before the client saw the old peer go may be lost with it (its steps are
        # of requests the new controller does not know); what is sent now reaches the new one
        client.report([P.StepRow(rid="b", pos=0, margin=1.0, fast_token=1)])
        assert new.poll(5000) and P.decode(new.recv_multipart()[-1]).rows[0].rid == "b"
        new.close(0)
    finally:
        client.close()
        ctx.term()


class Proc:
    """A controller process as the main process's supervisor sees it."""

    def __init__(self, pid=77, exitcode=None):
        self.pid, self.exitcode = pid, exitcode

    def is_alive(self):
        return self.exitcode is None

    def join(self, timeout=None):
        time.sleep(0.01)

    def kill(self):
        self.exitcode = self.exitcode if self.exitcode is not None else -9


def controller_info(**kw) -> P.ControllerInfo:
    return P.ControllerInfo(protocol_version=P.PROTOCOL_VERSION, mode="always", tau=0.0, verifier_up=True, **{
        "kernel_config_id": "k", "model_id": "m", "verifier_max_requests": 64, **kw})


@pytest.fixture()
def runtime(tmp_path, monkeypatch):
    from mg_server.launch.runtime import Runtime

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    rt = Runtime(ControllerConfig(ipc_path=str(tmp_path / "c.sock"), mode="always", tau=0.0,
                                  metrics_dir=str(tmp_path)))
    rt.proc, rt.info, rt.stops = Proc(), controller_info(), []
    monkeypatch.setattr(rt, "_stop_server", rt.stops.append)
    return rt


def test_the_supervisor_replaces_a_wedged_controller_and_stops_the_server_when_one_gave_up(runtime):
    with open(runtime.beat, "w") as f:  # SIGSTOP'ed: its last beat, 11 s ago
        f.write(f"{time.monotonic() - WEDGED_AFTER_S - 1:.3f}@77 verifier up")
    assert runtime._wait_lost() == "the controller did not beat for 11s (killed)" and runtime.proc.exitcode == -9
    runtime.proc = Proc(exitcode=GAVE_UP_EXIT)
    write_beat(runtime.beat, "verifier down: gave up after 5 failures in a row; the last: x", pid=77)
    assert runtime._wait_lost() == ""
    assert runtime.stops == ["the deterministic verifier gave up after 5 failures in a row; the last: x"]


def test_the_supervisor_restarts_a_lost_controller_until_one_is_the_same(runtime, monkeypatch):
    from mg_server import metrics

    counted = metrics.controller_restarts()._value.get()
    seen, infos = [], [RuntimeError("no reply to ControllerHello"), controller_info(kernel_config_id="other"),
                       controller_info()]

    def start_one(status):
        seen.append((status, read_beat(runtime.beat)))
        runtime.proc = Proc(pid=78 + len(seen))
        info = infos.pop(0)
        if isinstance(info, Exception):
            raise info
        return info

    monkeypatch.setattr(runtime, "_start_one", start_one)
    runtime.restarts = Restarts(backoff_s=(0.0,))
    assert runtime._recover("the controller exited (code -9)") is True and runtime.stops == []
    # until it beats, the beat says why no controller serves (pid NO_PROCESS: no caller waits for it)
    assert seen[0][0] == "verifier down: controller restarting after: the controller exited (code -9)"
    assert seen[0][1].pid == NO_PROCESS and seen[0][1].status == seen[0][0]
    assert seen[1][0].endswith("after: the new controller did not start: no reply to ControllerHello")
    assert "another kernel configuration (other != k)" in seen[2][0]  # not the verifier the front holds
    assert metrics.controller_restarts()._value.get() == counted + 3


def test_the_supervisor_stops_the_server_after_failures_in_a_row(runtime, monkeypatch):
    def start_one(status):
        raise RuntimeError("the deterministic verifier did not start: boom")

    monkeypatch.setattr(runtime, "_start_one", start_one)
    runtime.restarts = Restarts(backoff_s=(0.0,), limit=3)
    assert runtime._recover("the controller exited (code -9)") is False
    assert runtime.stops == ["the mg controller failed 3 times in a row; the last: the new controller did not start: "
                             "the deterministic verifier did not start: boom"]


def test_a_restarted_controller_never_verifies_its_predecessors_requests(tmp_path, monkeypatch):
    from mg_server.front.verdict import overall

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    ctl = Controller(ControllerConfig(ipc_path=str(tmp_path / "c.sock"), mode="always", tau=0.0,
                                      metrics_dir=str(tmp_path)))
    ctl.vclient, ctl.verifier_proc = FakeVerifier(), Alive()
    try:
        assert ctl._verdict("asked").state == "unknown" and overall(["unknown"]) == (False, "unknown")
        ctl._step([P.StepRow(rid="stepped", pos=7, margin=9.0, fast_token=1)])  # its prompt went to the old one
        ctl._finish(P.Finish(rid="ended", output=[1, 2]))
        assert ctl._verdict("stepped").state == ctl._verdict("ended").state == "failed"
        assert ctl._check_tail("unseen").error == "unknown request"
    finally:
        ctl.vclient = ctl.verifier_proc = None
        ctl.close()
