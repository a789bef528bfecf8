"""Admission and shutdown of a real server (CPU, SmolLM2): the verifier holds 64 deterministic
completions at once; more wait in a queue (`--mg-queue`, 1 here), past it a 429 with
Retry-After; one request asking for more than 64 is a 400 naming n; SIGTERM delivers every
deterministic answer that completes inside the drain and answers the rest with a 503, never a
reset connection."""

import os
import signal
import threading
import time

import pytest
import requests

from server_util import serving

pytestmark = pytest.mark.server

DET = {"X-Deterministic": "1"}
DRAIN_S = 25  # the six short answers finish well inside it on a loaded 2-core machine (10 s missed one)
CHAT = "/v1/chat/completions"


def chat(words: str, max_tokens: int, **extra) -> dict:
    return {"model": "default", "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens, **extra}


@pytest.fixture(scope="module")
def server(tmp_path_factory, prepared_model):
    yield from serving(["--mg-queue", "1", "--mg-drain-timeout", str(DRAIN_S)],
                       tmp_path_factory.mktemp("load") / "server.log")


def post_in_thread(url: str, body: dict, out: dict, key: str, stream: bool = False) -> threading.Thread:
    def go():
        try:
            r = requests.post(url, headers=DET, json=body, timeout=300, stream=stream)
            out[key] = (r.status_code, r.headers, r.text)
        except Exception as e:  # noqa: BLE001 - a reset connection is what these tests look for
            out[key] = (None, {}, repr(e))

    t = threading.Thread(target=go)
    t.start()
    return t


def test_n_above_what_the_verifier_holds_is_a_400_naming_n(server):
    r = requests.post(server.url + CHAT, headers=DET, timeout=60,
                      json=chat("Hi", 4, n=1000, temperature=0.8, seed=3))
    assert r.status_code == 400 and r.json()["param"] == "n" and "at most 64" in r.json()["message"], r.text
    assert r.headers["x-mg-verdict"] == "failed"
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


def test_past_the_full_queue_a_429_with_retry_after_and_the_queued_request_is_served(server):
    out: dict = {}
    # 64 seeded samples hold every verifier slot; the next request waits (queue 1), the one after is a 429
    big = post_in_thread(server.url + CHAT, chat("Tell me about the sea.", 10, n=64, temperature=0.8, seed=5), out,
                         "big")
    time.sleep(3)
    queued = post_in_thread(server.url + CHAT, chat("What is 2+2?", 4), out, "queued")
    time.sleep(1)
    r = requests.post(server.url + CHAT, headers=DET, json=chat("Hello", 4), timeout=60)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
    assert r.headers["x-mg-verdict"] == "failed" and "--mg-queue" in r.json()["message"]
    for _ in range(3):  # /health answers from mg's state at once, whatever the verifier is doing
        t0 = time.monotonic()
        assert requests.get(server.url + "/health", timeout=5).status_code == 200
        assert time.monotonic() - t0 < 1.0
    big.join(300)
    queued.join(300)
    assert out["big"][0] == 200 and out["big"][1]["x-mg-verdict"] == "verified", out["big"][2][:300]
    assert out["queued"][0] == 200 and out["queued"][1]["x-mg-verdict"] == "verified", out["queued"][2][:300]


def test_sigterm_delivers_what_completes_in_the_drain_and_answers_the_rest(server):
    # Last in this module: it stops the server.
    out: dict = {}
    jobs = [post_in_thread(server.url + "/generate", {"text": f"Count to {k}.", "sampling_params": {
        "max_new_tokens": 12}}, out, f"short{k}") for k in range(6)]
    jobs += [post_in_thread(server.url + "/generate", {"text": "Write a very long story.", "sampling_params": {
        "max_new_tokens": 1500, "ignore_eos": True}}, out, "long")]
    jobs += [post_in_thread(server.url + "/generate", {"text": "Write a very long poem.", "stream": True,
                                                       "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}},
                            out, "stream", stream=True)]
    time.sleep(2)
    t0 = time.monotonic()
    os.kill(server.proc.pid, signal.SIGTERM)
    time.sleep(0.5)
    late = requests.post(server.url + "/generate", headers=DET, timeout=30,
                         json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}})
    assert late.status_code == 503 and late.headers["x-mg-verdict"] == "failed", late.text
    assert requests.get(server.url + "/health", timeout=5).status_code == 503
    for j in jobs:
        j.join(DRAIN_S + 60)
    server.proc.wait(DRAIN_S + 30)
    assert time.monotonic() - t0 < DRAIN_S + 30
    for k in range(6):  # short: answered inside the drain, verified
        status, headers, text = out[f"short{k}"]
        assert status == 200 and headers["x-mg-verdict"] == "verified", (k, status, text[:300])
    status, headers, text = out["long"]  # too long for the drain: a 503 with verdict failed
    assert status == 503 and headers["x-mg-verdict"] == "failed" and "stopped" in text, (status, text[:300])
    status, headers, text = out["stream"]  # a started stream: ended by an error event, not a reset
    assert status == 200 and '"mg_verdict": "failed"' in text, (status, text[-300:])
