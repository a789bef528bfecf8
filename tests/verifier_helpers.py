"""Shared helpers for the verifier tests (no tests here): tiny random HF checkpoints, the real
SmolLM2, and a driver that decodes through the in-process engine and compares traces bitwise."""

from __future__ import annotations

from pathlib import Path

import torch


def import_transformers():
    """transformers, importable on a CPU host whose torchvision wheel cannot load its extension."""
    from mg_server.launch.compat import fix_torchvision

    fix_torchvision()
    import transformers

    return transformers


TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, vocab_size=211, max_position_embeddings=512, rms_norm_eps=1e-6)


def make_tiny(family: str, out_dir: Path, dtype: torch.dtype = torch.float32, seed: int = 0,
              tie: bool = False) -> tuple[Path, object]:
    """Save a tiny random-weight HF checkpoint of `family`; returns (dir, the HF model)."""
    tf = import_transformers()
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[family]
    kw = dict(TINY, tie_word_embeddings=tie)
    if family == "qwen3":
        kw["head_dim"] = 16
    cfg = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(dtype).eval()
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0; perturb them
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    return Path(out_dir), model


def smollm2_dir() -> Path:
    """The prepared SmolLM2-135M checkpoint (idempotent, cached by `prepare_model`)."""
    from mg_server.model.prepare import prepare_model

    return prepare_model(progress=False)


# ---- driving the in-process engine ------------------------------------------------------------
def smollm2_shaped(out_dir: Path, seed: int = 0, dtype: torch.dtype = torch.bfloat16, layers: int = 30) -> Path:
    """A random-weight checkpoint with SmolLM2-135M's shapes (for devices without the real one)."""
    cfg = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": layers,
           "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
           "rms_norm_eps": 1e-5, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
           "tie_word_embeddings": True, "max_position_embeddings": 8192}
    return random_checkpoint(out_dir, cfg, seed, dtype)


def random_checkpoint(out_dir: Path, cfg: dict, seed: int, dtype: torch.dtype) -> Path:
    import json

    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def rnd(*shape, std=0.02):
        return (torch.randn(*shape, generator=g) * std).to(dtype)

    t = {"model.embed_tokens.weight": rnd(v, h, std=1.0), "model.norm.weight": 1 + rnd(h, std=0.1)}
    for li in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{li}."
        t.update({p + "input_layernorm.weight": 1 + rnd(h, std=0.1),
                  p + "post_attention_layernorm.weight": 1 + rnd(h, std=0.1),
                  p + "self_attn.q_proj.weight": rnd(hq * d, h, std=h ** -0.5),
                  p + "self_attn.k_proj.weight": rnd(hkv * d, h, std=h ** -0.5),
                  p + "self_attn.v_proj.weight": rnd(hkv * d, h, std=h ** -0.5),
                  p + "self_attn.o_proj.weight": rnd(h, hq * d, std=(hq * d) ** -0.5 / 4),
                  p + "mlp.gate_proj.weight": rnd(i, h, std=h ** -0.5),
                  p + "mlp.up_proj.weight": rnd(i, h, std=h ** -0.5),
                  p + "mlp.down_proj.weight": rnd(h, i, std=i ** -0.5 / 4)})
    if not cfg.get("tie_word_embeddings"):
        t["lm_head.weight"] = rnd(v, h, std=h ** -0.5)
    save_file({k: x.contiguous() for k, x in t.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(cfg))
    return out_dir


class Trace:
    """What one request saw: per position its argmax/margin; per verified position logits + K/V."""

    def __init__(self):
        self.pred: dict[int, tuple[int, float]] = {}  # pos -> (token for pos+1, margin)
        self.logits: dict[int, torch.Tensor] = {}  # verified pos -> [V] fp32 (cpu)
        self.kv: dict[int, torch.Tensor] = {}  # verified pos -> [L, 2, Hkv, D] (cpu)
        self.cache: torch.Tensor | None = None  # final shadow cache [L, 2, S, Hkv, D] (cpu)
        self.batch_requests: list[int] = []

    def record(self, start: int, res) -> None:
        for j, (t, m) in enumerate(zip(res.audit_tokens, res.audit_margins)):
            self.pred[start + j] = (t, m)
        self.pred[res.pos] = (res.token, res.margin)
        self.logits[res.pos] = res.logits.cpu().clone()
        self.kv[res.pos] = res.kv_column.cpu().clone()
        self.batch_requests.append(res.batch_requests)


def schedule(n_prompt: int, total: int, gap: int, prompt_chunks: list[int] | None = None) -> list[int]:
    """Verify positions: prompt chunk ends (the last one = n_prompt-1), then every `gap` tokens."""
    ends, acc = [], 0
    for c in prompt_chunks or [n_prompt]:
        acc += c
        ends.append(acc - 1)
    assert ends[-1] == n_prompt - 1
    p = n_prompt - 1
    while p + gap <= total - 2:
        p += gap
        ends.append(p)
    if ends[-1] != total - 2:
        ends.append(total - 2)
    return ends


def drive(engine, rid: str, seq: list[int], positions: list[int], others: list[tuple[str, list[int]]] = (),
          n_gen: int = 0) -> tuple[Trace, list[int]]:
    """Verify `rid` at `positions`, teacher-forcing from `seq` (extended greedily when it runs out).

    `others`: (rid, prompt) requests decoded greedily (gap 1) in the same forwards as `rid`.
    Returns the trace and the sequence (prompt + verifier tokens).
    """
    from mg_server.wire.protocol import ErrorReply, VerifyItem

    engine.drop_cache()  # each drive computes every position (tests/test_prefix_cache.py maps them)
    seq = list(seq)
    tr = Trace()
    other_seq = {o: list(p) for o, p in others}
    other_seen = {o: 0 for o, _ in others}
    last = -1
    for pos in positions:
        assert pos < len(seq), "greedy extension needs gap 1"
        items = [VerifyItem(rid=rid, pos=pos, tokens=seq[last + 1: pos + 1])]
        for o, s in other_seq.items():
            items.append(VerifyItem(rid=o, pos=len(s) - 1, tokens=s[other_seen[o]:]))
        outs = engine.step(items)
        for it, res in zip(items, outs):
            assert not isinstance(res, ErrorReply), res
            if it.rid == rid:
                tr.record(last + 1, res)
                if pos + 1 == len(seq):
                    seq.append(res.token)
            else:
                other_seen[it.rid] = len(other_seq[it.rid])
                other_seq[it.rid].append(res.token)
        last = pos
    st = engine.seqs[rid]
    idx = torch.tensor(st.slots)
    tr.cache = torch.stack([engine.pool.k[:, idx], engine.pool.v[:, idx]], 1).cpu().clone()
    for o, _ in others:
        engine.release(o)
    engine.release(rid)
    return tr, seq


def assert_same(ref: Trace, got: Trace) -> None:
    """Bitwise: every position's argmax/margin, every shared verified logits row and K/V column,
    every K/V column that the catch-up computed (vs. the reference's verified ones), the cache."""
    assert got.pred == {p: ref.pred[p] for p in got.pred}, "argmax/margin differ"
    shared = set(got.logits) & set(ref.logits)
    assert shared, "no verified position in common"
    for p in shared:
        assert torch.equal(got.logits[p], ref.logits[p]), f"logits differ at {p}"
        assert torch.equal(got.kv[p], ref.kv[p]), f"K/V column differs at {p}"
    n = min(ref.cache.shape[2], got.cache.shape[2])
    assert torch.equal(ref.cache[:, :, :n], got.cache[:, :, :n]), "shadow caches differ"
    for p, kv in ref.kv.items():  # columns the other run computed during catch-up
        if p < got.cache.shape[2]:
            assert torch.equal(got.cache[:, :, p], kv), f"catch-up K/V column of {p} != verified one"


def served_worker(cfg, timeout_s: float = 60, extra_files: tuple[str, ...] = ()):
    """A verifier worker process of `cfg` and its client: yields (client, hello); at the end a
    shutdown, which must exit 0, and its socket and beat files removed (a stopped worker leaves
    them to its owner)."""
    import os

    from mg_server.verifier.client import VerifierClient
    from mg_server.verifier.server import start_verifier
    from mg_server.wire.liveness import beat_path

    proc = start_verifier(cfg)
    client = VerifierClient(cfg.ipc_path, timeout_s=timeout_s)
    info = client.connect()
    yield client, info
    client.shutdown()
    client.close()
    proc.join(30)
    for path in (cfg.ipc_path, beat_path(cfg.ipc_path), *extra_files):
        if os.path.exists(path):
            os.unlink(path)
    assert proc.exitcode == 0
