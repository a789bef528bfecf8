"""The verifier's view of `mg_server.verifier.kernels` (batch-invariant ops).

The model calls only the names bound here, so every reduction in the verifier goes through one
place, and the kernel configuration id reported in the hello names exactly these kernels.
"""

from __future__ import annotations

import torch

from mg_server.verifier.sampling import choice_of_pair, sampled_choice, sampled_pair, sampled_pairs  # noqa: F401 - re-exported
from mg_server.verifier.kernels import (  # noqa: F401 - re-exported
    add_rms_norm,
    attention_paged,
    attention_rows,
    kernel_config_id,
    matmul,
    norm_matmul,
    prepare_weight,
    rms_norm,
    rope_store,
    silu_matmul,
    top2,
)


def margin_rows(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] fp32 logits -> [R, 2] fp64: each row's top-1 minus top-2 (the fp32 difference, exact
    in fp64) and its argmax (ties -> lower id), ready for one copy to the host. One formula for the
    graph and the op-by-op forward, so their margins agree bit for bit."""
    vals, idx = top2(logits)  # [R, 2] fp32, [R, 2] int64
    return torch.stack([(vals[:, 0] - vals[:, 1]).double(), idx[:, 0].double()], dim=1)


def config_id(device: torch.device) -> str:
    """Kernel configuration id of the backend that serves `device` (CPU torch / CUDA Triton)."""
    return kernel_config_id(device)
