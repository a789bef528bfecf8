"""A real mg-server process (SGLang engine, SmolLM2-135M, CPU) answering the OpenAI API."""

import concurrent.futures as cf
import random
import re
import threading
import time
import uuid

import openai
import pytest
import requests

from server_util import serving

pytestmark = pytest.mark.server

PARIS = [{"role": "user", "content": "What is the capital of France?"}]
DET = {"X-Deterministic": "1"}


@pytest.fixture(scope="module")
def server(tmp_path_factory, prepared_model):
    yield from serving([], tmp_path_factory.mktemp("server") / "server.log")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=120)


def steps_total(server) -> float:
    """Steps mg decided for answer tokens: all it saw, less those of a timeline already cut
    (stale), those a rollback dropped (decoded again after a flip) and the look-ahead steps after
    an answer's end."""
    text = requests.get(server.url + "/metrics", timeout=10).text

    def get(name: str) -> float:
        m = re.search(rf"^{name} ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return get("mg_deterministic_steps_total") - get("mg_stale_steps_total") - \
        get("mg_rollback_dropped_steps_total") - get("mg_lookahead_steps_total")


def test_health_and_models(server):
    assert requests.get(server.url + "/health", timeout=10).status_code == 200
    models = requests.get(server.url + "/v1/models", timeout=10).json()
    assert models["data"] and "SmolLM2" in models["data"][0]["id"]


def test_metrics_name_the_sglang_version_served(server):
    import sglang

    text = requests.get(server.url + "/metrics", timeout=10).text
    assert f'mg_sglang{{tested="true",version="{sglang.__version__}"}} 1.0' in text, text[-2000:]


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


def test_the_openai_client_reads_verdict_and_fingerprint_of_answers_and_streams(client, prepared_model):
    """Through the client's own objects: `system_fingerprint` and the `mg_verdict` extra field of
    a non-streamed answer, and of a stream's chunks (every chunk, the verdict in the last one)."""
    from mg_server.verifier.kernels.config import kernel_config_id
    from mg_server.checkpoint import read_checkpoint
    from mg_server.wire.fingerprint import system_fingerprint

    want = system_fingerprint(read_checkpoint(prepared_model).identity, kernel_config_id("cpu"))
    raw = client.chat.completions.with_raw_response.create(
        model="default", messages=PARIS, max_tokens=12, temperature=0, extra_headers=DET)
    answer = raw.parse()
    assert answer.system_fingerprint == want
    assert answer.model_extra["mg_verdict"]["verdict"] == raw.headers["x-mg-verdict"] == "verified"
    assert answer.model_extra["mg_verdict"]["verified"] is True
    for create, kw in ((client.chat.completions.create, {"messages": PARIS}),
                       (client.completions.create, {"prompt": "The capital of France is"})):
        chunks = list(create(model="default", max_tokens=12, temperature=0, stream=True, extra_headers=DET, **kw))
        assert len(chunks) > 3 and all(c.system_fingerprint == want for c in chunks)
        verdicts = [c.model_extra["mg_verdict"] for c in chunks if "mg_verdict" in (c.model_extra or {})]
        assert len(verdicts) == 1 and chunks[-1].choices == [] and chunks[-1].id == chunks[0].id
        assert verdicts[0]["verified"] is True and verdicts[0]["verdict"] == "verified"
        assert verdicts[0]["states"] == ["verified"] and verdicts[0]["kernel_config"] == kernel_config_id("cpu")
    plain = list(client.chat.completions.create(model="default", messages=PARIS, max_tokens=4, stream=True))
    assert all(c.system_fingerprint is None and "mg_verdict" not in (c.model_extra or {}) for c in plain)


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


def test_endpoints_mg_does_not_handle_refuse_the_header(server):
    for method, path in (("POST", "/v1/responses"), ("POST", "/v1/messages"), ("POST", "/invocations"),
                         ("POST", "/api/generate")):
        r = requests.request(method, server.url + path, headers=DET, timeout=60,
                             json={"model": "default", "input": "hi", "prompt": "hi", "temperature": 0.9,
                                   "messages": PARIS, "max_tokens": 4})
        assert r.status_code == 400 and "/v1/chat/completions" in r.json()["message"], (path, r.status_code, r.text)
    # PUT /generate is SGLang's too: served like POST, with a verdict
    r = requests.put(server.url + "/generate", headers=DET, timeout=120,
                     json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4}})
    assert r.status_code == 200 and r.headers["x-deterministic-verified"] == "true"
    assert requests.get(server.url + "/v1/models", headers=DET, timeout=10).status_code == 200


def test_unmodelled_parameters_are_400_and_greedy_invariant_ones_change_nothing(server, client):
    url = server.url + "/v1/chat/completions"
    for extra, param in (({"frequency_penalty": 0.5}, "frequency_penalty"), ({"logprobs": True}, "logprobs"),
                         ({"logit_bias": {"42": 10}}, "logit_bias")):
        r = requests.post(url, headers=DET, timeout=60, json={"model": "default", "messages": PARIS, **extra})
        assert r.status_code == 400 and r.json()["param"] == param, r.text
    r = requests.post(server.url + "/generate", headers=DET, timeout=60,
                      json={"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 2, "n": 2}]})
    assert r.status_code == 400 and r.json()["param"] == "sampling_params[1].n", r.text
    # at temperature 0, top_p / top_k / min_p cannot change the greedy token
    base = client.chat.completions.with_raw_response.create(model="default", messages=PARIS, max_tokens=12,
                                                            extra_headers=DET)
    tuned = client.chat.completions.with_raw_response.create(model="default", messages=PARIS, max_tokens=12,
                                                             top_p=0.3, extra_body={"top_k": 3, "min_p": 0.5},
                                                             extra_headers=DET)
    assert base.parse().choices[0].message.content == tuned.parse().choices[0].message.content
    assert base.headers["x-deterministic-verified"] == tuned.headers["x-deterministic-verified"] == "true"
    # an empty answer is complete and has no unchecked token (it used to read `mismatch`)
    r = requests.post(server.url + "/generate", headers=DET, timeout=60,
                      json={"text": "Tell me about the sea", "sampling_params": {"max_new_tokens": 0}})
    assert r.status_code == 200 and r.json()["output_ids"] == [] and r.headers["x-deterministic-verified"] == "true"


def test_aborted_and_duplicate_id_answers_are_never_verified(server):
    rid = f"long-{uuid.uuid4().hex[:8]}"
    url = server.url + "/v1/chat/completions"
    story = {"model": "default", "messages": [{"role": "user", "content": "Write a long story about a dragon."}]}
    out = {}

    def long_request():
        out["r"] = requests.post(url, headers=DET, timeout=300, json={**story, "rid": rid, "max_tokens": 300})

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(3)
    dup = requests.post(url, headers=DET, timeout=120, json={**story, "rid": rid, "max_tokens": 4})
    assert dup.status_code == 400 and "Duplicate" in dup.text, dup.text
    assert dup.headers["x-deterministic-verified"] == "false" and dup.headers["x-mg-verdict"] == "failed"
    assert requests.post(server.url + "/abort_request", json={"rid": rid}, timeout=30).status_code == 200
    t.join(120)
    r = out["r"]
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "abort", r.text
    assert r.headers["x-deterministic-verified"] == "false" and r.headers["x-mg-verdict"] == "aborted"


def test_grammar_requests_are_400_and_never_take_the_server_down(server):
    # Last in this module: on a CPU with SGLang's default grammar backend, the first one stopped the server.
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    cases = [("/v1/chat/completions", {"model": "default", "messages": PARIS, "max_tokens": 4, "regex": "[0-9]+"}),
             ("/v1/chat/completions", {"model": "default", "messages": PARIS, "max_tokens": 4, "response_format": schema}),
             ("/v1/completions", {"model": "default", "prompt": "x", "max_tokens": 4, "ebnf": 'root ::= "a"'}),
             ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4, "json_schema": "{}"}})]
    for path, body in cases:
        for headers in ({}, DET):
            r = requests.post(server.url + path, json=body, headers=headers, timeout=60)
            assert r.status_code == 400, (path, headers, r.status_code, r.text)
            if headers:
                assert r.json()["param"].split(".")[-1] in ("regex", "response_format", "ebnf", "json_schema")
    assert requests.get(server.url + "/health", timeout=30).status_code == 200
    ok = requests.post(server.url + "/v1/chat/completions", timeout=60,
                       json={"model": "default", "messages": PARIS, "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


# ---- prefix reuse: deterministic requests that share a preamble, and seeded samples of one
# prompt, map the verifier's cached K/V of it (cold and warm told apart by
# mg_verifier_reused_rows_total); every answer equals the verifier-alone reference of its prompt,
# computed cold by a fresh engine; their prompts reach the verifier at arrival
PREFIX_NEW = 12


def _counter(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    line = next((x for x in text.splitlines() if x.startswith(name + " ")), f"{name} 0")
    return float(line.split()[1])


def _generate_ids(url: str, ids: list[int], **params) -> requests.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": PREFIX_NEW, "ignore_eos": True, "temperature": 0,
                                                  **params}}
    r = requests.post(url + "/generate", json=body, headers=DET, timeout=600)
    assert r.status_code == 200, r.text
    return r


def _references(model, prompts, temperature=0.0, seeds=None):
    from mg_server.verifier.reference import greedy_reference, load_engine

    engine = load_engine(model)  # cold: a fresh engine, nothing cached
    return [r.tokens for r in greedy_reference(engine, prompts, PREFIX_NEW, temperature=temperature, seeds=seeds)]


def test_a_shared_preamble_is_reused_and_every_answer_is_the_reference(server, prepared_model):
    rng = random.Random(4)
    # 18 whole blocks of the verifier's cache, longer than a CPU verify call (256 rows): the second
    # chunk maps its blocks too (each chunk computes its last block: 240 + 32 mapped per prompt)
    preamble = [rng.randrange(100, 40000) for _ in range(290)]
    prompts = [preamble + [rng.randrange(100, 40000) for _ in range(5 + k)] for k in range(4)]
    refs = _references(prepared_model, prompts)
    reused0, arrived0 = _counter(server.url, "mg_verifier_reused_rows_total"), _counter(server.url,
                                                                                      "mg_arrival_prefills_total")
    first = _generate_ids(server.url, prompts[0])  # cold
    assert _counter(server.url, "mg_verifier_reused_rows_total") == reused0
    assert first.json()["output_ids"] == refs[0] and first.headers["x-mg-verdict"] == "verified"
    with cf.ThreadPoolExecutor(3) as ex:  # warm: each maps 272 of the preamble's positions
        rs = list(ex.map(lambda p: _generate_ids(server.url, p), prompts[1:]))
    assert [r.json()["output_ids"] for r in rs] == refs[1:]
    assert all(r.headers["x-mg-verdict"] == "verified" for r in rs)
    assert _counter(server.url, "mg_verifier_reused_rows_total") >= reused0 + 3 * 272
    assert _counter(server.url, "mg_arrival_prefills_total") > arrived0


def test_seeded_samples_of_one_prompt_reuse_it_and_equal_the_reference(server, prepared_model):
    rng = random.Random(5)
    prompt = [rng.randrange(100, 40000) for _ in range(40)]
    seed, n = 77, 4
    refs = _references(prepared_model, [prompt] * n, temperature=0.8, seeds=[seed + i for i in range(n)])
    reused0 = _counter(server.url, "mg_verifier_reused_rows_total")
    r = _generate_ids(server.url, prompt, n=n, temperature=0.8, sampling_seed=seed)
    assert [o["output_ids"] for o in r.json()] == refs and r.headers["x-mg-verdict"] == "verified"
    assert _counter(server.url, "mg_verifier_reused_rows_total") >= reused0 + 32  # some sample mapped another's
