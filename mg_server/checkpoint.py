"""A checkpoint folder read once: its config.json as one typed description, and its identity.

The launcher reads the served checkpoint (`read_checkpoint`) before anything starts and hands the
`Checkpoint` to every process that needs its facts (the verifier's shapes, the front's vocabulary,
SGLang's dtype and context checks, the τ profile's lookup). `config.json` is opened here only;
a multimodal config's `text_config` is unwrapped here only.

The identity (`model_identity`) is the one name of a model's numerics: a hash of the description
the verifier computes from (`ModelSpec`) and the full content of every *.safetensors file. It is
what `system_fingerprint` hashes beside the kernel configuration (wire/fingerprint.py), what a τ
profile is found by (policy.py) and what calibration's cache is keyed on. Not the folder's name,
nor config.json's bytes (their `transformers_version` and the like change nothing computed), nor
the files' names and sizes (a fine-tune re-exported with the same shapes has the same ones).
Cost: one read of the weight files, ~0.2 s for SmolLM2-135M's 270 MB on one CPU core, seconds
for an 8B model, paid once at start-up.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

# config.json's `architectures` the verifier computes (verifier/model.py), by family; a config
# without `architectures` is taken by its `model_type`.
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
FAMILIES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}  # model_type -> family
CONFIG_FILE = "config.json"  # a Hugging Face checkpoint's model config
_CHUNK = 8 << 20  # bytes read per hash update (any size gives the same digest)


def supported() -> str:
    """The supported architectures, for messages."""
    return ", ".join(f"{a} ({f})" for a, f in ARCHITECTURES.items())


@dataclass(frozen=True)
class ModelSpec:
    """What the verifier computes from: a decoder's shapes and constants."""

    family: str  # "llama" | "qwen2" | "qwen3"
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    eps: float
    rope_theta: float
    rope_scaling: tuple  # sorted (key, value) pairs of the HF rope parameters, () if none
    tie_embeddings: bool

    @staticmethod
    def from_hf_config(cfg: dict) -> "ModelSpec":
        """From a (text) config.json's fields; ValueError names what the verifier does not compute."""
        mt = cfg.get("model_type")
        arch = (cfg.get("architectures") or [None])[0]
        if arch is not None and arch not in ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}")
        if mt not in FAMILIES or (arch is not None and ARCHITECTURES[arch] != FAMILIES[mt]):
            raise ValueError(f"unsupported model_type {mt!r}" + (f" for {arch}" if arch else ""))
        if cfg.get("use_sliding_window"):
            raise ValueError("sliding-window attention is not supported by the verifier")
        rope = dict(cfg.get("rope_parameters") or {})  # transformers >= 5
        if cfg.get("rope_scaling"):  # transformers 4 layout
            rope.update(cfg["rope_scaling"])
        theta = float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        rope.pop("rope_theta", None)
        rtype = rope.get("rope_type", rope.get("type", "default"))
        if rtype not in ("default", "llama3", "linear"):
            raise ValueError(f"unsupported rope_type {rtype!r}")
        n_heads = int(cfg["num_attention_heads"])
        return ModelSpec(
            family=FAMILIES[mt],
            n_layers=int(cfg["num_hidden_layers"]),
            hidden=int(cfg["hidden_size"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // n_heads),
            intermediate=int(cfg["intermediate_size"]),
            vocab=int(cfg["vocab_size"]),
            eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=tuple(sorted((k, v) for k, v in rope.items() if k != "type")),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        )

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """The checkpoint's weight bytes in a `dtype_bytes` dtype, counted from the dimensions."""
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        layer = self.hidden * (q + 2 * kv) + q * self.hidden + 3 * self.hidden * self.intermediate + 2 * self.hidden
        embed = self.vocab * self.hidden * (1 if self.tie_embeddings else 2)
        return (self.n_layers * layer + embed + self.hidden) * dtype_bytes


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint folder's config.json, read once (`read_checkpoint`)."""

    path: str  # the folder
    architecture: str  # config.json's `architectures[0]` ("" when it names none)
    model_type: str  # the (text) config's `model_type`
    dtype: str  # the config's `dtype` / `torch_dtype` ("" when it names none)
    vocab_size: int  # 0 when the config has none
    max_positions: int  # `max_position_embeddings` (0 when the config has none)
    spec: ModelSpec | None  # None: not a model the verifier computes (`unsupported` says why)
    unsupported: str = ""
    identity: str = ""  # model_identity ("" when not computed: mode off, or no spec)

    def require_spec(self) -> ModelSpec:
        """The verifier's description, or ValueError naming the supported architectures."""
        if self.spec is None:
            raise ValueError(f"{self.path}: mg's verifier does not compute this model: {self.unsupported} (supported: "
                             f"{supported()}; --mg-mode off serves it as plain SGLang)")
        return self.spec


def is_checkpoint(path: str | Path) -> bool:
    """A folder with a model config (read_config's file)."""
    return (Path(path) / CONFIG_FILE).is_file()


def read_config(path: str | Path) -> dict:
    """A checkpoint's (text) config.json: the one place it is opened. OSError / ValueError when absent or bad."""
    conf = json.loads((Path(path) / CONFIG_FILE).read_text())
    if not isinstance(conf, dict):
        raise ValueError(f"{path}/{CONFIG_FILE} is not a JSON object")
    text = conf.get("text_config")
    if isinstance(text, dict):  # a multimodal config: the language model's fields, its architectures kept
        conf = {**text, "architectures": conf.get("architectures") or text.get("architectures")}
    return conf


def read_checkpoint(path: str | Path, identify: bool = True) -> Checkpoint:
    """The folder's description (OSError / ValueError without a readable config.json); its
    identity too when `identify` and the verifier computes the model."""
    conf = read_config(path)
    try:
        spec, why = ModelSpec.from_hf_config(conf), ""
    except (ValueError, KeyError, TypeError) as e:
        spec, why = None, (f"config.json lacks {e}" if isinstance(e, KeyError) else str(e))
    vocab, ctx = conf.get("vocab_size"), conf.get("max_position_embeddings")
    return Checkpoint(
        path=str(path), architecture=str((conf.get("architectures") or [""])[0] or ""),
        model_type=str(conf.get("model_type") or ""), dtype=str(conf.get("dtype") or conf.get("torch_dtype") or ""),
        vocab_size=vocab if isinstance(vocab, int) and vocab > 0 else 0,
        max_positions=ctx if isinstance(ctx, int) and ctx > 0 else 0,
        spec=spec, unsupported=why,
        identity=model_identity(path, spec) if identify and spec is not None else "",
    )


def model_identity(path: str | Path, spec: ModelSpec) -> str:
    """sha256 of the description and of every *.safetensors file's content, in name order (module doc)."""
    h = hashlib.sha256(json.dumps(asdict(spec), sort_keys=True).encode())
    for f in sorted(Path(path).glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size};".encode())  # names the file boundaries
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()[:32]
