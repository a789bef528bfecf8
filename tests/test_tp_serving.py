"""`mg-server serve --tp 2` end to end on a CPU: SGLang's two TP ranks (each with a seam; rank 0
decides, rank 1 applies: seam/ranks.py) beside a TP-2 verifier (verifier/ranks.py). Every
deterministic answer equals the TP-2 verifier-alone reference, alone, mixed with other traffic
and with a shared prefix; the fast path disagreed with the reference on the way (rollbacks), so
without the ranks' agreement the answers would differ.

The model is a tiny random Llama with even head counts (SmolLM2's 9 heads do not split) and
SmolLM2's tokenizer.
"""

import os
import shutil
import uuid

import pytest

from server_util import ServerProcess

pytestmark = pytest.mark.server

MAX_NEW = 24
TINY_TP = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 128,
           "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32, "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
           "tie_word_embeddings": False, "max_position_embeddings": 2048, "torch_dtype": "bfloat16"}


class _WorkerEngine:
    """A served verifier worker as reference.greedy_reference's engine."""

    def __init__(self, client):
        self.client = client

    def step(self, items):
        return self.client.verify_many(items)

    def release(self, rid):
        self.client.release([rid])


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory, prepared_model):
    import torch

    from verifier_helpers import random_checkpoint

    out = random_checkpoint(tmp_path_factory.mktemp("tiny-tp"), TINY_TP, seed=0, dtype=torch.bfloat16)
    for f in prepared_model.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def workload(tp_model):
    """Prompts (alone/mixed, shared-prefix, other traffic) and their TP-2 verifier-alone answers."""
    from transformers import AutoTokenizer

    from mg_server.config import VerifierConfig
    from mg_server.prompts import chat_ids, mixed_prompts, sharegpt_prompts
    from mg_server.verifier.reference import greedy_reference
    from mg_server.wire.liveness import beat_path
    from verifier_helpers import served_worker

    tok = AutoTokenizer.from_pretrained(str(tp_model))

    def ids(text):
        return chat_ids(tok, ({"role": "user", "content": text},))

    det = [ids(t) for t in mixed_prompts(4, seed=3)]
    preamble = "You grade answers. Rubric: be brief, be right, cite the step that decides. Question: "
    prefix = [ids(preamble + q) for q in ("Why is the sky blue?", "What is 17 times 3?", "Name a prime above 50.")]
    other = [ids(t) for t in sharegpt_prompts(4, seed=7)]
    ipc = f"/tmp/mgv-tpref-{uuid.uuid4().hex[:8]}.sock"
    cfg = VerifierConfig(model_path=str(tp_model), ipc_path=ipc, max_seq_len=2048, num_threads=1, tp=2)
    gen = served_worker(cfg, timeout_s=300, extra_files=(beat_path(ipc + ".rank1"),))
    client, info = next(gen)
    try:
        assert info.kernel_config_id.endswith("-tp2")
        refs = greedy_reference(_WorkerEngine(client), det + prefix, MAX_NEW)
    finally:
        next(gen, None)  # the worker's shutdown (it must exit 0)
    tokens = [r.tokens for r in refs]
    return det, tokens[:len(det)], prefix, tokens[len(det):], other, info.kernel_config_id


def test_tp2_answers_equal_the_tp2_verifier_alone(tmp_path, tp_model, workload):
    from mg_server.evaluation.determinism import DeterminismConfig, run

    det, refs, prefix, prefix_refs, other, kernels = workload
    old = os.environ.get("SGLANG_CPU_OMP_THREADS_BIND")
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "0|1"  # SGLang's CPU TP: one core list per rank
    try:
        srv = ServerProcess(["--model", str(tp_model), "--tp", "2"], tmp_path / "server-tp2.log")
    finally:
        os.environ.pop("SGLANG_CPU_OMP_THREADS_BIND") if old is None else os.environ.__setitem__(
            "SGLANG_CPU_OMP_THREADS_BIND", old)
    try:
        srv.wait_ready()
        rep = run(DeterminismConfig(url=srv.url, max_new=MAX_NEW, phases=("alone", "mixed", "prefix"), group=2,
                                    others_per_group=2), det, refs, other, prefix_prompts=prefix, prefix_refs=prefix_refs)
    finally:
        srv.stop()
    log = (tmp_path / "server-tp2.log").read_text(errors="replace")
    assert f"kernels {kernels}" in log  # the served verifier is the TP-2 one the references came from
    assert not rep.mismatches, [(o.label, o.prompt_index, o.first_diff) for o in rep.mismatches]
    assert {o.label for o in rep.outcomes} == {"alone", "mixed", "prefix"}
    assert all(o.verdict == "verified" for o in rep.outcomes), [o.verdict for o in rep.outcomes]
    c = rep.counters
    assert c["mg_audit_mismatch_total"] == 0 and c["mg_verify_errors_total"] == 0
    # the fast path (SGLang's TP-2 kernels) disagreed with the reference, and both ranks rolled back
    assert c["mg_rollbacks_total"] > 0, c
