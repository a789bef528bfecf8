"""A real server under an API key, tried as a careless client and as an attacker would: reused
request ids, bad bodies (one of which used to stop the server), what error bodies, server info and /metrics give away."""

import pytest
import requests

from server_util import serving

pytestmark = pytest.mark.server

KEY = "sk-test-12b-do-not-leak"
DET = {"X-Deterministic": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, prepared_model):
    yield from serving(["--api-key", KEY], tmp_path_factory.mktemp("robust") / "server.log")


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



def post_raw(url: str, body: bytes, headers: list[tuple[str, str]]) -> tuple[int, dict, dict]:
    """POST with header lines exactly as given (a name twice stays two lines) -> (status, headers, JSON)."""
    import http.client
    import json
    from urllib.parse import urlsplit

    u = urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    conn.putrequest("POST", u.path)
    for k, v in [("Authorization", f"Bearer {KEY}"), ("Content-Type", "application/json"),
                 ("Content-Length", str(len(body))), *headers]:
        conn.putheader(k, v)
    conn.endheaders(body)
    resp = conn.getresponse()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, json.loads(resp.read())


def test_every_malformed_deterministic_request_is_a_400_with_verdict_failed(server):
    """Each was a 500, a 503 or a plain answer before; every refusal says `failed`; the server
    serves on."""
    det = [("X-Deterministic", "1")]
    cases = [  # (path, body, header lines, status, words in the message)
        ("/v1/chat/completions", b"[" * 1000 + b"]" * 1000, det, 400, "nested too deeply"),
        *[("/generate", b, det, 400, "JSON object") for b in (b"[]", b'"str"', b"123", b"null")],
        ("/generate", b'{"text": "x", "rid": "a\\ud800"}', det, 400, "UTF-8"),
        ("/v1/chat/completions", b'{"model": "default", "messages": [{"role": "user", "content": "x"}]}',
         [("X-Deterministic", "1"), ("X-Deterministic", "0")], 400, "sent 2 times"),
        ("/v1/chat/completions", b'{"model": "default", "messages": [{"role": "user", "content": "x"}], '
         b'"temperature": 0.7}', det, 400, "seed"),  # mg's own refusal: a temperature without a seed
        ("/generate", b'{"text": "' + b"x" * (17 << 20) + b'"}', det, 413, "larger than"),
    ]
    for path, body, lines, status, words in cases:
        got, headers, answer = post_raw(server.url + path, body, lines)
        assert got == status and words in answer["message"], (path, got, answer)
        assert headers.get("x-mg-verdict") == "failed", (path, headers)


def test_an_empty_answers_verdict_is_the_same_on_every_endpoint(server, http):
    chat = {"model": "default", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 0}
    r = http.post(server.url + "/v1/chat/completions", headers=DET, json=chat, timeout=120)
    g = http.post(server.url + "/generate", headers=DET, json={"text": "x", "sampling_params": {"max_new_tokens": 0}},
                  timeout=120)
    assert (r.status_code, g.status_code) == (200, 200), (r.text, g.text)
    assert r.headers["x-mg-verdict"] == g.headers["x-mg-verdict"] == "verified"
    assert generate(server, http, None)[:2] == (200, "verified")  # still serving
