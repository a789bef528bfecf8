"""Stops of a real server: the documented SIGTERM, after requests SGLang never
drains (a context-length 400, `n > 1`), ends within the drain bound, and a stop leaves no
process, no /dev/shm segment and no temp folder; so does SGLang's own crash-stop (a crashed
scheduler: SIGQUIT to the main process), which exits 1 saying what died."""

import glob
import os
import shutil
import signal
import tempfile
import threading
import time

import pytest
import requests

from proc_util import group_alive, held_paths, running, titles, wait_until
from server_util import ServerProcess

pytestmark = pytest.mark.server

DRAIN_S = 4


def leftovers(srv: ServerProcess) -> list[str]:
    pid = srv.proc.pid
    return glob.glob(os.path.join(tempfile.gettempdir(), f"mg-*-{srv.port}-{pid}-*"))


def start(tmp_path, name: str) -> tuple[ServerProcess, list[int]]:
    srv = ServerProcess(["--mg-drain-timeout", str(DRAIN_S), "--context-length", "256"], tmp_path / f"{name}.log")
    try:
        srv.wait_ready()
        r = requests.post(srv.url + "/generate", headers={"X-Deterministic": "1"}, timeout=120,
                          json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 200 and r.headers["x-mg-verdict"] == "verified"
        assert len(leftovers(srv)) == 2, leftovers(srv)  # the run and metrics folders
        return srv, list(titles(srv.proc.pid))
    except BaseException:
        srv.stop()  # (a server left running holds ~4.5 GB of the host)
        raise


def stopped(srv: ServerProcess, kids: list[int], sig: int, limit_s: float) -> float:
    t0 = time.monotonic()
    os.kill(srv.proc.pid, sig)
    try:
        srv.proc.wait(limit_s)
    finally:
        took = time.monotonic() - t0
        srv.stop()
    assert wait_until(lambda: not running(kids), 5), titles  # no child of it left either
    assert leftovers(srv) == []
    return took


def test_sigterm_after_undrained_requests_exits_within_the_bound(tmp_path, prepared_model):
    srv, kids = start(tmp_path, "sigterm")
    try:
        r = requests.post(srv.url + "/generate", timeout=60,
                          json={"text": "word " * 400, "sampling_params": {"max_new_tokens": 4}})
        assert r.status_code == 400  # longer than the context
        r = requests.post(srv.url + "/v1/completions", timeout=120,
                          json={"model": "default", "prompt": "Hi", "n": 2, "max_tokens": 4, "temperature": 0.5})
        assert r.status_code == 200 and len(r.json()["choices"]) == 2
    except BaseException:
        srv.stop()
        raise
    # SGLang's drain polls every 5 s and waits for those ids forever; mg stops it after DRAIN_S
    took = stopped(srv, kids, signal.SIGTERM, limit_s=DRAIN_S + 20)
    assert took < DRAIN_S + 20


def test_a_crashed_scheduler_stops_the_server_with_exit_code_1_and_leaves_nothing(tmp_path, prepared_model):
    # SGLang's watchdog sees its scheduler die and SIGQUITs the main process (as a scheduler that
    # raised does), whose handler ends with kill_process_tree. Before: "mg-server stopped cleanly", exit 0
    srv, kids = start(tmp_path, "crash")
    (scheduler,) = [pid for pid, title in titles(srv.proc.pid).items() if title.startswith("sglang::scheduler")]
    os.kill(scheduler, signal.SIGKILL)
    try:
        code = srv.proc.wait(30)
    finally:
        srv.stop()
    log = srv.log_path.read_text(errors="replace")
    assert code == 1 and "stopped cleanly" not in log, srv.log_tail()
    assert ("mg-server stopped after a failure: SGLang stopped the server after SIGQUIT: its scheduler_0 process "
            "exited (code -9)") in log.rstrip().splitlines()[-1], srv.log_tail()
    assert wait_until(lambda: not running(kids), 5), kids
    assert leftovers(srv) == []


def test_sigint_stops_like_sigterm_with_one_clean_line(tmp_path, prepared_model):
    # `kill -INT` of the server (uvicorn takes SIGINT while it serves): mg's drain, then SGLang's;
    # exit code 0 and mg's last line, no crash wording, nothing left
    srv, kids = start(tmp_path, "sigint")
    try:
        os.kill(srv.proc.pid, signal.SIGINT)
        code = srv.proc.wait(60)
    finally:
        srv.stop()
    log = srv.log_path.read_text(errors="replace")
    assert code == 0 and "mg: SIGTERM: draining" in log and "mg-server stopped cleanly" in log, srv.log_tail()
    assert "crashed" not in log and "SIGQUIT received" not in log and "Traceback" not in log, srv.log_tail()
    assert wait_until(lambda: not running(kids), 5)
    assert leftovers(srv) == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
def test_group_signal_stops_like_a_signal_to_the_server(tmp_path, prepared_model, monkeypatch, sig):
    # Ctrl-C in a terminal (SIGINT to the foreground process group) or `kill -TERM -PGID` reaches
    # every process of the server: the main process's stop alone runs (one drain, which delivers
    # the running deterministic answer), exit code 0, no crash wording, no process of the group
    # left, no file of the instance left (its temp folder is its own here: SGLang's socket names
    # carry no pid)
    temp = tempfile.mkdtemp(prefix="mgt-")  # (short: unix socket paths are at most 107 bytes)
    monkeypatch.setenv("TMPDIR", temp)
    srv = ServerProcess(["--mg-drain-timeout", "60"], tmp_path / f"group-{sig.name}.log")
    answer: dict = {}
    try:
        srv.wait_ready()
        ask = {"text": "Count from one to twenty:", "sampling_params": {"max_new_tokens": 24}}
        r = requests.post(srv.url + "/generate", headers={"X-Deterministic": "1"}, timeout=120, json=ask)
        assert r.status_code == 200 and r.headers["x-mg-verdict"] == "verified"
        pid = srv.proc.pid
        held = held_paths([pid, *titles(pid)], under=(temp + "/", "/dev/shm/"))
        assert any(p.startswith(temp) for p in held), held  # (what must be gone afterwards)

        def running_answer() -> None:
            r = requests.post(srv.url + "/generate", headers={"X-Deterministic": "1"}, timeout=120, json=ask)
            answer.update(status=r.status_code, verdict=r.headers.get("x-mg-verdict"))

        asking = threading.Thread(target=running_answer)
        asking.start()
        time.sleep(1.0)  # (its prefill is under way)
        os.killpg(pid, sig)
        code = srv.proc.wait(90)
        asking.join(30)
        group_gone = wait_until(lambda: not group_alive(pid), 10)
    finally:
        srv.stop()
    log = srv.log_path.read_text(errors="replace")
    try:
        assert code == 0 and log.rstrip().splitlines()[-1].endswith("mg-server stopped cleanly"), srv.log_tail()
        assert log.count("mg: SIGTERM: draining") == 1, srv.log_tail()
        assert answer == {"status": 200, "verdict": "verified"}, (answer, srv.log_tail())
        for word in ("crashed", "SIGQUIT received", "Traceback", "KeyboardInterrupt", "nanobind"):
            assert word not in log, (word, srv.log_tail())
        assert group_gone
        assert [p for p in held if os.path.exists(p)] == []
        assert os.listdir(temp) == [] and glob.glob(f"/dev/shm/*_{pid}_*") == []
    finally:
        shutil.rmtree(temp, ignore_errors=True)
