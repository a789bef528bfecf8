"""mg-server on CUDA with SGLang's GPU defaults (CUDA graphs, overlap scheduler): every step of a
deterministic request is seen and the answers equal the verifier-alone reference. A small
random-weight model of the SmolLM2 shape (`evaluation.random_models`, the GPU benchmarks'
`smol` model); the tokenizer comes from $MG_GPU_TOKENIZER or the prepared embedded model. Skipped
without CUDA."""

import json
import os
from pathlib import Path

from concurrent.futures import ThreadPoolExecutor

import pytest

from mg_server.evaluation.random_models import write_model
from seeded_util import T, sample, seeds
from server_util import ServerProcess

pytestmark = [pytest.mark.gpu, pytest.mark.server]
REPO = Path(__file__).resolve().parent.parent
@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tok = os.environ.get("MG_GPU_TOKENIZER")
    if tok is None:
        from mg_server.model.prepare import prepare_model

        tok = str(prepare_model(progress=False))
    return write_model("smol", tmp_path_factory.mktemp("m") / "smol", Path(tok))


@pytest.mark.parametrize("mode", ["margin", "always"])
def test_graphs_and_overlap_on_every_step_seen_and_verified(model, tmp_path, mode):
    """Every step committed fast and checked behind in windows (tau 0.05: ~15 % of the steps on
    these random weights are low-margin and checked within a few forwards; mode always checks
    every step so), a disagreement rolled back in place before the answer leaves. Seeded requests
    (temperature 0.8, which take the synchronous seam's path) also run beside the greedy ones on
    the lagged seam and must equal their verifier-alone samples."""
    from mg_server.evaluation.determinism import DeterminismConfig, run
    from mg_server.verifier.reference import greedy_reference, load_engine

    prompts = json.loads((REPO / "benchmarks" / "data" / "gpu_prompts.json").read_text())
    det, other = prompts["det"][:6], prompts["other"][:4]
    engine = load_engine(str(model), device="cuda", max_seq_len=1024, pool_tokens=8192)
    refs = [r.tokens for r in greedy_reference(engine, det, 32)]
    with_seeded = mode == "margin"
    if with_seeded:
        seeded = [r.tokens for r in greedy_reference(engine, det[:4], 24, rid_prefix="seeded", temperature=T,
                                                     seeds=seeds(4))]
    del engine
    srv = ServerProcess(["--model", str(model), "--device", "cuda", "--mg-mode", mode,
                         *(["--mg-tau", "0.05"] if mode == "margin" else [])], tmp_path / "server.log")
    try:
        srv.wait_ready(timeout=600)
        log = srv.log_path.read_text()
        assert "cuda graph on, overlap scheduler on" in log
        assert "Capture target decode CUDA graph end" in log
        assert "mg: fast path logits fp32 (--enable-fp32-lm-head)" in log  # SGLang 0.5.23's fp32 LM head is free
        assert "mg: lagged commit on" in log and "SGLang's weights mapped" in log
        if with_seeded:  # seeded rows beside greedy ones, twice: the same samples each time
            with ThreadPoolExecutor(8) as pool:
                greedy = [pool.submit(sample, srv.url, p, None, max_new=32, temperature=0) for p in det[4:]]
                for _ in range(2):
                    got = list(pool.map(lambda a: sample(srv.url, a[0], a[1], max_new=24), zip(det[:4], seeds(4))))
                    assert got == [(r, "verified") for r in seeded]
                assert [f.result() for f in greedy] == [(r, "verified") for r in refs[4:]]
        rep = run(DeterminismConfig(url=srv.url, max_new=32, phases=("alone", "mixed")), det, refs, other)
    finally:
        srv.stop()
    errors = [ln for ln in srv.log_path.read_text().splitlines() if "mg:" in ln and ("failed" in ln or "Error" in ln)]
    assert not rep.mismatches, (rep.mismatches, errors[:10])
    assert all(o.verdict == "verified" for o in rep.outcomes)
    c = rep.counters
    assert c["mg_deterministic_steps_total"] >= rep.det_tokens > 0, c
    print("window counters:", {k: c[k] for k in sorted(c)})
