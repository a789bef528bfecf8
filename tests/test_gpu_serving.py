"""mg-server on CUDA with SGLang's GPU defaults (CUDA graphs, overlap scheduler): every step of a
deterministic request is seen and the answers equal the verifier-alone reference. A small
random-weight model of the SmolLM2 shape (`write_smol_model`, the same bits as the GPU benchmarks'
`smol` model); the tokenizer comes from $MG_GPU_TOKENIZER or the prepared embedded model. Skipped
without CUDA."""

import json
import os
import shutil
from pathlib import Path

from concurrent.futures import ThreadPoolExecutor

import pytest

from seeded_util import T, sample, seeds
from server_util import ServerProcess

pytestmark = [pytest.mark.gpu, pytest.mark.server]
REPO = Path(__file__).resolve().parent.parent
SMOL = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True)


def write_smol_model(out: Path, tokenizer: Path, seed: int = 0) -> Path:
    """A random-weight Llama checkpoint of the SmolLM2 shape: every matrix N(0, 0.02) in bf16 from
    one generator seeded `seed` on this host's device, norms 1, tied embeddings; the tokenizer files
    copied from `tokenizer`. Draw order and files match `benchmarks/gpu_e2e.py`'s `smol` model,
    so both hold the same bits on one host."""
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True)
    h, inter, layers = SMOL["hidden_size"], SMOL["intermediate_size"], SMOL["num_hidden_layers"]
    heads, kv = SMOL["num_attention_heads"], SMOL["num_key_value_heads"]
    d = h // heads
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
              "bos_token_id": 1, "eos_token_id": 2, "head_dim": d, "attention_bias": False, "mlp_bias": False,
              **SMOL}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (tokenizer / f).exists():
            shutil.copy(tokenizer / f, out / f)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rand(*s):
        return (torch.randn(*s, generator=gen, device=dev, dtype=torch.float32) * 0.02).to(torch.bfloat16).cpu()

    ones = torch.ones(h, dtype=torch.bfloat16)
    tensors = {"model.embed_tokens.weight": rand(SMOL["vocab_size"], h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({
            p + "self_attn.q_proj.weight": rand(heads * d, h), p + "self_attn.k_proj.weight": rand(kv * d, h),
            p + "self_attn.v_proj.weight": rand(kv * d, h), p + "self_attn.o_proj.weight": rand(h, heads * d),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": ones.clone(), p + "post_attention_layernorm.weight": ones.clone(),
        })
    tensors["model.norm.weight"] = ones.clone()
    fname = "model-00000.safetensors"
    save_file(tensors, str(out / fname), metadata={"format": "pt"})
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {k: fname for k in tensors}}))
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    tok = os.environ.get("MG_GPU_TOKENIZER")
    if tok is None:
        from mg_server.model.prepare import prepare_model

        tok = str(prepare_model(progress=False))
    return write_smol_model(tmp_path_factory.mktemp("m") / "smol", Path(tok))


@pytest.mark.parametrize("seam,mode", [("sync", "margin"), ("lagged", "margin"), ("lagged", "always")])
def test_graphs_and_overlap_on_every_step_seen_and_verified(model, tmp_path, seam, mode):
    """Every step committed fast and checked behind in windows (tau 0.05: ~15 % of the steps on
    these random weights are low-margin and checked within a few forwards; mode always checks
    every step so), a disagreement rolled back in place before the answer leaves. Seeded requests
    (temperature 0.8, which take the synchronous seam's path) also run beside the greedy ones on
    the lagged seam and must equal their verifier-alone samples."""
    from mg_server.evaluation.determinism import DeterminismConfig, noop_processor, run
    from mg_server.runtime.verifier.reference import greedy_reference, load_engine

    prompts = json.loads((REPO / "benchmarks" / "data" / "gpu_prompts.json").read_text())
    det, other = prompts["det"][:6], prompts["other"][:4]
    engine = load_engine(str(model), device="cuda", max_seq_len=1024, pool_tokens=8192)
    refs = [r.tokens for r in greedy_reference(engine, det, 32)]
    with_seeded = seam == "lagged" and mode == "margin"
    if with_seeded:
        seeded = [r.tokens for r in greedy_reference(engine, det[:4], 24, rid_prefix="seeded", temperature=T,
                                                     seeds=seeds(4))]
    del engine
    srv = ServerProcess(["--model", str(model), "--device", "cuda", "--mg-mode", mode, "--mg-seam", seam,
                         *(["--mg-tau", "0.05"] if mode == "margin" else [])], tmp_path / "server.log")
    try:
        srv.wait_ready(timeout=600)
        log = srv.log_path.read_text()
        assert "cuda graph on, overlap scheduler on" in log
        assert "Capture target decode CUDA graph end" in log
        assert ("mg: lagged commit on" in log) == (seam == "lagged")
        if with_seeded:  # seeded rows beside greedy ones, twice: the same samples each time
            with ThreadPoolExecutor(8) as pool:
                greedy = [pool.submit(sample, srv.url, p, None, max_new=32, temperature=0) for p in det[4:]]
                for _ in range(2):
                    got = list(pool.map(lambda a: sample(srv.url, a[0], a[1], max_new=24), zip(det[:4], seeds(4))))
                    assert got == [(r, "verified") for r in seeded]
                assert [f.result() for f in greedy] == [(r, "verified") for r in refs[4:]]
        rep = run(DeterminismConfig(url=srv.url, max_new=32, phases=("alone", "mixed")), det, refs, other,
                  noop_processor())
    finally:
        srv.stop()
    errors = [ln for ln in srv.log_path.read_text().splitlines() if "mg:" in ln and ("failed" in ln or "Error" in ln)]
    assert not rep.mismatches, (rep.mismatches, errors[:10])
    assert all(o.verdict == "verified" for o in rep.outcomes)
    c = rep.counters
    assert c["mg_deterministic_steps_total"] >= rep.det_tokens > 0, c
    print("window counters:", {k: c[k] for k in sorted(c)})
