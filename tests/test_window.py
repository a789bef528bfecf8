"""Window commit on a real server (SmolLM2 on CPU): rollback in place.

Every deterministic step is committed fast and checked behind. The test-only fault
MG_FAULT_MISSED_FLIP=3 makes every deterministic request's 4th answer token the fast path's
runner-up, with a low margin (MG_FAULT_FLIP_MARGIN=0), so it is checked within a few forwards;
answers of a few tokens end first and meet the finish barrier instead. Either way mg must roll
the request back in place (SGLang's state cut at the flip, the verifier's token forced, decoding
continued) before any client sees the wrong token:
every answer, streamed or not, alone or in a batch, equals the verifier-alone reference with the
verdict `verified`, and `mg_rollbacks_total` grows.
"""

import concurrent.futures as cf
import json

import tempfile

import pytest
import requests

from server_util import faulted_server


FLIP_AT = 3
MAX_NEW = 24
QUESTIONS = ("Explain in detail why the sky is blue, step by step.", "Write a short poem about the sea.",
             "What is the capital of France, and why?")
H = {"X-Deterministic": "1"}


@pytest.fixture(scope="module", params=["sync", "lagged"])
def setup(request, prepared_model, tmp_path_factory):
    """The synchronous seam (a CPU server's own), and the lagged seam on the CPU reference gate
    (MG_LAGGED_ON_CPU=1: the rows read one forward late, a due rollback applied on the synchronous
    path; on CUDA the lagged seam runs in tests/test_gpu_serving.py)."""
    env = {"MG_FAULT_MISSED_FLIP": str(FLIP_AT), "MG_FAULT_FLIP_MARGIN": "0"}
    if request.param == "lagged":
        env["MG_LAGGED_ON_CPU"] = "1"
    for srv, *rest in faulted_server(prepared_model, tmp_path_factory.mktemp("window") / "server.log",
                                     ["--mg-mode", "margin", "--mg-window", "8"], env, QUESTIONS, MAX_NEW):
        assert ("mg: lagged commit on" in srv.log_path.read_text()) == (request.param == "lagged")
        yield (srv, *rest)


def _counter(url: str, name: str) -> float:
    text = requests.get(url + "/metrics", timeout=30).text
    line = next((x for x in text.splitlines() if x.startswith(name + " ")), "x 0")
    return float(line.split()[1])


def _generate(url, ids, stream=False):
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}, "stream": stream}
    return requests.post(url + "/generate", json=body, headers=H, timeout=600, stream=stream)


@pytest.mark.server
def test_a_flipped_answer_is_rolled_back_to_the_reference(setup):
    srv, _, prompts, refs = setup
    before = _counter(srv.url, "mg_rollbacks_total")
    r = _generate(srv.url, prompts[0])
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == refs[0]
    assert r.headers["x-mg-verdict"] == "verified", r.headers
    assert "x-mg-corrected-from" not in r.headers  # corrected inside SGLang, not by the front
    assert _counter(srv.url, "mg_rollbacks_total") >= before + 1


@pytest.mark.server
def test_concurrent_and_batched_answers_all_equal_the_reference(setup):
    srv, _, prompts, refs = setup
    with cf.ThreadPoolExecutor(len(prompts)) as ex:
        rs = list(ex.map(lambda ids: _generate(srv.url, ids), prompts))
    assert [r.json()["output_ids"] for r in rs] == refs
    assert all(r.headers["x-mg-verdict"] == "verified" for r in rs)
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    r = requests.post(srv.url + "/generate", json=body, headers=H, timeout=600)
    assert [o["output_ids"] for o in r.json()] == refs and r.headers["x-mg-verdict"] == "verified"


@pytest.mark.server
def test_a_flip_at_the_length_limit_is_rolled_back_before_the_answer_ends(setup):
    """The flipped token is the last (or next to last) one max_new_tokens allows: SGLang ends the
    request there, the finish barrier checks it, undoes the end and the rollback puts the
    verifier's token in its place, which ends the answer by length again."""
    srv, _, prompts, refs = setup
    for n in (FLIP_AT + 1, FLIP_AT + 2):
        body = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": n, "temperature": 0}}
        r = requests.post(srv.url + "/generate", json=body, headers=H, timeout=600)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == refs[0][:n] and r.headers["x-mg-verdict"] == "verified"


@pytest.mark.server
def test_a_stream_never_shows_the_flipped_token(setup):
    """Streamed chunks carry only verified tokens: their concatenation is the reference."""
    srv, tok, prompts, refs = setup
    r = _generate(srv.url, prompts[1], stream=True)
    assert r.status_code == 200
    texts, verdicts = [], []
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            event = json.loads(line[6:])
            verdicts.append(event["mg_verdict"]) if "mg_verdict" in event else texts.append(event["text"])
    assert [v["states"] for v in verdicts] == [["verified"]]  # the last event, before [DONE]
    # /generate streams the answer's whole text so far in each chunk: each is a prefix of the reference
    final = tok.decode(refs[1], skip_special_tokens=True)
    assert texts and texts[-1] == final
    assert all(final.startswith(t) for t in texts), [t for t in texts if not final.startswith(t)]


@pytest.mark.server
def test_seeded_answers_are_the_verifiers_samples(setup, prepared_model):
    """Seeded sampling under the window commit (the fault flips these too): each answer equals the
    verifier-alone sample with the same seed, concurrently."""
    from seeded_util import sample, sampled_references, seeds

    srv, _, prompts, _ = setup
    refs = sampled_references(str(prepared_model), prompts[:2])
    with cf.ThreadPoolExecutor(2) as ex:
        got = list(ex.map(lambda a: sample(srv.url, a[0], a[1]), zip(prompts[:2], seeds(2))))
    assert got == [(r, "verified") for r in refs]


def test_the_window_flag_reaches_the_config_and_is_checked(monkeypatch, prepared_model, capsys, tmp_path):
    from mg_server.launch import cli, launcher

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the instance folders serve would remove
    seen = []
    monkeypatch.setattr(launcher, "serve", seen.append)
    base = ["serve", "--model", str(prepared_model), "--device", "cpu"]
    assert cli.main([*base, "--mg-window", "8"]) == 0
    assert cli.main(base) == 0
    assert (seen[0].window, seen[1].window) == (8, 32)
    try:
        rc = cli.main([*base, "--mg-window", "0"])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and "must be >= 1" in capsys.readouterr().err


def test_a_catchup_chunk_off_the_block_grid_is_refused(monkeypatch, prepared_model, capsys, tmp_path):
    """A chunk ends on a prefix-cache block's end, so the next chunk can map what the cache holds."""
    from mg_server.launch import cli, launcher

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []
    monkeypatch.setattr(launcher, "serve", seen.append)
    base = ["serve", "--model", str(prepared_model), "--device", "cpu"]
    assert cli.main([*base, "--mg-catchup-chunk", "64"]) == 0 and seen[0].catchup_chunk == 64
    for bad in ("100", "0"):
        try:
            rc = cli.main([*base, "--mg-catchup-chunk", bad])
        except SystemExit as e:
            rc = e.code
        assert rc == 2 and f"--mg-catchup-chunk must be a positive multiple of 16, got {bad}" in capsys.readouterr().err


@pytest.fixture(scope="module")
def early(prepared_model, tmp_path_factory):
    """A tiny tau: every step's margin is above it, so a stream's tokens leave before their check;
    the forced flip (a huge margin) goes out with them."""
    yield from faulted_server(prepared_model, tmp_path_factory.mktemp("window-early") / "server.log",
                              ["--mg-mode", "margin", "--mg-tau", "1e-6"],
                              {"MG_FAULT_MISSED_FLIP": str(FLIP_AT), "MG_FAULT_FLIP_MARGIN": "1e9"}, QUESTIONS, MAX_NEW)


@pytest.mark.server
def test_a_stream_releases_high_margin_tokens_early_and_reports_a_released_flip(early):
    """Early release is for streams: the flip was released, so it is a missed flip (the stream's
    verdict says `mismatch`, its text is the fast path's); a non-streamed answer is never released
    early, so the same flip is rolled back there and the answer is the reference."""
    from server_util import stream_states_and_text

    srv, tok, prompts, refs = early
    chat = {"model": "default", "messages": [{"role": "user", "content": QUESTIONS[0]}], "max_tokens": MAX_NEW,
            "temperature": 0}
    r = requests.post(srv.url + "/v1/chat/completions", json={**chat, "stream": True}, headers=H, timeout=600)
    states, text = stream_states_and_text(r.text)
    assert states == ["mismatch"] and text != tok.decode(refs[0], skip_special_tokens=True)
    r = requests.post(srv.url + "/v1/chat/completions", json=chat, headers=H, timeout=600)
    assert r.json()["choices"][0]["message"]["content"] == tok.decode(refs[0], skip_special_tokens=True)
    assert r.headers["x-mg-verdict"] == "verified"
