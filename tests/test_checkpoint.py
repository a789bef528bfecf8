"""The served checkpoint read once (mg_server.checkpoint): one typed description, one identity
(the fingerprint's, the τ profiles', calibration's), a shipped τ profile found by that identity
whatever the folder's name, and a model the verifier does not compute refused at start-up."""

import json
import os
import tempfile

import pytest

from mg_server.checkpoint import ARCHITECTURES, read_checkpoint
from mg_server.policy import PROFILE_DIR, read_profile, resolve_tau

SMOL_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, intermediate_size=96, vocab_size=100, max_position_embeddings=512,
                   torch_dtype="bfloat16")


def renamed(src, dst):
    """The checkpoint's files in a folder of another name (links: the same bytes)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("."):  # (not prepare's marker: mg did not prepare this folder)
            os.symlink(f, dst / f.name)
    return dst


def test_the_embedded_model_in_a_folder_of_another_name_gets_its_shipped_tau(prepared_model, tmp_path):
    other = renamed(prepared_model, tmp_path / "my-checkpoint")
    ck = read_checkpoint(other)
    assert ck.identity == read_checkpoint(prepared_model).identity
    for device, tau in (("cpu", 0.546875), ("cuda", 0.578125)):
        shipped = read_profile(PROFILE_DIR / f"SmolLM2-135M-Instruct.{device}.json")
        assert shipped["model_id"] == ck.identity  # the shipped profiles name the embedded model by its identity
        assert resolve_tau(ck.identity, None, device=device) == (tau, f"profile SmolLM2-135M-Instruct.{device}.json")


def test_serve_reads_the_checkpoint_once_and_finds_its_tau(prepared_model, tmp_path, monkeypatch):
    from mg_server.launch import cli, launcher

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the instance folders serve would remove
    seen = []
    monkeypatch.setattr(launcher, "serve", seen.append)
    other = renamed(prepared_model, tmp_path / "another-name")
    assert cli.main(["serve", "--model", str(other), "--device", "cpu"]) == 0
    cfg = seen[0]
    assert cfg.model.path == str(other) and cfg.model.spec.family == "llama" and cfg.model.vocab_size == 49152
    assert resolve_tau(cfg.model.identity, cfg.mg_tau, cfg.mg_mode, device="cpu")[0] == 0.546875


def test_an_unsupported_architecture_is_refused_at_start_naming_the_supported_ones(tmp_path, monkeypatch, capsys):
    from mg_server.launch import cli, launcher

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []
    monkeypatch.setattr(launcher, "serve", seen.append)
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(SMOL_CONFIG, architectures=["GPT2LMHeadModel"], model_type="gpt2")))
    assert cli.main(["serve", "--model", str(d), "--device", "cpu"]) == 2 and not seen
    err = capsys.readouterr().err
    assert "unsupported architecture 'GPT2LMHeadModel'" in err
    assert all(a in err for a in ARCHITECTURES) and "--mg-mode off" in err
    # plain SGLang serves it (mg off): read, not refused
    assert cli.main(["serve", "--model", str(d), "--device", "cpu", "--mg-mode", "off"]) == 0
    assert seen[0].model.spec is None and seen[0].model.identity == ""
    # no config at all: refused with mg on, SGLang's to judge with mg off
    assert cli.main(["serve", "--model", str(tmp_path / "none"), "--device", "cpu"]) == 2
    assert "no readable model config" in capsys.readouterr().err
    assert cli.main(["serve", "--model", str(tmp_path / "none"), "--device", "cpu", "--mg-mode", "off"]) == 0
    assert seen[1].model is None


def test_one_description_of_a_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3_vl",
         "text_config": dict(SMOL_CONFIG, architectures=None, model_type="qwen3", head_dim=32)}))
    ck = read_checkpoint(tmp_path)  # a multimodal config: the language model's fields, the outer architectures
    assert (ck.architecture, ck.model_type, ck.dtype, ck.vocab_size, ck.max_positions) == (
        "Qwen3ForCausalLM", "qwen3", "bfloat16", 100, 512)
    assert ck.spec.family == "qwen3" and ck.spec.head_dim == 32 and ck.identity
    # a family name that does not match its architecture is not guessed at
    (tmp_path / "config.json").write_text(json.dumps(dict(SMOL_CONFIG, model_type="qwen2")))
    ck = read_checkpoint(tmp_path)
    assert ck.spec is None and "model_type 'qwen2' for LlamaForCausalLM" in ck.unsupported
    with pytest.raises(ValueError, match="Qwen2ForCausalLM"):
        ck.require_spec()


def test_the_identity_is_the_weights_and_the_description(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d, extra in ((a, {}), (b, {"transformers_version": "9.9"})):  # fields nothing computes from
        d.mkdir()
        (d / "config.json").write_text(json.dumps(dict(SMOL_CONFIG, **extra)))
        (d / "model.safetensors").write_bytes(b"weights")
    assert read_checkpoint(a).identity == read_checkpoint(b).identity
    assert read_checkpoint(a, identify=False).identity == ""
    (b / "model.safetensors").write_bytes(b"weightz")  # same names and sizes, another weight
    assert read_checkpoint(a).identity != read_checkpoint(b).identity
    (b / "model.safetensors").write_bytes(b"weights")
    (b / "config.json").write_text(json.dumps(dict(SMOL_CONFIG, rms_norm_eps=1e-5)))  # another computation
    assert read_checkpoint(a).identity != read_checkpoint(b).identity


@pytest.mark.server
def test_the_embedded_model_served_from_a_folder_of_another_name_gets_its_shipped_tau(prepared_model, tmp_path):
    import openai
    from server_util import serving

    from mg_server.verifier.kernels.config import kernel_config_id
    from mg_server.wire.fingerprint import system_fingerprint

    other = renamed(prepared_model, tmp_path / "smol-under-another-name")
    for srv in serving(["--model", str(other), "--device", "cpu"], tmp_path / "server.log"):
        log = srv.log_path.read_text(errors="replace")
        assert "tau 0.547 (profile SmolLM2-135M-Instruct.cpu.json)" in log, srv.log_tail()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", timeout=300)
        raw = client.chat.completions.with_raw_response.create(
            model="default", messages=[{"role": "user", "content": "Say hi."}], max_tokens=4, temperature=0,
            extra_headers={"X-Deterministic": "1"})
        assert raw.headers["x-mg-verdict"] == "verified"
        ident = read_checkpoint(other).identity  # the folder's name changes neither the identity nor the fingerprint
        assert raw.parse().system_fingerprint == system_fingerprint(ident, kernel_config_id("cpu"))
