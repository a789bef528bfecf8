"""Benchmark (GPU): the fused prologue matmuls (fused_triton) against the two ops they replace.

    python -m mg_server.verifier.kernels.bench_fused --out fused.json [--ms 1,8,17,32,64] [--shapes 135m,8b]

Per weight shape the verifier fuses (qkv and gate_up after an RMSNorm, down after SiLU*up) and
row count: ms per call of the unfused pair (triton_ops' norm / silu_mul, then matmul), of the
fused kernel with pointer loads of the weight and with TMA loads, each replayed from a CUDA graph
(bench_tiles.graph_ms: weights cycled through L2 as a decode step streams them); and whether the
variants' outputs are bit-equal to each other. Prints a table, writes JSON.
"""
from __future__ import annotations

import argparse
import json

import torch

from . import fused_triton as F
from . import matmul_triton as MM
from . import triton_ops as T
from .bench_tiles import graph_ms
from .config import kernel_config_id

SHAPES = {  # name -> (N, K, prologue)
    "135m.qkv": (960, 576, "norm"), "135m.gate_up": (3072, 576, "norm"), "135m.down": (576, 1536, "silu"),
    "8b.qkv": (6144, 4096, "norm"), "8b.gate_up": (28672, 4096, "norm"), "8b.down": (4096, 14336, "silu"),
}


def bench_shape(n: int, k: int, kind: str, m: int) -> dict:
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    copies = max(2, (160 << 20) // (n * k * 2) + 1)  # >= 160 MB of weights per replay (bench_tiles)
    ws = [(torch.randn(n, k, generator=g) * 0.05).to(dev, dt) for _ in range(min(copies, 24))]
    if kind == "norm":
        x, r = (torch.randn(m, k, generator=g).to(dev, dt) for _ in range(2))
        gn = torch.randn(k, generator=g).to(dev, dt)
        fns = {"unfused": lambda w: MM.matmul(T.add_rms_norm(x, r, gn, 1e-5)[0], w),
               "fused_ptr": lambda w: F.norm_matmul(x, r, gn, 1e-5, w, tma=False)[0],
               "fused_tma": lambda w: F.norm_matmul(x, r, gn, 1e-5, w, tma=True)[0]}
    else:
        gu = torch.randn(m, 2 * k, generator=g).to(dev, dt)
        fns = {"unfused": lambda w: MM.matmul(T.silu_mul(gu[:, :k], gu[:, k:]), w),
               "fused_ptr": lambda w: F.silu_matmul(gu, w, tma=False),
               "fused_tma": lambda w: F.silu_matmul(gu, w, tma=True)}
    outs = {name: fn(ws[0]) for name, fn in fns.items()}
    res = {f"{name}_ms": graph_ms(fn, ws) for name, fn in fns.items()}
    res["ptr_eq_tma"] = bool(torch.equal(outs["fused_ptr"], outs["fused_tma"]))
    res["fused_eq_unfused"] = bool(torch.equal(outs["fused_tma"], outs["unfused"]))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_fused.json")
    ap.add_argument("--ms", default="1,8,17,32,64")
    ap.add_argument("--shapes", default="135m", help="comma list of prefixes: 135m, 8b")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    res = {"device": torch.cuda.get_device_name(), "kernel_config_id": kernel_config_id("cuda"), "shapes": {}}
    print(f"{'shape':14s} {'M':>4s} {'unfused':>9s} {'fused ptr':>10s} {'fused tma':>10s}  ptr==tma fused==unfused")
    for name, (n, k, kind) in SHAPES.items():
        if not any(name.startswith(p) for p in args.shapes.split(",")):
            continue
        for m in ms:
            r = res["shapes"].setdefault(name, {})[m] = bench_shape(n, k, kind, m)
            print(f"{name:14s} {m:4d} {r['unfused_ms'] * 1e3:8.1f}u {r['fused_ptr_ms'] * 1e3:9.1f}u "
                  f"{r['fused_tma_ms'] * 1e3:9.1f}u  {r['ptr_eq_tma']!s:8s} {r['fused_eq_unfused']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
