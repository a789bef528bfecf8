"""The verifier's tensor-parallel forward: one rank's shard of the weights, fixed-order reductions.

Status: the model's TP forward, tested over gloo in two CPU processes
(tests/test_verifier_tp.py); a worker of several ranks serves it on a CPU (verifier/ranks.py).
`mg-server serve --tp` still refuses TP: the seam's rank agreement and the per-rank weight export
on CUDA are not built.

Layout (SGLang's per-rank tensors, so a rank's verifier can map its own scheduler's weights):
q, k and v heads split by rank inside the fused qkv rows, o_proj and down_proj split along their
input, gate and up rows split inside gate_up, the embedding and the LM head split by vocabulary
rows of zero-padded shards of one size (`shard` pads to a multiple of the world size; SGLang to
its own multiple: the model takes a shard's row count as the rank's offset).

Why a gather and a sum in rank order instead of an all-reduce: a ring or tree all-reduce chunks
the message by its size, so the order in which an element's partial sums meet depends on how
many rows the batch has; here every element is summed rank 0, 1, ... in fp32 whatever the
message, so a row's bits do not depend on the batch (the verifier's one rule). The cost is
world x the bytes of an all-reduce, on a verifier that moves few rows.

Shapes: `Ranks.reduce(x)` x [R, H] (the rank's partial sum) -> [R, H] x's dtype, equal on every
rank; `Ranks.gather_vocab(x)` x [R, V/world] fp32 -> [R, V_padded] fp32.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import Tensor

from mg_server.checkpoint import ModelSpec


@dataclass(frozen=True)
class Ranks:
    """This process's place in the verifier's tensor-parallel group."""

    rank: int
    world: int
    group: object = None  # a torch.distributed process group (None: the default group)

    def _gather(self, x: Tensor) -> list[Tensor]:
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts

    def reduce(self, x: Tensor) -> Tensor:
        """Sum of every rank's x, rank 0 first, in fp32, rounded once to x's dtype (module doc)."""
        parts = self._gather(x)
        acc = parts[0].float()
        for p in parts[1:]:
            acc = acc + p.float()
        return acc.to(x.dtype)

    def gather_vocab(self, x: Tensor) -> Tensor:
        """Every rank's vocabulary columns side by side, rank order (a copy: no arithmetic)."""
        return torch.cat(self._gather(x), dim=-1)


def local_heads(spec: ModelSpec, world: int) -> tuple[int, int]:
    """(q heads, kv heads) of one rank; ValueError where SGLang would replicate K/V heads."""
    if spec.n_heads % world or spec.n_kv_heads % world or spec.intermediate % world:
        raise ValueError(f"TP {world}: {spec.n_heads} q heads, {spec.n_kv_heads} K/V heads and an MLP of "
                         f"{spec.intermediate} must each split evenly over the ranks")
    return spec.n_heads // world, spec.n_kv_heads // world


def local_spec(spec: ModelSpec, world: int) -> ModelSpec:
    """The spec one rank's K/V pool is sized from: its share of the heads and of the MLP."""
    hq, hkv = local_heads(spec, world)
    return replace(spec, n_heads=hq, n_kv_heads=hkv, intermediate=spec.intermediate // world)


def vocab_rows(spec: ModelSpec, world: int, pad: int = 1) -> int:
    """Vocabulary rows a rank holds: the vocabulary padded to a multiple of `pad` (SGLang: 64),
    then split evenly (padded further to a multiple of the world size)."""
    return -(-(-(-spec.vocab // pad) * pad) // world)


def shard(tensors: dict[str, Tensor], spec: ModelSpec, rank: int, world: int, pad: int = 1) -> dict[str, Tensor]:
    """Fused full tensors (model.fused_checkpoint) -> this rank's, in SGLang's TP layout (module
    doc); the vocabulary padded as `vocab_rows` says."""
    hq, hkv = local_heads(spec, world)
    d, i_loc, vr = spec.head_dim, spec.intermediate // world, vocab_rows(spec, world, pad)

    def rows(w: Tensor, start: int, n: int) -> Tensor:
        return w[start:start + n]

    def vocab(w: Tensor) -> Tensor:  # [V, H] -> [vr, H], zero rows past the vocabulary
        out = torch.zeros((vr, w.shape[1]), dtype=w.dtype)
        part = w[rank * vr: min(spec.vocab, (rank + 1) * vr)]
        out[: part.shape[0]] = part
        return out

    def qkv(w: Tensor) -> Tensor:  # rows (or bias entries) q | k | v -> this rank's q | k | v
        q0, k0 = spec.n_heads * d, (spec.n_heads + spec.n_kv_heads) * d
        return torch.cat([rows(w, rank * hq * d, hq * d), rows(w, q0 + rank * hkv * d, hkv * d),
                          rows(w, k0 + rank * hkv * d, hkv * d)])

    out: dict[str, Tensor] = {}
    for name, w in tensors.items():
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = vocab(w[: spec.vocab])
        elif name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            out[name] = qkv(w)
        elif name.endswith("o_proj.weight"):
            out[name] = w[:, rank * hq * d:(rank + 1) * hq * d].contiguous()
        elif name.endswith("gate_up_proj.weight"):
            out[name] = torch.cat([rows(w, rank * i_loc, i_loc), rows(w, spec.intermediate + rank * i_loc, i_loc)])
        elif name.endswith("down_proj.weight"):
            out[name] = w[:, rank * i_loc:(rank + 1) * i_loc].contiguous()
        else:  # norms (q_norm / k_norm are per head_dim): every rank holds them whole
            out[name] = w
    return out


__all__ = ["Ranks", "local_heads", "local_spec", "shard", "vocab_rows"]
