"""A real mg-server process (SGLang engine, SmolLM2-135M, CPU) answering the OpenAI API."""

import re

import openai
import pytest
import requests

from server_util import ServerProcess

pytestmark = pytest.mark.server

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
DET = {"X-Deterministic": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, prepared_model):
    srv = ServerProcess([], tmp_path_factory.mktemp("server") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120)


def steps_total(server) -> float:
    text = requests.get(server.url + "/metrics", timeout=10).text
    m = re.search(r"^mg_deterministic_steps_total ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_health_and_models(server):
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    models = requests.get(server.url + "/v1/models", timeout=10).json()
    assert models["data"] and "SmolLM2" in models["data"][0]["id"]


def test_chat_paris_stops_at_im_end_with_header_echo(client):
    raw = client.chat.completions.with_raw_response.create(
        model="default", messages=PARIS, max_tokens=40, temperature=0, extra_headers=DET
    )
    assert raw.headers["x-deterministic"] == "1"
    resp = raw.parse()
    assert "Paris" in resp.choices[0].message.content
    assert resp.choices[0].finish_reason == "stop"
    assert "<|im_end|>" not in resp.choices[0].message.content


def test_streaming_chat_equals_plain(client):
    plain = client.chat.completions.create(model="default", messages=PARIS, max_tokens=40, temperature=0)
    stream = client.chat.completions.create(
        model="default", messages=PARIS, max_tokens=40, temperature=0, stream=True, extra_headers=DET
    )
    pieces, finish = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert len(pieces) > 2  # really streamed
    assert "".join(pieces) == plain.choices[0].message.content
    assert finish == "stop"


def test_completions_endpoint(client):
    resp = client.completions.create(model="default", prompt="The capital of France is", max_tokens=8, temperature=0, extra_headers=DET)
    assert resp.choices[0].text.strip()
    assert resp.usage.completion_tokens == 8 or resp.choices[0].finish_reason == "stop"


def test_native_generate(server):
    r = requests.post(server.url + "/generate", headers=DET, timeout=120,
                      json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 6}})
    assert r.status_code == 200 and r.headers["x-deterministic"] == "1"
    assert r.json()["text"]


def test_step_counter_counts_deterministic_tokens_only(server, client):
    before = steps_total(server)
    resp = client.chat.completions.create(
        model="default", temperature=0, max_tokens=24, extra_headers=DET,
        messages=[{"role": "user", "content": "Write a long poem about the sea."}],
    )
    n = resp.usage.completion_tokens
    after_det = steps_total(server)
    assert n >= 10
    assert abs((after_det - before) - n) <= 1, (after_det - before, n)

    client.chat.completions.create(model="default", temperature=0, max_tokens=16,
                                   messages=[{"role": "user", "content": "Write a long poem about the sea."}])
    client.chat.completions.create(model="default", temperature=0, max_tokens=16,
                                   messages=PARIS, extra_headers={"X-Deterministic": "0"})
    assert steps_total(server) == after_det


def test_margin_histogram_is_exported(server, client):
    client.chat.completions.create(model="default", messages=PARIS, max_tokens=8, temperature=0, extra_headers=DET)
    text = requests.get(server.url + "/metrics", timeout=10).text
    count = float(re.search(r"^mg_margin_count ([0-9.e+]+)$", text, re.M).group(1))
    assert count >= 8
    assert 'mg_margin_bucket{le="0.25"}' in text


def test_bad_header_is_400_and_server_keeps_serving(server, client):
    r = requests.post(server.url + "/v1/chat/completions", headers={"X-Deterministic": "maybe"}, timeout=30,
                      json={"model": "default", "messages": PARIS, "max_tokens": 4})
    assert r.status_code == 400
    assert "X-Deterministic" in r.json()["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="default", messages=PARIS, max_tokens=4, temperature=0.8, extra_headers=DET)
    ok = client.chat.completions.create(model="default", messages=PARIS, max_tokens=8, temperature=0)
    assert ok.choices[0].message.content
