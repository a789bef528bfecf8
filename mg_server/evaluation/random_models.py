"""Random-weight Llama checkpoints of fixed shapes, for the GPU benchmarks and tests: every matrix
N(0, std) in bf16 from one generator seeded on the host's device (the bits differ by device, so a
model is per host), norms 1, and optionally a planted next-token map (PLANTED) that gives a
realistic flip rate."""

from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

log = logging.getLogger(__name__)

SHAPES = {  # Llama-family configs; head_dim = hidden / heads
    "smol": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                    num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
}
# Random weights flip far more often than a trained model: every logit is a draw of one normal, so
# the top two are close at almost every step (the 8B shape flipped at 8-19 % of steps, real models
# at 0.3-2 %). A "planted" model of a shape is the random one plus a next-token map: for a share of
# the vocabulary, token t's successor pi(t) gets a logit far above the rest, so only the other
# steps are near-ties, as in a trained model whose ties sit among confident steps. Per name:
#   embed_gain: the embedding's std over the other matrices' (the residual stream then keeps the
#               input token: cos(final hidden, embedding) ~0.7 at 180 on the 8B shape, measured on
#               CPU with the same random layers; 1 gives ~0.003, and no map could reach the logits)
#   share:      the share of tokens with a planted successor (the rest keep random logits)
#   strength:   the planted row's extra length along the token's embedding direction (0.2: its
#               logit ~ 0.2 * sqrt(hidden) * cos ~ 9, the random logits' maximum ~2.3)
PLANTED = {"llama8b-planted": dict(base="llama8b", embed_gain=180.0, share=0.9, strength=0.2)}
SHAPES.update({name: SHAPES[p["base"]] for name, p in PLANTED.items()})
# Published configs of real models (their config.json's fields that shape the model and its
# memory: context, rope scaling, q/k norms), for memory and serving runs with random weights.
REAL = {
    "llama31-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False,
                       max_position_embeddings=131072, rms_norm_eps=1e-5,
                       rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=False,
                     max_position_embeddings=40960, rms_norm_eps=1e-6),
}
SHAPES.update(REAL)


def write_model(name: str, out: Path, tokenizer: Path, seed: int = 0) -> Path:
    """A random-weight checkpoint of SHAPES[name] (bf16 safetensors, fixed seed; Llama, or a real
    config of REAL), with a planted next-token map where PLANTED names it."""
    import torch
    from safetensors.torch import save_file

    shape = SHAPES[name]
    # Every matrix N(0, std) with std = 0.02 * sqrt(576 / hidden): the SmolLM2 shape keeps the
    # usual 0.02, and every shape gets its per-matmul gain (std * sqrt(hidden) = 0.48). Why: at
    # 0.02 the 8B shape's gain is 1.28, and over 32 layers rounding noise then moves logits as
    # far as a typical margin, so flips are not near-ties (docs/history/gpu-measurements.md: flips up to
    # 0.6x the median margin at gain 1.28, up to 0.12x at 0.48; the H100 8B sweep at 0.02 repaired
    # 6 % of steps and completed 84 missed flips, SmolLM2 0.8 % and none).
    std = 0.02 * (576 / shape["hidden_size"]) ** 0.5
    marker = out / ".mg_random.json"
    plant = PLANTED.get(name)
    want = {"shape": shape, "seed": seed, "std": std, **({"plant": plant} if plant else {})}
    if marker.exists() and json.loads(marker.read_text()) == want:
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    t0 = time.monotonic()
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = shape.get("head_dim") or h // heads
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2, "head_dim": d, "attention_bias": False, "mlp_bias": False,
              **shape}
    qk_norm = config["model_type"] == "qwen3"
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer / f).exists():
            shutil.copy(tokenizer / f, out / f)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # the bits differ by device: a model is per host
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rand(*s):  # N(0, std), see above
        return (torch.randn(*s, generator=gen, device=dev, dtype=torch.float32) * std).to(torch.bfloat16).cpu()

    tensors, shard, index = {}, 0, {}

    def flush(final=False):
        nonlocal tensors, shard
        if tensors and (final or sum(t.numel() * 2 for t in tensors.values()) > (2 << 30)):
            fname = f"model-{shard:05d}.safetensors"
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
            index.update({k: fname for k in tensors})
            tensors, shard = {}, shard + 1

    embed = rand(shape["vocab_size"], h)
    if plant:
        embed = (embed.float() * plant["embed_gain"]).to(torch.bfloat16)
    tensors["model.embed_tokens.weight"] = embed
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(heads * d, h), p + "self_attn.k_proj.weight": rand(kv * d, h),
            p + "self_attn.v_proj.weight": rand(kv * d, h), p + "self_attn.o_proj.weight": rand(h, heads * d),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            **({p + "self_attn.q_norm.weight": torch.ones(d, dtype=torch.bfloat16),
                p + "self_attn.k_norm.weight": torch.ones(d, dtype=torch.bfloat16)} if qk_norm else {}),
        })
        flush()
    tensors["model.norm.weight"] = torch.ones(h, dtype=torch.bfloat16)
    if not shape["tie_word_embeddings"]:
        head = rand(shape["vocab_size"], h)
        if plant:
            head = planted_head(head, embed, plant, gen, dev)
        tensors["lm_head.weight"] = head
    flush(final=True)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    marker.write_text(json.dumps(want))
    log.info("model %s: %d shard(s) in %.1fs -> %s", name, shard, time.monotonic() - t0, out)
    return out


def planted_head(head, embed, plant: dict, gen, dev: str):
    """head [V, H] bf16 with row pi(t) += strength * embed[t] / |embed[t]| for a `share` of tokens t
    (pi a random permutation, so each planted successor is the successor of one token only)."""
    import torch

    v = head.shape[0]
    perm = torch.randperm(v, generator=gen, device=dev)
    planted = torch.rand(v, generator=gen, device=dev) < plant["share"]  # [V] bool: t has a successor
    src = torch.arange(v, device=dev)[planted]
    out = head.to(dev, torch.float32)
    e = embed.to(dev, torch.float32)[src]
    out[perm[src]] += plant["strength"] * e / e.norm(dim=-1, keepdim=True)
    return out.to(torch.bfloat16).cpu()
