"""OpenAI's `system_fingerprint` for deterministic responses: which weights and which verifier
numerics a reproducibility promise rests on.

    system_fingerprint = "fp_" + sha256(weights_digest | kernel_config_id)[:12]

- `weights_digest`: sha256 of config.json and the full content of every *.safetensors file (in
  name order), computed once by the verifier at load. Full content, not names and sizes
  (`model.model_identity`) or sampled bytes: a fine-tune re-exported with the same shapes has
  the same names and sizes, and any changed weight can change tokens. Cost: one read of files the
  verifier has just loaded (page cache), ~0.2 s for SmolLM2-135M's 270 MB on one CPU core,
  seconds for an 8B model, paid at start-up only.
- `kernel_config_id` (`mg_server.verifier.kernels`): a hash of the kernel table and the backend versions;
  the verifier's tokens are a function of (weights, prefix, kernel configuration), so a new id
  means a reproduced request may get other tokens.
Both are functions of files and code only, so the fingerprint is stable across restarts.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 8 << 20  # bytes read per update (any size gives the same digest)


def weights_digest(model_dir: str | Path) -> str:
    d = Path(model_dir)
    h = hashlib.sha256()
    for f in [d / "config.json", *sorted(d.glob("*.safetensors"))]:
        h.update(f"{f.name}:{f.stat().st_size};".encode())  # names the file boundaries
        with open(f, "rb") as fh:
            while chunk := fh.read(_CHUNK):
                h.update(chunk)
    return h.hexdigest()[:32]


def system_fingerprint(weights: str, kernel_config_id: str) -> str:
    if not weights or not kernel_config_id:
        return ""  # no verifier (mode off): no reproducibility promise to name
    return "fp_" + hashlib.sha256(f"{weights}|{kernel_config_id}".encode()).hexdigest()[:12]
