"""Resumable deterministic answers on a real server (SmolLM2 on CPU, `--mg-commit resume`).

Non-streamed deterministic requests are committed fast whatever their margin; the controller
checks the low-margin steps behind and the tail at the end. The test-only fault
MG_FAULT_MISSED_FLIP=3 makes every deterministic request's 4th answer token the fast path's
runner-up; with MG_FAULT_FLIP_MARGIN=0 that step is a low-margin one, so the check behind finds
it while the request still decodes and mg ends its fast path early. Every non-streamed answer
must still equal the verifier-alone reference (resumed from the flip by a deterministic
continuation, which flips at its own 4th token and is resumed in turn), with the verdict
`verified`. A stream or a batch body is never resumable: it takes the held path, where the same
low-margin step waits for the verifier, so it goes out right the first time, with no resume.
"""


import pytest
import requests

from server_util import faulted_server, stream_states_and_text

pytestmark = pytest.mark.server

FLIP_AT = 3
MAX_NEW = 24
QUESTIONS = ("Explain in detail why the sky is blue, step by step.", "Write a short poem about the sea.",
             "What is the capital of France, and why?")


@pytest.fixture(scope="module")
def setup(prepared_model, tmp_path_factory):
    yield from faulted_server(prepared_model, tmp_path_factory.mktemp("resume") / "server.log",
                              ["--mg-mode", "margin", "--mg-commit", "resume"],
                              {"MG_FAULT_MISSED_FLIP": str(FLIP_AT), "MG_FAULT_FLIP_MARGIN": "0"}, QUESTIONS, MAX_NEW)


def _counter(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    line = next((x for x in text.splitlines() if x.startswith(name + " ")), "x 0")
    return float(line.split()[1])


def test_a_diverged_answer_is_stopped_early_and_resumed_to_the_reference(setup):
    srv, _, prompts, refs = setup
    stops, steps = _counter(srv.url, "mg_resume_stops_total"), _counter(srv.url, "mg_deterministic_steps_total")
    body = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    r = requests.post(srv.url + "/generate", json=body, headers={"X-Deterministic": "1"}, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == refs[0]
    assert r.headers["x-mg-verdict"] == "verified" and r.headers["x-deterministic-verified"] == "true"
    assert r.headers["x-mg-corrected-from"] == str(FLIP_AT)
    # the check behind ended at least one fast path early (each continuation flips again)
    assert _counter(srv.url, "mg_resume_stops_total") > stops
    print("fast-path steps for", len(refs[0]), "tokens:", _counter(srv.url, "mg_deterministic_steps_total") - steps)


def test_a_generate_batch_body_is_held_not_resumed(setup):
    """Its response waits for every prompt of the body, so a stopped one would resume late: the
    batch takes the held path, where the low-margin flips wait for the verifier."""
    srv, _, prompts, refs = setup
    resumes = _counter(srv.url, "mg_corrections_total")
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    r = requests.post(srv.url + "/generate", json=body, headers={"X-Deterministic": "1"}, timeout=600)
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == refs
    assert r.headers["x-mg-verdict"] == "verified" and "x-mg-corrected-from" not in r.headers
    assert _counter(srv.url, "mg_corrections_total") == resumes


def test_a_chat_answer_is_resumed_and_a_stream_is_never_resumable(setup):
    srv, tok, _, refs = setup
    chat = {"model": "default", "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": MAX_NEW,
            "temperature": 0}
    r = requests.post(srv.url + "/v1/chat/completions", json=chat, headers={"X-Deterministic": "1"}, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == tok.decode(refs[0], skip_special_tokens=True)
    assert r.headers["x-mg-verdict"] == "verified"
    resumes, stops = _counter(srv.url, "mg_corrections_total"), _counter(srv.url, "mg_resume_stops_total")
    r = requests.post(srv.url + "/v1/chat/completions", json={**chat, "stream": True},
                      headers={"X-Deterministic": "1"}, timeout=600)
    assert r.status_code == 200
    states, text = stream_states_and_text(r.text)
    assert states == ["verified"]
    assert text == tok.decode(refs[0], skip_special_tokens=True)
    assert _counter(srv.url, "mg_corrections_total") == resumes and _counter(srv.url, "mg_resume_stops_total") == stops
