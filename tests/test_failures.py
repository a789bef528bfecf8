"""Faults of a real server (mode always: every deterministic step waits on the verifier): a
paused controller, a killed verifier, a killed mg-server. Plain traffic pays seconds, not a call
timeout; deterministic requests fail instead of claiming `verified`; /health and
`mg_verifier_up` report the fault; nothing is left running. Processes are found in this
server's own tree. One server for the module; the tests run in order, the last ones destroy it."""

import os
import signal
import threading
import time

import pytest
import requests

from proc_util import find, running, titles, wait_until
from server_util import serving

pytestmark = pytest.mark.server

STORY = {"model": "default", "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
         "temperature": 0}
DET = {"X-Deterministic": "1"}
# A fault may cost a plain request this much (liveness gives up after ~3 s). Before: 33.5 s (the
# verify timeout) with the verifier killed, 63 s (the step timeout) with the controller paused.
PLAIN_BOUND_S = 15


@pytest.fixture(scope="module")
def server(tmp_path_factory, prepared_model):
    yield from serving(["--mg-mode", "always"], tmp_path_factory.mktemp("failures") / "server.log")


def chat(srv, max_tokens: int, det: bool, timeout: float = 300) -> dict:
    t0 = time.monotonic()
    r = requests.post(srv.url + "/v1/chat/completions", json={**STORY, "max_tokens": max_tokens},
                      headers=DET if det else {}, timeout=timeout)
    return dict(status=r.status_code, body=r.text, seconds=time.monotonic() - t0,
                verified=r.headers.get("x-deterministic-verified"), verdict=r.headers.get("x-mg-verdict"))


def in_background(fn, *args) -> tuple[threading.Thread, dict]:
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(fn(*args)))
    t.start()
    return t, out


def health(srv) -> tuple[int, str, float]:
    t0 = time.monotonic()
    r = requests.get(srv.url + "/health", timeout=30)
    return r.status_code, r.text, time.monotonic() - t0


def test_a_paused_controller_costs_plain_traffic_seconds(server):
    assert chat(server, 4, det=True)["verified"] == "true"
    (controller,) = find(server.proc.pid, "mg::controller")
    det, det_out = in_background(chat, server, 200, True)
    time.sleep(2)
    plain, plain_out = in_background(chat, server, 24, False)
    time.sleep(0.3)
    os.kill(controller, signal.SIGSTOP)
    try:
        time.sleep(4)  # past the liveness bound
        status, text, took = health(server)
        assert status == 503 and "controller is not responding" in text and took < 5, (status, text, took)
        plain.join(60)
        det.join(60)
    finally:
        os.kill(controller, signal.SIGCONT)
    assert plain_out["status"] == 200 and plain_out["seconds"] < PLAIN_BOUND_S, plain_out
    assert det_out["status"] >= 400 and det_out["verified"] == "false", det_out
    # resumed: deterministic requests are verified again
    assert wait_until(lambda: health(server)[0] == 200, 20)
    again = chat(server, 6, det=True)
    assert again["status"] == 200 and again["verified"] == "true", again


def test_a_killed_verifier_fails_deterministic_rows_and_is_reported(server):
    det, det_out = in_background(chat, server, 200, True)
    time.sleep(2)
    plain, plain_out = in_background(chat, server, 24, False)
    time.sleep(0.3)
    (verifier,) = find(server.proc.pid, "mg::verifier")
    os.kill(verifier, signal.SIGKILL)
    plain.join(60)
    det.join(60)
    assert plain_out["status"] == 200 and plain_out["seconds"] < PLAIN_BOUND_S, plain_out
    # the in-flight deterministic request ends with an error, not with unverified tokens
    assert det_out["status"] >= 400 and det_out["verified"] == "false", det_out

    status, text, took = health(server)
    assert status == 503 and "verifier down" in text and "exited" in text and took < 2, (status, text)
    metrics = requests.get(server.url + "/metrics", timeout=10).text
    assert "\nmg_verifier_up 0.0" in metrics
    t0 = time.monotonic()
    r = chat(server, 8, det=True, timeout=60)
    assert r["status"] >= 400 and "verifier" in r["body"] and r["verified"] == "false", r
    assert time.monotonic() - t0 < 10  # at once, not after a timeout
    plain = chat(server, 8, det=False, timeout=60)
    assert plain["status"] == 200 and plain["seconds"] < 10


def test_kill_9_of_mg_server_leaves_no_process(server):
    seen = titles(server.proc.pid)
    assert any(t.startswith("mg::controller") for t in seen.values()), seen
    server.proc.kill()
    server.proc.wait()
    assert wait_until(lambda: not running(seen), 15), {p: seen[p] for p in running(seen)}
