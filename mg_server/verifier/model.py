"""A compact, batch-invariant decoder for the Llama family, Qwen2/Qwen2.5 and Qwen3.

Loads a Hugging Face checkpoint folder (config.json + *.safetensors) directly and calls the
batch-invariant kernels (`ops`) for every reduction: projections, norms, attention, top-2.
Everything else is elementwise, gathers or copies, which cannot depend on the batch.

RoPE is the rotate-half ("NeoX") form that HF Llama/Qwen and SGLang's default rotary embedding
use: for a head vector x = [x1, x2] (halves of head_dim), rope(x) = x*cos + [-x2, x1]*sin with
cos/sin of pos * inv_freq repeated twice. K is stored *after* RoPE, per layer per token as
[kv_heads, head_dim] in the model dtype: the layout of SGLang's MHATokenToKVPool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from mg_server.checkpoint import Checkpoint, ModelSpec, read_checkpoint
from mg_server.verifier import ops
from mg_server.verifier import tp as tp_mod

__all__ = ["KVPool", "ModelSpec", "Segment", "VerifierModel", "fused_checkpoint", "sglang_names"]

def _inv_freq(spec: ModelSpec) -> Tensor:
    d = spec.head_dim
    inv = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [D/2] fp32
    rs = dict(spec.rope_scaling)
    rtype = rs.get("rope_type", "default")
    if rtype == "linear":
        inv = inv / float(rs["factor"])
    elif rtype == "llama3":
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(medium, smoothed, scaled)
    return inv


@dataclass
class Layer:
    ln1: Tensor  # [H] dtype
    wqkv: object  # prepared [(Hq+2Hkv)*D, H]: q, k, v rows fused (fixed at load, so N never varies)
    bqkv: Tensor | None  # [(Hq+2Hkv)*D] dtype (Qwen2 / attention_bias)
    q_norm: Tensor | None  # [D] dtype (Qwen3)
    k_norm: Tensor | None  # [D] dtype (Qwen3)
    wo: object  # prepared [H, Hq*D]
    ln2: Tensor  # [H] dtype
    w_gate_up: object  # prepared [2I, H]: gate rows then up rows
    w_down: object  # prepared [H, I]


class KVPool:
    """Token-slot K/V storage for all layers: k/v [L, P, Hkv, D] in the model dtype.

    A slot holds one token's K (after RoPE) and V for every layer, like SGLang's pool.
    """

    def __init__(self, spec: ModelSpec, n_tokens: int, dtype: torch.dtype, device: torch.device):
        shape = (spec.n_layers, n_tokens, spec.n_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, P, Hkv, D]
        self.v = torch.zeros(shape, dtype=dtype, device=device)  # [L, P, Hkv, D]
        self.n_tokens = n_tokens

    def column(self, slot: int) -> Tensor:
        """The K/V column stored in `slot`: [L, 2, Hkv, D] (index 0 = K after RoPE, 1 = V)."""
        return torch.stack([self.k[:, slot], self.v[:, slot]], dim=1)


@dataclass(frozen=True)
class Segment:
    """One request's rows in a batched forward."""

    row_start: int  # first row of this request in the batch
    n_rows: int  # tokens teacher-forced (positions q_start .. q_start+n_rows-1)
    q_start: int  # absolute position of the first row
    kv_indices: Tensor  # [q_start+n_rows] int64 pool slots of positions 0..q_start+n_rows-1


def fused_checkpoint(tensors: dict[str, Tensor], spec: ModelSpec) -> dict[str, Tensor]:
    """A Hugging Face checkpoint's tensors in the layout SGLang holds them (`sglang_names`): q, k, v
    rows fused in that order (and their biases), gate rows then up rows; the rest as they are."""
    out = {k: tensors[k] for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight") if k in tensors}
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if a + "o_proj.bias" in tensors:
            raise ValueError("an o_proj bias (attention_bias) is not supported by the verifier")
        out[a + "qkv_proj.weight"] = torch.cat([tensors[a + n + "_proj.weight"] for n in "qkv"])
        if a + "q_proj.bias" in tensors:
            out[a + "qkv_proj.bias"] = torch.cat([tensors[a + n + "_proj.bias"] for n in "qkv"])
        out[p + "mlp.gate_up_proj.weight"] = torch.cat([tensors[p + "mlp.gate_proj.weight"],
                                                        tensors[p + "mlp.up_proj.weight"]])
        for k in ("self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                  "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight"):
            if p + k in tensors:
                out[p + k] = tensors[p + k]
    return out


def sglang_names(spec: ModelSpec, tied: bool) -> list[str]:
    """The tensors the verifier computes on, by their names in SGLang's model (`runner.model`)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        names += [p + k for k in ("self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight",
                                  "mlp.down_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight")]
        names += [p + "self_attn.qkv_proj.bias"] if spec.family == "qwen2" else []
        names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"] if spec.family == "qwen3" else []
    return names


class VerifierModel:
    """The batch-invariant decoder over weights in SGLang's layout (`fused_checkpoint`,
    `sglang_names`). On CUDA those are SGLang's own tensors, mapped from its scheduler process
    (seam/export.py): `.to()` and `prepare_weight` return them as they are, so nothing is copied;
    the vocabulary's padding rows (SGLang pads to a multiple of 64, with zeros) are cut by a view."""

    def __init__(self, spec: ModelSpec, tensors: dict[str, Tensor], dtype: torch.dtype,
                 device: torch.device, max_positions: int, tp=None):
        # tp: verifier.tp.Ranks, `tensors` then this rank's shard (tp.shard); None: one rank
        self.spec, self.dtype, self.device, self.tp = spec, dtype, device, tp
        s = spec

        def t(name: str) -> Tensor:
            w = tensors[name]
            if w.device != device or w.dtype != dtype:
                w = w.to(device=device, dtype=dtype)
            return w

        def opt(name: str) -> Tensor | None:
            return t(name) if name in tensors else None

        # TP: the rank's whole shard, padding rows included (their count sets the rank's offset;
        # the gathered logits are cut to the vocabulary)
        vocab = s.vocab if tp is None else None
        self.heads = (s.n_heads, s.n_kv_heads) if tp is None else tp_mod.local_heads(s, tp.world)  # (q, kv)
        self.embed = t("model.embed_tokens.weight")[:vocab]  # [V, H] dtype (TP: the rank's rows)
        self.final_norm = t("model.norm.weight")  # [H] dtype
        lm = "lm_head.weight" if "lm_head.weight" in tensors and not s.tie_embeddings else "model.embed_tokens.weight"
        # Logits in fp32 (fp32 output of an fp32 accumulator): margins are not quantised to bf16
        # steps of ~0.1. The weight stays in the model dtype: an fp32 copy holds the same values
        # (twice the bytes, and no tensor cores on the GPU).
        self.lm_head = ops.prepare_weight(t(lm)[:vocab])  # [V, H] (TP: the rank's rows)
        self.layers: list[Layer] = []
        for i in range(s.n_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(Layer(
                ln1=t(p + "input_layernorm.weight"),
                wqkv=ops.prepare_weight(t(a + "qkv_proj.weight")), bqkv=opt(a + "qkv_proj.bias"),
                q_norm=opt(a + "q_norm.weight"), k_norm=opt(a + "k_norm.weight"),
                wo=ops.prepare_weight(t(a + "o_proj.weight")),
                ln2=t(p + "post_attention_layernorm.weight"),
                w_gate_up=ops.prepare_weight(t(p + "mlp.gate_up_proj.weight")),
                w_down=ops.prepare_weight(t(p + "mlp.down_proj.weight")),
            ))
        if s.family == "qwen3" and self.layers[0].q_norm is None:
            raise ValueError("qwen3 checkpoint without q_norm/k_norm weights")
        # RoPE tables [max_positions, D] fp32. cos/sin by Python's scalar libm, one call per
        # value: torch's vectorised and scalar-tail paths may differ, which would make a
        # position's bits depend on the table length (max_positions) or the device.
        inv = _inv_freq(spec).tolist()  # [D/2] fp32 values
        freqs = torch.tensor([[float(p * f) for f in inv] for p in range(max_positions)],
                             dtype=torch.float32)  # the fp32 product HF forms
        fl = freqs.to(torch.float64).flatten().tolist()
        cos = torch.tensor([math.cos(a) for a in fl], dtype=torch.float32).view(freqs.shape)
        sin = torch.tensor([math.sin(a) for a in fl], dtype=torch.float32).view(freqs.shape)
        self.cos = torch.cat([cos, cos], -1).to(device)  # [P, D] fp32
        self.sin = torch.cat([sin, sin], -1).to(device)  # [P, D] fp32
        self.max_positions = max_positions
        self.scale = 1.0 / math.sqrt(s.head_dim)

    @property
    def pool_spec(self) -> ModelSpec:
        """The spec this process's K/V pool is sized from (under TP: its rank's heads)."""
        return self.spec if self.tp is None else tp_mod.local_spec(self.spec, self.tp.world)

    @classmethod
    def load(cls, model: str | Path | Checkpoint, dtype: torch.dtype, device: torch.device | str,
             max_positions: int, tp=None) -> "VerifierModel":
        """From a checkpoint (a folder, or as the launcher read it), its tensors fused into SGLang's
        layout on the way (tp: verifier.tp.Ranks, then this rank's shard of them)."""
        from safetensors import safe_open

        ck = model if isinstance(model, Checkpoint) else read_checkpoint(model, identify=False)
        d, spec = Path(ck.path), ck.require_spec()
        files = sorted(d.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {d}")
        tensors: dict[str, Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    tensors[k] = sf.get_tensor(k)
        fused = fused_checkpoint(tensors, spec)
        if tp is not None:
            fused = tp_mod.shard(fused, spec, tp.rank, tp.world)
        return cls(spec, fused, dtype, torch.device(device), max_positions, tp=tp)

    @classmethod
    def shared(cls, spec: ModelSpec, tensors: dict[str, Tensor], dtype: torch.dtype,
               max_positions: int) -> "VerifierModel":
        """On SGLang's own tensors (seam/export.py), described by the checkpoint's spec."""
        if any(n.endswith("o_proj.bias") for n in tensors):
            raise ValueError("an o_proj bias (attention_bias) is not supported by the verifier")
        missing = [n for n in sglang_names(spec, spec.tie_embeddings) if n not in tensors]
        if missing:
            raise ValueError(f"SGLang's model holds none of {missing[:3]} ({len(missing)} missing): not the layout "
                             "the verifier computes on")
        device = tensors["model.embed_tokens.weight"].device
        return cls(spec, tensors, dtype, device, max_positions)

    @torch.inference_mode()
    def forward(self, tokens: Tensor, positions: Tensor, out_slots: Tensor, segments: list[Segment],
                pool: KVPool) -> Tensor:
        """Teacher-force `tokens` and return fp32 logits [R, V] for every row.

        tokens/positions/out_slots [R] int64 (device); each row's K/V is written to its slot
        before attention, so prefill, chunked prefill and decode read the same K/V layout.
        Attention is per request (its own causal K/V history), rows of all requests concatenated.
        """
        def attend(li: int, q: Tensor) -> Tensor:  # q [R, Hq, D] -> [R, Hq, D]
            parts = [ops.attention_paged(q[g.row_start: g.row_start + g.n_rows], pool.k[li], pool.v[li],
                                         g.kv_indices, g.q_start, self.scale) for g in segments]
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        return self._run(tokens, positions, out_slots, pool, attend)

    @torch.inference_mode()
    def forward_rows(self, tokens: Tensor, positions: Tensor, out_slots: Tensor, table_row: Tensor,
                     kv_table: Tensor, pool: KVPool, max_len: int, logits_out: Tensor | None = None) -> Tensor:
        """`forward` with every per-step size read from device tensors, so a CUDA graph of it
        serves any positions: row r attends to kv_table[table_row[r], :positions[r] + 1].

        tokens/positions/out_slots/table_row [R] int64 (device); kv_table [tables, L] int64.
        logits_out: [R, V] fp32 contiguous (CUDA), where the logits are written (graphs.py: every
        bucket's graph writes one shared buffer). Bit-equal per row to `forward` (the row-wise
        attention kernels keep each row's reduction).
        """
        def attend(li: int, q: Tensor) -> Tensor:
            return ops.attention_rows(q, pool.k[li], pool.v[li], kv_table, table_row, positions, max_len,
                                      self.scale)

        return self._run(tokens, positions, out_slots, pool, attend, logits_out)

    def _run(self, tokens: Tensor, positions: Tensor, out_slots: Tensor, pool: KVPool, attend,
             logits_out: Tensor | None = None) -> Tensor:
        s, tp = self.spec, self.tp
        r = tokens.shape[0]
        (hq, hkv), d = self.heads, s.head_dim
        if tp is None:
            residual = self.embed[tokens]  # [R, H] dtype
        else:  # each token's row from the rank holding it, zeros elsewhere: the sum is exact
            local = tokens - tp.rank * self.embed.shape[0]
            mine = (local >= 0) & (local < self.embed.shape[0])
            rows = self.embed[local.clamp(0, self.embed.shape[0] - 1)]
            residual = tp.reduce(torch.where(mine[:, None], rows, torch.zeros_like(rows)))
        reduce = (lambda x: x) if tp is None else tp.reduce  # noqa: E731 - a rank's partial sums
        m = None  # [R, H] dtype: the previous layer's MLP output, not yet added to the residual
        for li, lay in enumerate(self.layers):
            # each RMSNorm runs inside the next projection (ops.norm_matmul: one kernel on CUDA)
            if m is None:
                qkv = ops.matmul(ops.rms_norm(residual, lay.ln1, s.eps), lay.wqkv, lay.bqkv)
            else:
                qkv, residual = ops.norm_matmul(m, residual, lay.ln1, s.eps, lay.wqkv, lay.bqkv)
            # qkv [R, (Hq+2Hkv)*D] dtype
            qk = qkv[:, : (hq + hkv) * d].view(r, hq + hkv, d)  # q heads then k heads (a view)
            v = qkv[:, (hq + hkv) * d:].view(r, hkv, d)
            if lay.q_norm is not None:  # Qwen3: per-head RMSNorm over head_dim, before RoPE
                qn = ops.rms_norm(qk[:, :hq].reshape(r * hq, d), lay.q_norm, s.eps).view(r, hq, d)
                kn = ops.rms_norm(qk[:, hq:].reshape(r * hkv, d), lay.k_norm, s.eps).view(r, hkv, d)
                qk = torch.cat([qn, kn], dim=1)
            # RoPE on q and k heads, K (after RoPE) and V into the rows' slots: one fused launch
            q = ops.rope_store(qk, v, self.cos, self.sin, positions, out_slots, pool.k[li], pool.v[li], hq)
            attn = attend(li, q)  # [R, Hq, D] dtype
            o = reduce(ops.matmul(attn.reshape(r, hq * d), lay.wo))  # [R, H] dtype
            gu, residual = ops.norm_matmul(o, residual, lay.ln2, s.eps, lay.w_gate_up)  # [R, 2I] dtype
            # silu via the kernels (torch's CPU silu changes bits with the number of rows), inside
            # the down projection on CUDA
            m = reduce(ops.silu_matmul(gu, lay.w_down))  # [R, H] dtype
        h, residual = ops.add_rms_norm(m, residual, self.final_norm, s.eps)
        if tp is not None:  # (no graphs under TP yet: logits_out is the graphs')
            if logits_out is not None:
                raise ValueError("the TP verifier runs without CUDA graphs")
            return tp.gather_vocab(ops.matmul(h, self.lm_head, out_dtype=torch.float32))[:, : s.vocab]  # [R, V] fp32
        if logits_out is not None:  # CUDA only: the kernel ops.matmul runs there, writing in place
            from mg_server.verifier.kernels.matmul_triton import matmul as matmul_into

            return matmul_into(h, self.lm_head, out=logits_out)  # [R, V] fp32, the same bits
        return ops.matmul(h, self.lm_head, out_dtype=torch.float32)  # [R, V] fp32
