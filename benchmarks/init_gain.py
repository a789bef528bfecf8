"""How far a random Llama's logits move under rounding-sized noise, per init gain (CPU, minutes).

Why: gpu_e2e.py's benchmark models have random weights. At N(0, 0.02) the SmolLM2 shape (hidden
576) gives each matmul a gain of std * sqrt(fan_in) = 0.48, but the Llama-3-8B shape (hidden
4096) gets 1.28: over 32 layers a perturbation then grows to the size of a typical top-1/top-2
margin, so fast-path/verifier flips are no longer near-ties (the H100 8B sweep: 6 % of steps
repaired, 84 missed flips completed by the verifier; SmolLM2: 0.8 %, none). MarginGate's premise,
and real LLMs' behaviour in its paper, is flips at near-ties.

This proxy keeps the per-matmul gain and depth of a shape at width 1024 (a 32-layer model that
fits a CPU), perturbs every attention output by one bf16 ulp of relative noise, and reports how
many argmaxes flip and at which margins, against the margins' median.

    python benchmarks/init_gain.py --gains 1.28,0.48 --out init_gain.json
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

H, INTER, VOCAB, HEADS, KV = 1024, 3584, 32000, 8, 2  # width 1024; the 8B's 3.5x MLP and 4:1 GQA
D = H // HEADS


def weights(gain: float, layers: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    std = gain / math.sqrt(H)  # every matrix N(0, std): a matmul's gain is std * sqrt(H)

    def r(*s):
        return (torch.randn(*s, generator=gen) * std).to(torch.bfloat16)

    return {"emb": r(VOCAB, H), "head": r(VOCAB, H),
            "layers": [{"q": r(H, H), "k": r(KV * D, H), "v": r(KV * D, H), "o": r(H, H),
                        "g": r(INTER, H), "u": r(INTER, H), "d": r(H, INTER)} for _ in range(layers)]}


def rms(x):
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype)


def rope(x, pos):
    half = D // 2
    ang = pos[:, None].float() * (1.0 / (500000 ** (torch.arange(half, dtype=torch.float32) / half)))[None]
    c, s = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1).to(x.dtype)


def forward(w: dict, ids, noise: float, gen) -> torch.Tensor:
    """bf16 Llama forward of one sequence -> [T, V] fp32 logits; noise: relative, on every
    attention output (one bf16 ulp is 2**-8)."""
    t = len(ids)
    pos = torch.arange(t)
    mask = torch.full((t, t), float("-inf")).triu(1)
    h = w["emb"][ids]
    for lw in w["layers"]:
        x = rms(h)
        q = rope((x @ lw["q"].T).view(t, HEADS, D), pos).transpose(0, 1).float()
        k = rope((x @ lw["k"].T).view(t, KV, D), pos).repeat_interleave(HEADS // KV, 1).transpose(0, 1).float()
        v = (x @ lw["v"].T).view(t, KV, D).repeat_interleave(HEADS // KV, 1).transpose(0, 1)
        att = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(D) + mask, -1).to(torch.bfloat16)
        o = (att @ v).transpose(0, 1).reshape(t, H) @ lw["o"].T
        if noise:
            o = (o.float() * (1 + noise * torch.randn(o.shape, generator=gen))).to(torch.bfloat16)
        h = h + o
        x = rms(h)
        h = h + (torch.nn.functional.silu(x @ lw["g"].T) * (x @ lw["u"].T)) @ lw["d"].T
    return rms(h).float() @ w["head"].float().T


def measure(gain: float, layers: int, prompts: int, tokens: int, seed: int) -> dict:
    w = weights(gain, layers, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    margins, flips, moved = [], [], []
    for _ in range(prompts):
        ids = torch.randint(0, VOCAB, (tokens,), generator=gen)
        a, b = forward(w, ids, 0.0, gen), forward(w, ids, 2 ** -8, gen)
        top = a.topk(2, -1).values
        margins.append(top[:, 0] - top[:, 1])
        flips.append(a.argmax(-1) != b.argmax(-1))
        moved.append((a - b).abs().max(-1).values)
    m, f, d = torch.cat(margins), torch.cat(flips), torch.cat(moved)
    return {"gain": gain, "layers": layers, "positions": len(m), "median_margin": float(m.median()),
            "median_max_logit_move": float(d.median()), "flips": int(f.sum()),
            "flip_rate": float(f.float().mean()), "flips_above_median_margin": int((f & (m > m.median())).sum()),
            "flip_margins": sorted(float(x) for x in m[f])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gains", default="1.28,0.48")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("init_gain.json"))
    args = ap.parse_args()
    rows = []
    print(f"{'gain':>5} {'median margin':>14} {'median max |dlogit|':>20} {'flips':>12} {'largest flip margin':>20}")
    for g in (float(x) for x in args.gains.split(",")):
        r = measure(g, args.layers, args.prompts, args.tokens, args.seed)
        rows.append(r)
        print(f"{g:5.2f} {r['median_margin']:14.4f} {r['median_max_logit_move']:20.4f} "
              f"{r['flips']:5d} ({100 * r['flip_rate']:4.1f} %) {max(r['flip_margins'], default=0.0):20.4f}", flush=True)
    args.out.write_text(json.dumps({"width": H, "noise": "2**-8 relative on every attention output",
                                    "results": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
