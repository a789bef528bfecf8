"""A missed flip is corrected, not only flagged (real server, SmolLM2 on CPU).

The server runs with the test-only fault MG_FAULT_MISSED_FLIP=3: the seam commits the runner-up
as the 4th answer token of every deterministic request, as if the fast path had flipped above
tau, so only the audit can find it (tau 0: nothing is verified before). A non-streamed answer
must then equal the verifier-alone reference (completed by the verifier from the flip) with
the verdict `verified`; a stream, whose tokens already left, must say `mismatch`.
"""

import json
import os

import pytest
import requests

from server_util import ServerProcess

pytestmark = pytest.mark.server

FLIP_AT = 3
MAX_NEW = 20
QUESTION = "Explain in detail why the sky is blue, step by step."


@pytest.fixture(scope="module")
def setup(prepared_model, tmp_path_factory):
    from transformers import AutoTokenizer

    from mg_server.prompts import chat_ids
    from mg_server.runtime.verifier.reference import greedy_reference, load_engine

    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    prompt = chat_ids(tok, ({"role": "user", "content": QUESTION},))
    (ref,) = greedy_reference(load_engine(str(prepared_model)), [prompt], MAX_NEW, stop_ids=(tok.eos_token_id,))
    old = os.environ.get("MG_FAULT_MISSED_FLIP")
    os.environ["MG_FAULT_MISSED_FLIP"] = str(FLIP_AT)
    try:
        srv = ServerProcess(["--mg-mode", "margin", "--mg-tau", "0"],
                            tmp_path_factory.mktemp("correction") / "server.log")
    finally:
        if old is None:
            os.environ.pop("MG_FAULT_MISSED_FLIP")
        else:
            os.environ["MG_FAULT_MISSED_FLIP"] = old
    try:
        srv.wait_ready()
        yield srv, tok, prompt, ref.tokens
    finally:
        srv.stop()


def _corrections(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    line = next((x for x in text.splitlines() if x.startswith("mg_corrections_total ")), "x 0")
    return float(line.split()[1])


def test_a_non_streamed_answer_with_a_missed_flip_equals_the_reference(setup):
    srv, _, prompt, ref = setup
    before = _corrections(srv.url)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    r = requests.post(srv.url + "/generate", json=body, headers={"X-Deterministic": "1"}, timeout=300)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["output_ids"] == ref
    assert r.headers["x-mg-verdict"] == "verified" and r.headers["x-deterministic-verified"] == "true"
    assert int(r.headers["x-mg-corrected-from"]) <= FLIP_AT
    assert _corrections(srv.url) == before + 1


def test_a_non_streamed_chat_answer_is_corrected_and_a_stream_says_mismatch(setup):
    srv, tok, _, ref = setup
    chat = {"model": "default", "messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_NEW,
            "temperature": 0}
    r = requests.post(srv.url + "/v1/chat/completions", json=chat, headers={"X-Deterministic": "1"}, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == tok.decode(ref, skip_special_tokens=True)
    assert r.headers["x-mg-verdict"] == "verified"

    r = requests.post(srv.url + "/v1/chat/completions", json={**chat, "stream": True},
                      headers={"X-Deterministic": "1"}, timeout=300)
    assert r.status_code == 200
    verdict = next(line for line in r.text.splitlines() if line.startswith(": mg-verdict "))
    assert json.loads(verdict[len(": mg-verdict "):])["states"] == ["mismatch"]
    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in r.text.splitlines() if line.startswith("data: {"))
    assert text != tok.decode(ref, skip_special_tokens=True)  # the flipped answer went out as it was
