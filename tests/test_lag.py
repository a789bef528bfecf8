"""`--mg-commit lag` on a real server (SmolLM2 on CPU, the lagged seam with the CPU reference gate).

A low-margin step is not held: its fast token goes through, the verifier is asked one forward
later, and on a disagreement the token SGLang appends is swapped for the verifier's and the
request's next forward (computed from the fast token) is verified and repaired
(sglang_ext/lagcommit.py). The test-only fault MG_FAULT_MISSED_FLIP=3 with MG_FAULT_FLIP_MARGIN=0
makes every deterministic request's 4th answer token the fast path's runner-up at a margin of one
ulp, so each request gets such a correction. Every answer must still equal the verifier-alone
reference, with the verdict `verified`: single requests, a batch body and a stream.

The server runs its verifier as a thread of SGLang's scheduler process (`--mg-verifier-in
scheduler`, which needs lag), so the same answers also check that placement: one server start
instead of two (CI time). Of the three servers, the two without the chain also host the
controller in that process (`--mg-controller-in scheduler`: the seam calls it directly), the last
with `--mg-verify-ahead on` and the fault's margin far above tau (a step the margin gate lets
through, corrected because the verifier answered it ahead; on this CPU gate a MUST forward is answered at its own launch, so
`answer_ahead` is covered by tests/test_lagged.py and, on a GPU, tests/test_gpu_serving.py). Lag with the
verifier in its own process is covered by tests/test_lagged.py and, on a GPU,
tests/test_gpu_serving.py.
"""


import pytest
import requests

from proc_util import titles
from server_util import faulted_server, stream_states_and_text
from test_resume import QUESTIONS, _counter

pytestmark = pytest.mark.server

FLIP_AT = 3
MAX_NEW = 20
AHEAD_FLIP_MARGIN = "4"  # logits; the shipped tau of SmolLM2 is far below it


@pytest.fixture(scope="module", params=["chain-on", "chain-off-hosted", "ahead-hosted"])
def setup(request, prepared_model, tmp_path_factory):
    """--mg-lag-chain on and off (the default): the same answers; only on chains the must step.
    The other servers host the controller in SGLang's scheduler process, the last one with
    --mg-verify-ahead on (every step verified at its launch: runtime/controller/ahead.py)."""
    chain, hosted, ahead = request.param == "chain-on", request.param.endswith("hosted"), request.param == "ahead-hosted"
    # ahead: the fault's margin far above tau, a flip only the verifier's answer kept ahead can catch
    env = {"MG_FAULT_MISSED_FLIP": str(FLIP_AT), "MG_FAULT_FLIP_MARGIN": AHEAD_FLIP_MARGIN if ahead else "0",
           "MG_LAGGED_ON_CPU": "1"}
    for srv, *rest in faulted_server(prepared_model, tmp_path_factory.mktemp("lag") / "server.log",
                                     ["--mg-mode", "margin", "--mg-commit", "lag", "--mg-verifier-in", "scheduler",
                                      *(["--mg-lag-chain", "on"] if chain else []),
                                      *(["--mg-verify-ahead", "on"] if ahead else []),
                                      "--mg-controller-in", "scheduler" if hosted else "process"], env,
                                     QUESTIONS, MAX_NEW):
        srv.chain, srv.hosted, srv.ahead = chain, hosted, ahead
        yield (srv, *rest)


def test_a_corrected_token_is_swapped_before_it_is_emitted(setup):
    srv, _, prompts, refs = setup
    fixed, chained = _counter(srv.url, "mg_lag_corrections_total"), _counter(srv.url, "mg_chained_total")
    ahead, above = _counter(srv.url, "mg_verify_ahead_total"), _counter(srv.url, "mg_flips_above_tau_total")
    body = {"input_ids": prompts[0], "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    r = requests.post(srv.url + "/generate", json=body, headers={"X-Deterministic": "1"}, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == refs[0]
    assert r.headers["x-mg-verdict"] == "verified" and "x-mg-corrected-from" not in r.headers
    # the launcher's digest and kernel id (the thread verifier's hello matched that id)
    assert r.headers["x-mg-system-fingerprint"].startswith("fp_")
    assert _counter(srv.url, "mg_lag_corrections_total") >= fixed + 1  # the fault's token was replaced
    # with the chain, the next step (a must row) was answered by the correcting call itself
    # (VerifyItem.chain); ahead, by the call its launch made (each of the answer's steps after the
    # first had one: most are counted, the rest raced their Step); else (the default), by a verify call of its own
    if srv.chain or srv.ahead:
        assert _counter(srv.url, "mg_chained_total") >= chained + 1
    else:
        assert _counter(srv.url, "mg_chained_total") == chained == 0
    assert _counter(srv.url, "mg_verify_ahead_total") - ahead >= (MAX_NEW // 2 if srv.ahead else 0)
    # ahead, the fault's step was above tau: corrected from the answer kept ahead, not missed
    above = _counter(srv.url, "mg_flips_above_tau_total") - above
    assert above >= 1 if srv.ahead else above == 0
    assert ("verify ahead on" in srv.log_path.read_text()) == srv.ahead
    log = srv.log_path.read_text()
    assert "lagged commit on" in log and "lag True" in log
    # the verifier thread's placement makes SGLang's idle loop sleep (launch.IN_SCHEDULER_ARGS)
    assert "'sleep_on_idle': True" in log  # (SGLang logs its resolved server_args dict)
    # the verifier is a thread of the scheduler: it loaded there, the controller connected to it,
    # and no verifier process exists among the server's (hosted: no controller process either)
    assert "starting the verifier inside SGLang's scheduler process" in log and "verifier ready" in log
    procs = titles(srv.proc.pid).values()
    assert any("sglang::scheduler" in t for t in procs) and not any("mg::verifier" in t for t in procs)
    assert ("hosting the controller inside SGLang's scheduler process" in log) == srv.hosted
    assert any("mg::controller" in t for t in procs) != srv.hosted
    assert requests.get(srv.url + "/health", timeout=30).status_code == 200


def test_a_batch_body_and_a_stream_are_corrected_in_place(setup):
    srv, tok, prompts, refs = setup
    fixed = _counter(srv.url, "mg_lag_corrections_total")
    body = {"input_ids": prompts, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    r = requests.post(srv.url + "/generate", json=body, headers={"X-Deterministic": "1"}, timeout=600)
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == refs and r.headers["x-mg-verdict"] == "verified"
    assert _counter(srv.url, "mg_lag_corrections_total") >= fixed + len(prompts)
    chat = {"model": "default", "messages": [{"role": "user", "content": QUESTIONS[1]}], "max_tokens": MAX_NEW,
            "temperature": 0, "stream": True}
    r = requests.post(srv.url + "/v1/chat/completions", json=chat, headers={"X-Deterministic": "1"}, timeout=600)
    assert r.status_code == 200
    states, text = stream_states_and_text(r.text)
    assert states == ["verified"]
    assert text == tok.decode(refs[1], skip_special_tokens=True)
