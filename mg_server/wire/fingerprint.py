"""OpenAI's `system_fingerprint` for deterministic responses: which weights and which verifier
numerics a reproducibility promise rests on.

    system_fingerprint = "fp_" + sha256(model_id | kernel_config_id)[:12]

- `model_id` (`mg_server.checkpoint.model_identity`): the model's one identity, a hash of the
  description the verifier computes from and the full content of every *.safetensors file, read
  once at start-up. Full content, not names and sizes or sampled bytes: a fine-tune re-exported
  with the same shapes has the same names and sizes, and any changed weight can change tokens.
- `kernel_config_id` (`mg_server.verifier.kernels`): a hash of the kernel table and the backend versions;
  the verifier's tokens are a function of (weights, prefix, kernel configuration), so a new id
  means a reproduced request may get other tokens.
Both are functions of files and code only, so the fingerprint is stable across restarts (and the
same for one checkpoint in folders of any name).
"""

from __future__ import annotations

import hashlib


def system_fingerprint(model_id: str, kernel_config_id: str) -> str:
    if not model_id or not kernel_config_id:
        return ""  # no verifier (mode off): no reproducibility promise to name
    return "fp_" + hashlib.sha256(f"{model_id}|{kernel_config_id}".encode()).hexdigest()[:12]
