"""MarginGate end to end (real server, SGLang bf16 on CPU, SmolLM2-135M): every deterministic
answer equals the verifier-alone reference, alone and inside mixed batches; with mg off the same
check finds mismatches, so it can fail.

Sizes are CI-sized; `benchmarks/determinism.py` runs the same check bigger and records numbers.
"""

import dataclasses
import json
import os

import pytest

from server_util import ServerProcess

pytestmark = pytest.mark.server

N_PROMPTS = int(os.environ.get("MG_DET_PROMPTS", "8"))
MAX_NEW = int(os.environ.get("MG_DET_TOKENS", "32"))


@pytest.fixture(scope="module")
def workload(prepared_model):
    from mg_server.evaluation.determinism import build_workload

    return build_workload(str(prepared_model), N_PROMPTS, MAX_NEW)


def _run(mode, tmp_path, workload, phases=("alone", "mixed"), then=None):
    """`then(url)`, if given, runs on the same server after the check (no second server start)."""
    from mg_server.evaluation.determinism import DeterminismConfig, run

    srv = ServerProcess(["--mg-mode", mode], tmp_path / f"server-{mode}.log")
    try:
        srv.wait_ready()
        report = run(DeterminismConfig(url=srv.url, max_new=MAX_NEW, phases=phases), workload.det, workload.refs,
                     workload.other)
        if then is not None:
            then(srv.url)
    finally:
        srv.stop()
    print(mode, json.dumps(report.to_json()["counters"]), f"{report.seconds:.0f}s",
          f"mismatches={[(o.label, o.prompt_index, o.first_diff) for o in report.mismatches]}")
    return report


def test_margin_mode_matches_reference_everywhere(tmp_path, workload):
    rep = _run("margin", tmp_path, workload)
    assert not rep.mismatches, rep.mismatches
    c = rep.counters
    # every disagreement the checks found was rolled back (no missed flip reached an answer), and
    # every step the seam reported was committed (fast or low-margin) or dropped as stale
    assert c["mg_audit_mismatch_total"] == 0 and c["mg_verify_errors_total"] == 0
    assert c["steps_fast"] + c["steps_verify"] + c["mg_stale_steps_total"] == c["mg_deterministic_steps_total"]
    assert 0 < c["steps_verify"] < c["mg_deterministic_steps_total"]  # low margins: some, not all
    assert all(o.verdict == "verified" for o in rep.outcomes)


def test_always_mode_matches_reference_everywhere(tmp_path, workload):
    # three prompts: every step of always is checked within a few forwards (the slowest mode on
    # CPU); the margin test above runs the whole workload through the same verifier path
    k = min(3, N_PROMPTS)
    half = dataclasses.replace(workload, det=workload.det[:k], refs=workload.refs[:k], ref_margins=workload.ref_margins[:k])
    rep = _run("always", tmp_path, half)
    assert not rep.mismatches, rep.mismatches
    c = rep.counters
    # every step counts as low-margin (a step of a timeline rolled back already is dropped as stale)
    assert c["steps_fast"] == 0 < c["steps_verify"]
    assert c["steps_verify"] + c["mg_stale_steps_total"] == c["mg_deterministic_steps_total"]
    assert c["mg_audit_mismatch_total"] == 0  # (no missed flip: every disagreement was rolled back)


def test_mg_off_finds_mismatches(tmp_path, workload, prepared_model):
    from seeded_util import mixed_round, sample, sampled_references, seeds

    # seeded sampling too: the fast path's samples, alone and in a mixed batch
    refs = sampled_references(str(prepared_model), workload.det)
    got = []

    def seeded(url):
        got.extend(sample(url, p, s) for p, s in zip(workload.det, seeds(len(refs))))
        got.extend(mixed_round(url, workload.det, workload.other[:4], 0))

    rep = _run("off", tmp_path, workload, phases=("alone",), then=seeded)
    assert rep.mismatches  # the fast path alone does not reproduce the verifier's answers
    assert all(o.verdict == "unverified" for o in rep.outcomes)  # and the response says so
    print("seeded, mg off: answers equal to the reference:", sum(t == r for (t, _), r in zip(got, refs + refs)),
          "of", len(got))
    assert [t for t, _ in got] != refs + refs and all(v == "unverified" for _, v in got)
