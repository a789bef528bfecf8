"""Prefix reuse end to end (real server, CPU, SmolLM2): deterministic requests that share a
preamble, and seeded samples of one prompt, map the verifier's cached K/V of it (cold and warm
told apart by mg_verifier_reused_rows_total) and every answer equals the verifier-alone reference
of its prompt, computed cold by a fresh engine. Their prompts reach the verifier at arrival
(mg_arrival_prefills_total)."""

from __future__ import annotations

import concurrent.futures as cf
import random

import pytest
import requests

from server_util import ServerProcess

pytestmark = pytest.mark.server

H = {"X-Deterministic": "1"}
MAX_NEW = 12


@pytest.fixture(scope="module")
def served(tmp_path_factory, prepared_model):
    srv = ServerProcess(["--mg-mode", "margin"], tmp_path_factory.mktemp("prefix") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def counter(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    line = next((x for x in text.splitlines() if x.startswith(name + " ")), f"{name} 0")
    return float(line.split()[1])


def generate(url: str, ids: list[int], **params) -> requests.Response:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True, "temperature": 0,
                                                  **params}}
    r = requests.post(url + "/generate", json=body, headers=H, timeout=600)
    assert r.status_code == 200, r.text
    return r


def references(model, prompts, temperature=0.0, seeds=None):
    from mg_server.verifier.reference import greedy_reference, load_engine

    engine = load_engine(model)  # cold: a fresh engine, nothing cached
    return [r.tokens for r in greedy_reference(engine, prompts, MAX_NEW, temperature=temperature, seeds=seeds)]


def test_a_shared_preamble_is_reused_and_every_answer_is_the_reference(served, prepared_model):
    rng = random.Random(4)
    preamble = [rng.randrange(100, 40000) for _ in range(70)]  # 4 whole blocks of the verifier's cache
    prompts = [preamble + [rng.randrange(100, 40000) for _ in range(5 + k)] for k in range(4)]
    refs = references(prepared_model, prompts)
    reused0, arrived0 = counter(served.url, "mg_verifier_reused_rows_total"), counter(served.url,
                                                                                      "mg_arrival_prefills_total")
    first = generate(served.url, prompts[0])  # cold
    assert counter(served.url, "mg_verifier_reused_rows_total") == reused0
    assert first.json()["output_ids"] == refs[0] and first.headers["x-mg-verdict"] == "verified"
    with cf.ThreadPoolExecutor(3) as ex:  # warm: each maps the preamble's 64 positions
        rs = list(ex.map(lambda p: generate(served.url, p), prompts[1:]))
    assert [r.json()["output_ids"] for r in rs] == refs[1:]
    assert all(r.headers["x-mg-verdict"] == "verified" for r in rs)
    assert counter(served.url, "mg_verifier_reused_rows_total") >= reused0 + 3 * 64
    assert counter(served.url, "mg_arrival_prefills_total") > arrived0


def test_seeded_samples_of_one_prompt_reuse_it_and_equal_the_reference(served, prepared_model):
    rng = random.Random(5)
    prompt = [rng.randrange(100, 40000) for _ in range(40)]
    seed, n = 77, 4
    refs = references(prepared_model, [prompt] * n, temperature=0.8, seeds=[seed + i for i in range(n)])
    reused0 = counter(served.url, "mg_verifier_reused_rows_total")
    r = generate(served.url, prompt, n=n, temperature=0.8, sampling_seed=seed)
    assert [o["output_ids"] for o in r.json()] == refs and r.headers["x-mg-verdict"] == "verified"
    assert counter(served.url, "mg_verifier_reused_rows_total") >= reused0 + 32  # some sample mapped another's
