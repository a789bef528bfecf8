"""SGLang's loaded weights, exported to the verifier over CUDA IPC (scheduler process).

Why: the verifier computes on the one copy of the weights SGLang holds (an 8B model's second copy
was 16 GB of the GPU). The hook factory runs after SGLang loaded the model and captured its
graphs (hook.py); before it connects to the controller it writes one file in the instance's run
folder (wire/weights.py): the pickled CUDA IPC handles (torch's own reduction: one handle per allocator segment,
the tensor's offset, shape and strides) of the tensors the verifier computes on
(`verifier.model.sglang_names`), with this process's pid. The verifier maps them read-only by
convention (legacy CUDA IPC has no read-only mapping; nothing in the verifier writes a weight),
at each of its starts. This process keeps the tensors referenced for its whole life; their
storage never moves (SGLang's captured graphs hold the same addresses).

What would break the mapping or change the weights under it is refused at start-up
(launcher.refuse_unsupported: weights loaded after the hook, the memory saver, a weight cache,
CPU offload, LoRA, quantization) or by the front (the weight-update endpoints).
"""

from __future__ import annotations

import logging
import os

from mg_server.wire.weights import weights_path

log = logging.getLogger(__name__)

# The suffixes of the parameters the verifier reads (verifier.model.sglang_names says which
# must be there for a family); a lm_head tied to the embedding is the embedding's tensor.
SUFFIXES = ("embed_tokens.weight", "model.norm.weight", "lm_head.weight", "qkv_proj.weight", "qkv_proj.bias",
            "o_proj.weight", "o_proj.bias", "q_norm.weight", "k_norm.weight", "gate_up_proj.weight",
            "down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")

_exported: dict = {}  # kept for the process's life: the verifier maps their storage


def select(model) -> dict:
    """name -> tensor of the parameters the verifier reads, as `model` holds them."""
    return {n: p.data for n, p in model.named_parameters(remove_duplicate=False) if n.endswith(SUFFIXES)}


def export(model, run_dir: str) -> str:
    """Write the IPC handles of `model`'s weights to the run folder's weights file; its path."""
    return export_tensors(select(model), run_dir)


def export_tensors(tensors: dict, run_dir: str) -> str:
    """Write the IPC handles of `tensors` (name -> CUDA tensor) to the run folder's weights file
    (atomically); its path."""
    import torch
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing  # noqa: F401 - registers torch's CUDA reductions with ForkingPickler

    if not tensors or any(not t.is_cuda for t in tensors.values()):
        raise RuntimeError("mg: SGLang's model weights are not all in CUDA memory; the verifier cannot share them")
    torch.cuda.synchronize()  # (the handles' events order only the current stream)
    _exported.update(tensors)
    blob = bytes(ForkingPickler.dumps({"pid": os.getpid(), "tensors": tensors}))
    path = weights_path(run_dir)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)
    size = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in tensors.values()}.values())
    log.info("mg: %d weight tensors (%.2f GB) shared with the verifier", len(tensors), size / 1e9)
    return path
