"""The verifier's model against transformers' own implementations (tiny random checkpoints)."""

from __future__ import annotations

import pytest
import torch

from verifier_helpers import make_tiny

from mg_server.verifier.model import KVPool, ModelSpec, Segment, VerifierModel

T = 19  # tokens per check


def _run(model: VerifierModel, tokens: torch.Tensor):
    pool = KVPool(model.spec, 64, model.dtype, model.device)
    slots = torch.randperm(64)[:T]  # scattered slots: the paged layout must not matter
    seg = Segment(row_start=0, n_rows=T, q_start=0, kv_indices=slots)
    return model.forward(tokens, torch.arange(T), slots, [seg], pool), pool, slots


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_matches_transformers(tmp_path, family, dtype, tol):
    d, hf = make_tiny(family, tmp_path, dtype=dtype, tie=(family == "llama"))
    model = VerifierModel.load(d, dtype, "cpu", max_positions=128)
    tokens = torch.randint(0, model.spec.vocab, (T,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(tokens[None], use_cache=True)
    ref = out.logits[0].float()
    logits, pool, slots = _run(model, tokens)
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    err = (logits - ref).abs().max().item()
    assert err < tol * max(1.0, ref.abs().max().item()), err
    # K is stored after RoPE, [kv_heads, head_dim] per token: the same as HF's cache (and SGLang's).
    cache = out.past_key_values
    for li in range(model.spec.n_layers):
        k_hf = cache.layers[li].keys[0].transpose(0, 1)  # [T, Hkv, D]
        v_hf = cache.layers[li].values[0].transpose(0, 1)
        assert (pool.k[li, slots].float() - k_hf.float()).abs().max() < tol * 4
        assert (pool.v[li, slots].float() - v_hf.float()).abs().max() < tol * 4
    if family == "qwen2":
        assert model.layers[0].bqkv is not None
    if family == "qwen3":
        assert model.layers[0].q_norm is not None and model.layers[0].bqkv is None


def test_spec_parsing_variants():
    base = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                intermediate_size=96, vocab_size=10)
    s = ModelSpec.from_hf_config(dict(base, rope_theta=5e5))  # transformers 4 layout
    assert s.rope_theta == 5e5 and s.n_kv_heads == 4 and s.head_dim == 16
    s = ModelSpec.from_hf_config(dict(base, rope_parameters={
        "rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
    assert dict(s.rope_scaling)["rope_type"] == "llama3"
    with pytest.raises(ValueError):
        ModelSpec.from_hf_config(dict(base, model_type="gpt2"))
    with pytest.raises(ValueError):
        ModelSpec.from_hf_config(dict(base, rope_parameters={"rope_theta": 1e4, "rope_type": "yarn"}))


def test_llama3_rope_matches_transformers(tmp_path):
    from verifier_helpers import import_transformers

    tf = import_transformers()
    rope = {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = tf.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=50, rope_parameters=rope)
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path)
    model = VerifierModel.load(tmp_path, torch.float32, "cpu", max_positions=128)
    tokens = torch.randint(0, 50, (T,))
    with torch.no_grad():
        ref = hf(tokens[None]).logits[0]
    assert (_run(model, tokens)[0] - ref).abs().max() < 2e-5


def test_rope_table_does_not_depend_on_its_length(tmp_path):
    d, _ = make_tiny("llama", tmp_path)
    a = VerifierModel.load(d, torch.float32, "cpu", max_positions=40)
    b = VerifierModel.load(d, torch.float32, "cpu", max_positions=300)
    assert torch.equal(a.cos, b.cos[:40]) and torch.equal(a.sin, b.sin[:40])
