"""Start-up failures of a real `mg-server serve` (they happen before SGLang's engine starts, so
each takes seconds): fail fast with the child's own error, exit non-zero, leave no process."""

import json
import os
import signal
import time

import pytest

from proc_util import find, running, titles, wait_until
from server_util import ServerProcess

pytestmark = pytest.mark.server

# Before: each of these waited out the launcher's 300 s start timeout ("no reply to ControllerHello").
FAIL_WITHIN_S = 90  # python + SGLang imports + two spawned processes importing torch, on a busy 2-core machine
GONE_WITHIN_S = 10


def _exit(srv: ServerProcess, t0: float) -> tuple[int, float, str]:
    rc = srv.proc.wait(FAIL_WITHIN_S)
    return rc, time.monotonic() - t0, srv.log_path.read_text(errors="replace")


def _model_copy(tmp_path, prepared_model, config: dict | None = None, weights: bytes | None = None):
    """The prepared model's files linked into a new folder, its config or weights replaced."""
    bad = tmp_path / "model"
    bad.mkdir()
    for f in prepared_model.iterdir():
        if (f.name != "config.json" or config is None) and (f.name != "model.safetensors" or weights is None):
            (bad / f.name).symlink_to(f)
    if config is not None:
        (bad / "config.json").write_text(json.dumps(config))
    if weights is not None:
        (bad / "model.safetensors").write_bytes(weights)
    return bad


def test_a_config_the_verifier_does_not_compute_is_refused_before_any_process(tmp_path, prepared_model):
    # SGLang serves this config; mg's verifier does not implement dynamic RoPE scaling
    config = json.loads((prepared_model / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "dynamic", "factor": 2.0}
    bad = _model_copy(tmp_path, prepared_model, config=config)
    t0 = time.monotonic()
    srv = ServerProcess(["--model", str(bad), "--mg-mode", "always"], tmp_path / "server.log")
    try:
        rc, took, log = _exit(srv, t0)
        assert rc != 0 and "unsupported rope_type 'dynamic'" in log.strip().splitlines()[-1], log[-2000:]
        assert took < FAIL_WITHIN_S
    finally:
        srv.stop()


def test_weights_the_verifier_cannot_load_fail_the_start_with_its_error(tmp_path, prepared_model):
    bad = _model_copy(tmp_path, prepared_model, weights=(prepared_model / "model.safetensors").read_bytes()[:4096])
    t0 = time.monotonic()
    srv = ServerProcess(["--model", str(bad), "--mg-mode", "always"], tmp_path / "server.log")
    seen: dict[int, str] = {}
    try:
        while srv.proc.poll() is None and time.monotonic() - t0 < FAIL_WITHIN_S:
            for pid, title in titles(srv.proc.pid).items():
                # a child that has exited but is not yet reaped reads back an empty title: keep the
                # one seen while it ran (CI once lost the verifier's title this way)
                if title or pid not in seen:
                    seen[pid] = title
            time.sleep(0.1)
        rc, took, log = _exit(srv, t0)
        assert rc != 0, log[-2000:]
        assert "mg-server: could not start: the deterministic verifier did not start" in log, log[-2000:]
        assert "verifier failed to load" in log.strip().splitlines()[-1], log[-2000:]
        assert took < FAIL_WITHIN_S
        assert any(t.startswith("mg::verifier") for t in seen.values()), seen
        assert wait_until(lambda: not running(seen), GONE_WITHIN_S), {p: seen[p] for p in running(seen)}
    finally:
        srv.stop()  # (kills the whole process group: the checks above come first)


def test_a_controller_killed_during_start_up_fails_the_start(tmp_path, prepared_model):
    t0 = time.monotonic()
    srv = ServerProcess(["--mg-mode", "always"], tmp_path / "server.log")
    try:
        controller = wait_until(lambda: find(srv.proc.pid, "mg::controller"), FAIL_WITHIN_S)
        assert controller, srv.log_tail()
        seen = titles(srv.proc.pid)
        os.kill(controller[0], signal.SIGKILL)
        killed = time.monotonic()
        rc, _, log = _exit(srv, t0)
        took = time.monotonic() - killed
        assert rc != 0 and "mg controller exited during start-up (code -9)" in log, log[-2000:]
        assert took < 20, took
        assert wait_until(lambda: not running(seen), GONE_WITHIN_S), {p: seen[p] for p in running(seen)}
    finally:
        srv.stop()


def test_kill_9_of_mg_server_during_start_up_leaves_no_process(tmp_path, prepared_model):
    srv = ServerProcess(["--mg-mode", "always"], tmp_path / "server.log")
    try:
        assert wait_until(lambda: find(srv.proc.pid, "mg::verifier"), FAIL_WITHIN_S), srv.log_tail()
        seen = titles(srv.proc.pid)  # mg::controller and mg::verifier (loading the model)
        srv.proc.kill()
        srv.proc.wait()
        assert wait_until(lambda: not running(seen), GONE_WITHIN_S), {p: seen[p] for p in running(seen)}
    finally:
        srv.stop()


def test_a_port_in_use_fails_the_start_at_once(tmp_path):
    # Before: SGLang's server logged the bind error and then hung in its shutdown, for good.
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        t0 = time.monotonic()
        srv = ServerProcess(["--host", "127.0.0.1"], tmp_path / "server.log", port=port)
        try:
            rc, took, log = _exit(srv, t0)
        finally:
            srv.stop()
    assert rc == 2 and took < FAIL_WITHIN_S, log[-2000:]
    assert f"mg-server: cannot listen on 127.0.0.1:{port}: Address already in use" in log
    assert "mg::verifier" not in log and "SGLang compatibility" not in log  # nothing was started


# Run by the server's Python before anything else (a sitecustomize on PYTHONPATH): SGLang reports
# an untested version, its code staying the installed one.
FAKE_VERSION = """
import importlib.abc, importlib.util, sys


class _Fake(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "sglang":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("sglang")
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.__version__ = "0.5.99"
        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Fake())
"""


def test_an_untested_sglang_is_refused_unless_the_user_names_it(tmp_path, prepared_model, monkeypatch):
    import requests

    (tmp_path / "sitecustomize.py").write_text(FAKE_VERSION)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    t0 = time.monotonic()
    srv = ServerProcess([], tmp_path / "refused.log")
    try:
        rc, took, log = _exit(srv, t0)
    finally:
        srv.stop()
    assert rc == 1 and took < FAIL_WITHIN_S, log[-2000:]
    assert "mg-server: SGLang seams do not match:" in log and "Traceback" not in log
    assert "SGLang 0.5.99 is installed; mg_server supports SGLang 0.5.22 to 0.5.23" in log
    assert "--mg-allow-sglang 0.5.99" in log and "mg::verifier" not in log  # refused before anything started

    srv = ServerProcess(["--mg-allow-sglang", "0.5.99"], tmp_path / "allowed.log")
    try:
        srv.wait_ready()
        r = requests.post(srv.url + "/generate", headers={"X-Deterministic": "1"}, timeout=120,
                          json={"text": "Hello", "sampling_params": {"max_new_tokens": 4}})
        metrics = requests.get(srv.url + "/metrics", timeout=10).text
    finally:
        srv.stop()
    assert r.status_code == 200 and r.headers["x-mg-verdict"] == "verified"
    assert 'mg_sglang{tested="false",version="0.5.99"} 1.0' in metrics
    assert "mg: SGLang 0.5.99 is not a tested version (0.5.22 to 0.5.23)" in srv.log_path.read_text()

