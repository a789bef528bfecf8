"""The verifier on SGLang's own tensors (what seam/export.py shares on a GPU, here loaded by
SGLang's loader on the CPU) computes what it computes from the checkpoint: the same logits, bit
for bit, per family (Llama with a padded vocabulary, Qwen2's qkv bias, Qwen3's q/k norms and a
tied embedding)."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from verifier_helpers import make_tiny

from mg_server.checkpoint import read_checkpoint
from mg_server.verifier.model import KVPool, Segment, VerifierModel

HERE = Path(__file__).parent


def logits(model: VerifierModel, tokens: list[int]) -> torch.Tensor:
    pool = KVPool(model.spec, 64, model.dtype, model.device)
    n = len(tokens)
    t = torch.tensor(tokens)
    seg = Segment(row_start=0, n_rows=n, q_start=0, kv_indices=torch.arange(n))
    return model.forward(t, torch.arange(n), torch.arange(n), [seg], pool)


@pytest.mark.parametrize("family,tie", [("llama", False), ("qwen2", False), ("qwen3", True)])
def test_sglangs_tensors_give_the_checkpoints_logits(tmp_path, family, tie):
    ckpt, _ = make_tiny(family, tmp_path / family, dtype=torch.bfloat16, tie=tie)
    saved = tmp_path / "sglang.pt"
    subprocess.run([sys.executable, str(HERE / "sglang_weights.py"), str(ckpt), str(saved)], check=True,
                   capture_output=True, timeout=300)
    tensors = torch.load(saved)
    assert tensors["model.embed_tokens.weight"].shape[0] == 256  # SGLang padded the 211-token vocabulary
    shared = VerifierModel.shared(read_checkpoint(ckpt).spec, tensors, torch.bfloat16, 64)
    loaded = VerifierModel.load(ckpt, torch.bfloat16, "cpu", 64)
    tokens = [5, 17, 200, 3, 99, 42, 7]
    assert torch.equal(logits(shared, tokens), logits(loaded, tokens))
    assert logits(shared, tokens).shape[1] == 211  # the padding rows are not logits


def test_a_layout_the_verifier_does_not_compute_is_refused(tmp_path):
    ckpt, _ = make_tiny("llama", tmp_path / "l", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="missing"):
        VerifierModel.shared(read_checkpoint(ckpt).spec, {"model.embed_tokens.weight": torch.zeros(211, 64, dtype=torch.bfloat16)},
                             torch.bfloat16, 64)
