"""`--mg-verifier-in scheduler`: the verifier worker as a thread of SGLang's scheduler process
(runtime/verifier/server.py, "Placement"), on a real CPU server.

The controller does not spawn it; SGLang's scheduler starts it from mg's hook, and the controller
connects once its beat says "serving". Run with `--mg-commit lag` on the lagged seam (CPU
reference gate) and the test-only fault that makes every answer's 4th token the fast path's
runner-up at a one-ulp margin, so each request takes a correction from the in-process verifier.
Every answer must equal the verifier-alone reference and come back `verified`, with no verifier
process anywhere.
"""

import pytest
import requests

from proc_util import titles
from server_util import faulted_server, stream_states_and_text
from test_resume import QUESTIONS, _counter



MAX_NEW = 16


@pytest.fixture(scope="module")
def setup(prepared_model, tmp_path_factory):
    env = {"MG_FAULT_MISSED_FLIP": "3", "MG_FAULT_FLIP_MARGIN": "0", "MG_LAGGED_ON_CPU": "1"}
    args = ["--mg-mode", "margin", "--mg-commit", "lag", "--mg-verifier-in", "scheduler"]
    yield from faulted_server(prepared_model, tmp_path_factory.mktemp("vin") / "server.log", args, env,
                              QUESTIONS, MAX_NEW)


@pytest.mark.server
def test_the_verifier_in_the_scheduler_corrects_and_verifies_every_answer(setup):
    srv, tok, prompts, refs = setup
    log = srv.log_path.read_text()
    assert "starting the verifier inside SGLang's scheduler process" in log
    assert "verifier ready" in log  # the controller connected to it
    procs = titles(srv.proc.pid).values()
    assert any("sglang::scheduler" in t for t in procs) and not any("mg::verifier" in t for t in procs)
    assert requests.get(srv.url + "/health", timeout=30).status_code == 200

    fixed = _counter(srv.url, "mg_lag_corrections_total")
    one = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    r = requests.post(srv.url + "/generate", json=one, headers={"X-Deterministic": "1"}, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == refs[0] and r.headers["x-mg-verdict"] == "verified"

    many = {"input_ids": prompts, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    r = requests.post(srv.url + "/generate", json=many, headers={"X-Deterministic": "1"}, timeout=600)
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == refs and r.headers["x-mg-verdict"] == "verified"
    assert _counter(srv.url, "mg_lag_corrections_total") >= fixed + 1 + len(prompts)  # the verifier disagreed

    chat = {"model": "default", "messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": MAX_NEW,
            "temperature": 0, "stream": True}
    r = requests.post(srv.url + "/v1/chat/completions", json=chat, headers={"X-Deterministic": "1"}, timeout=600)
    assert r.status_code == 200
    states, text = stream_states_and_text(r.text)
    assert states == ["verified"] and text == tok.decode(refs[1], skip_special_tokens=True)


def test_the_flag_reaches_the_config_and_needs_commit_lag(monkeypatch, prepared_model, capsys):
    from mg_server import cli
    from mg_server.sglang_ext import launch

    seen = []
    monkeypatch.setattr(launch, "serve", seen.append)
    base = ["serve", "--model", str(prepared_model), "--device", "cpu"]
    assert cli.main([*base, "--mg-commit", "lag", "--mg-verifier-in", "scheduler"]) == 0
    assert seen[0].verifier_in == "scheduler"
    assert cli.main(base) == 0 and seen[1].verifier_in == "process"  # the default
    bad = [(["--mg-commit", "hold"], "needs --mg-commit lag"), (["--mg-commit", "resume"], "needs --mg-commit lag"),
           (["--mg-commit", "lag", "--mg-verifier-memory-gb", "4"], "--mg-verifier-memory-gb"),
           (["--mg-commit", "lag", "--mg-ipc-spin-us", "50"], "--mg-ipc-spin-us")]
    for flags, why in bad:
        try:
            rc = cli.main([*base, *flags, "--mg-verifier-in", "scheduler"])
        except SystemExit as e:
            rc = e.code
        assert rc == 2 and why in capsys.readouterr().err, flags
