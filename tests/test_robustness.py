"""A real server under an API key, tried as a careless client and as an attacker would (issue 12,
items 8 and 11): reused request ids, bad bodies (one of which used to stop the server), what
error bodies, server info and /metrics give away."""

import pytest
import requests

from server_util import ServerProcess

pytestmark = pytest.mark.server

KEY = "sk-test-12b-do-not-leak"
DET = {"X-Deterministic": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, prepared_model):
    srv = ServerProcess(["--api-key", KEY], tmp_path_factory.mktemp("robust") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def http(server):
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {KEY}"
    return s


def generate(server, http, rid, max_new_tokens=6, text="The capital of France is"):
    r = http.post(server.url + "/generate", headers=DET, timeout=120,
                  json={"text": text, **({"rid": rid} if rid else {}), "sampling_params": {"max_new_tokens": max_new_tokens}})
    return r.status_code, r.headers.get("x-mg-verdict"), r.json()


def test_a_request_id_can_be_reused_once_its_request_finished(server, http):
    first = generate(server, http, "client-id-1")
    again = generate(server, http, "client-id-1")
    other = generate(server, http, "client-id-1", 3, "Hello")
    assert first[:2] == again[:2] == other[:2] == (200, "verified"), (first, again, other)
    assert first[2]["output_ids"] == again[2]["output_ids"] and first[2]["meta_info"]["id"] == "client-id-1"
    chat = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "rid": "chat-1"}
    for _ in range(2):
        r = http.post(server.url + "/v1/chat/completions", headers=DET, json=chat, timeout=120)
        assert r.status_code == 200 and r.headers["x-mg-verdict"] == "verified", r.text


LEAKS = ('File "', "Traceback", "site-packages", ".venv", "/root/", "/work/", "/tmp/", KEY)


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": 5}),
    ("/generate", "not json"),
    ("/generate", {"input_ids": [[999999999]], "sampling_params": {"max_new_tokens": 2}}),
    ("/generate", {"input_ids": [5, -1], "sampling_params": {"max_new_tokens": 2}}),
    ("/v1/completions", {"model": "default", "prompt": [49152], "max_tokens": 2}),
    ("/v1/chat/completions", {"model": "default", "messages": "x"}),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": "many"}}),  # was a 500
])
def test_bad_bodies_get_short_errors_and_never_stop_the_server(server, http, path, body):
    kw = {"data": body} if isinstance(body, str) else {"json": body}
    r = http.post(server.url + path, timeout=60, **kw)
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert not [s for s in LEAKS if s in r.text], r.text
    assert len(r.text) < 1000
    assert http.get(server.url + "/health", timeout=10).status_code == 200
    assert generate(server, http, None, 2)[:2] == (200, "verified")


def test_server_info_and_metrics_keep_the_api_key(server, http):
    for path in ("/get_server_info", "/server_info"):
        r = http.get(server.url + path, timeout=30)
        assert r.status_code == 200 and KEY not in r.text and r.json()["api_key"] == "<redacted>"
    assert requests.get(server.url + "/metrics", timeout=10).status_code == 401
    r = http.get(server.url + "/metrics", timeout=10)
    assert r.status_code == 200 and "mg_deterministic_steps_total" in r.text
