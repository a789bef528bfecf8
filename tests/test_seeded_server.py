"""Seeded sampling end to end (real server, SGLang bf16 on CPU, SmolLM2-135M): the same (prompt,
seed, temperature 0.8) gives the verifier-alone sampled answer alone and in concurrent mixed
batches, every time; other seeds give other answers; n = 3 gives three distinct samples, each
the single request with seed + i; responses carry the system_fingerprint of the weights and
kernels. CI-sized: one server. With mg off the same check finds mismatches (so it can fail):
`test_determinism.py::test_mg_off_finds_mismatches`, on that module's mode-off server."""

from __future__ import annotations

import openai
import pytest
import requests

from seeded_util import DET, T, mixed_round, sample, sampled_references, seeds
from server_util import serving

pytestmark = pytest.mark.server

N_PROMPTS = 8


@pytest.fixture(scope="module")
def workload(prepared_model):
    """Seeded prompts and their verifier-alone sampled references, plus neighbour traffic."""
    from transformers import AutoTokenizer

    from mg_server.prompts import chat_ids, mixed_prompts, sharegpt_prompts

    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    ids = [chat_ids(tok, ({"role": "user", "content": t},)) for t in mixed_prompts(N_PROMPTS)]
    others = [chat_ids(tok, ({"role": "user", "content": t},)) for t in sharegpt_prompts(4, seed=7)]
    return ids, sampled_references(str(prepared_model), ids), others


@pytest.fixture(scope="module")
def server(tmp_path_factory, prepared_model):
    yield from serving([], tmp_path_factory.mktemp("seeded") / "server.log")


def test_same_seed_same_answer_alone_and_mixed_equal_to_the_reference(server, workload):
    ids, refs, others = workload
    for p, s, ref in zip(ids[:4], seeds(4), refs):
        assert sample(server.url, p, s) == (ref, "verified")
    for k in (0, 1):  # every time: two rounds with other neighbours
        assert mixed_round(server.url, ids, others, k) == [(r, "verified") for r in refs]
    other_seed, _ = sample(server.url, ids[0], seeds(1)[0] + 1)
    assert other_seed != refs[0]  # another seed, another sample
    text = requests.get(server.url + "/metrics", timeout=10).text
    # every disagreement the checks found was rolled back (no missed flip reached an answer), no call failed
    assert "\nmg_audit_mismatch_total 0.0" in text
    assert "\nmg_verify_errors_total 0.0" in text


def test_n3_gives_three_reproducible_samples_with_the_system_fingerprint(server, prepared_model):
    from mg_server.verifier.kernels import kernel_config_id
    from mg_server.checkpoint import read_checkpoint
    from mg_server.wire.fingerprint import system_fingerprint

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
    want = system_fingerprint(read_checkpoint(prepared_model).identity, kernel_config_id("cpu"))
    assert resp.system_fingerprint == want == raw.headers["x-mg-system-fingerprint"]
    plain = client.chat.completions.create(model="default", messages=msgs, max_tokens=4, temperature=T, seed=7)
    assert plain.system_fingerprint is None  # plain requests are SGLang's own
