"""Failure behaviour of a real server: the verifier dies mid-run."""

import subprocess
import threading
import time

import pytest
import requests

from server_util import ServerProcess

pytestmark = pytest.mark.server

PROMPT = {"model": "default", "messages": [{"role": "user", "content": "Write a long story about a dragon."}],
          "temperature": 0}


def _pids(title: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", f"^{title}"], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_verifier_killed_mid_run(tmp_path):
    srv = ServerProcess(["--mg-mode", "always"], tmp_path / "server.log")
    try:
        srv.wait_ready()
        url = srv.url + "/v1/chat/completions"
        ok = requests.post(url, json={**PROMPT, "max_tokens": 4}, headers={"X-Deterministic": "1"}, timeout=120)
        assert ok.status_code == 200 and ok.headers["x-deterministic-verified"] == "true"

        # a long deterministic request is in flight when the verifier dies
        result = {}

        def long_request():
            t0 = time.monotonic()
            r = requests.post(url, json={**PROMPT, "max_tokens": 400}, headers={"X-Deterministic": "1"}, timeout=300)
            result.update(status=r.status_code, body=r.text, seconds=time.monotonic() - t0,
                          verified=r.headers.get("x-deterministic-verified"))

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(3)
        pids = _pids("mg::verifier")
        assert len(pids) == 1, pids
        subprocess.run(["kill", "-9", str(pids[0])], check=True)
        killed_at = time.monotonic()
        t.join(120)
        assert not t.is_alive()
        # the in-flight request ends with an error, not with unverified tokens
        assert result["status"] >= 400 or result["verified"] != "true", result
        assert result["status"] >= 400, result

        t0 = time.monotonic()
        r = requests.post(url, json={**PROMPT, "max_tokens": 8}, headers={"X-Deterministic": "1"}, timeout=60)
        assert r.status_code >= 400 and "verifier" in r.text, (r.status_code, r.text)
        assert time.monotonic() - t0 < 10  # quickly, not after a timeout

        plain = requests.post(url, json={**PROMPT, "max_tokens": 8}, timeout=60)
        assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"]
        assert time.monotonic() - killed_at < 60
    finally:
        srv.stop()
