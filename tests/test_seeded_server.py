"""Seeded sampling end to end (real server, SGLang bf16 on CPU, SmolLM2-135M): the same (prompt,
seed, temperature 0.8) gives the verifier-alone sampled answer alone and in concurrent mixed
batches, every time; other seeds give other answers; n = 3 gives three distinct samples, each
the single request with seed + i; responses carry the system_fingerprint of the weights and
kernels. With mg off the same check finds mismatches, so it can fail. CI-sized."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from server_util import ServerProcess

pytestmark = pytest.mark.server

T, MAX_NEW, N_PROMPTS = 0.8, 20, 16
SEEDS = [1000 + i for i in range(N_PROMPTS)]
DET = {"X-Deterministic": "1"}


@pytest.fixture(scope="module")
def workload(prepared_model):
    """Seeded prompts and their verifier-alone sampled references, plus neighbour traffic."""
    import torch
    from transformers import AutoTokenizer

    from mg_server.prompts import chat_ids, mixed_prompts, sharegpt_prompts
    from mg_server.runtime.verifier.reference import greedy_reference, load_engine

    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    ids = [chat_ids(tok, ({"role": "user", "content": t},)) for t in mixed_prompts(N_PROMPTS)]
    others = [chat_ids(tok, ({"role": "user", "content": t},)) for t in sharegpt_prompts(4, seed=7)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        refs = greedy_reference(load_engine(str(prepared_model)), ids, MAX_NEW, temperature=T, seeds=SEEDS)
    finally:
        torch.set_num_threads(threads)
    return ids, [r.tokens for r in refs], others


@pytest.fixture(scope="module")
def server(tmp_path_factory, prepared_model):
    srv = ServerProcess([], tmp_path_factory.mktemp("seeded") / "server.log")
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def sample(url: str, ids: list[int], seed: int | None, header: bool = True, max_new: int = MAX_NEW,
           temperature: float = T) -> tuple[list[int], str]:
    params = {"max_new_tokens": max_new, "ignore_eos": True, "temperature": temperature}
    if seed is not None:
        params["sampling_seed"] = seed
    r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": params},
                      headers=DET if header else {}, timeout=600)
    r.raise_for_status()
    return r.json()["output_ids"], r.headers.get("x-mg-verdict", "")


def mixed_round(url: str, ids, others, k: int) -> list[tuple[list[int], str]]:
    """Seeded deterministic requests sent concurrently with plain sampled, plain greedy and
    deterministic greedy neighbours of other lengths (k varies the neighbours per round)."""
    with ThreadPoolExecutor(8) as pool:
        det = [pool.submit(sample, url, p, s) for p, s in zip(ids, SEEDS)]  # seeds as in the references
        for j, o in enumerate(others):
            pool.submit(sample, url, o, 7 + j + k, header=False, max_new=5 + 7 * j + k)  # SGLang's own sampling
            pool.submit(sample, url, o, None, header=(j % 2 == 0), max_new=9 + 3 * j, temperature=0)
        return [f.result() for f in det]


def test_same_seed_same_answer_alone_and_mixed_equal_to_the_reference(server, workload):
    ids, refs, others = workload
    for p, s, ref in zip(ids[:4], SEEDS, refs):
        assert sample(server.url, p, s) == (ref, "verified")
    for k in (0, 1):  # every time: two rounds with other neighbours
        assert mixed_round(server.url, ids[:8], others, k) == [(r, "verified") for r in refs[:8]]
    other_seed, _ = sample(server.url, ids[0], SEEDS[0] + 1)
    assert other_seed != refs[0]  # another seed, another sample
    text = requests.get(server.url + "/metrics", timeout=10).text
    assert "\nmg_audit_mismatch_total 0.0" in text and "\nmg_verify_errors_total 0.0" in text


def test_n3_gives_three_reproducible_samples_with_the_system_fingerprint(server, prepared_model):
    from mg_server.kernels import kernel_config_id
    from mg_server.runtime.fingerprint import system_fingerprint, weights_digest

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", timeout=600)
    msgs = [{"role": "user", "content": "Write a one-line poem about the sea."}]
    raw = client.chat.completions.with_raw_response.create(model="default", messages=msgs, max_tokens=16,
                                                           temperature=T, seed=7, n=3, extra_headers=DET)
    resp = raw.parse()
    texts = [c.message.content for c in resp.choices]
    assert len(set(texts)) == 3, texts
    assert raw.headers["x-mg-verdict"] == "verified"
    for i, text in enumerate(texts):
        one = client.chat.completions.create(model="default", messages=msgs, max_tokens=16, temperature=T,
                                             seed=7 + i, extra_headers=DET)
        assert one.choices[0].message.content == text  # sample i is the request with seed + i
        assert one.system_fingerprint == resp.system_fingerprint
    # a function of the weight files and the kernel configuration only: the same after a restart
    want = system_fingerprint(weights_digest(prepared_model), kernel_config_id("cpu"))
    assert resp.system_fingerprint == want == raw.headers["x-mg-system-fingerprint"]
    plain = client.chat.completions.create(model="default", messages=msgs, max_tokens=4, temperature=T, seed=7)
    assert plain.system_fingerprint is None  # plain requests are SGLang's own


def test_mg_off_finds_mismatches(tmp_path, workload):
    ids, refs, others = workload
    srv = ServerProcess(["--mg-mode", "off"], tmp_path / "off.log")
    try:
        srv.wait_ready()
        got = [sample(srv.url, p, s) for p, s in zip(ids, SEEDS)] + mixed_round(srv.url, ids, others, 0)
    finally:
        srv.stop()
    print("mg off: answers equal to the reference:", sum(t == r for (t, _), r in zip(got, refs + refs)), "of", len(got))
    assert all(v == "unverified" for _, v in got)
    assert [t for t, _ in got] != refs + refs  # the fast path alone does not reproduce the reference
