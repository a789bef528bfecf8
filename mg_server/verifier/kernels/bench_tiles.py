"""Benchmark (GPU): candidate bf16 matmul tile configs vs cuBLAS, per weight shape and row count.

    python -m mg_server.verifier.kernels.bench_tiles --out tiles.json [--ms 1,8,64,256,1024] [--shapes 8b]

Why this can choose a tile by M at all: every candidate runs the same reduction per output
element (K ascending in BLOCK_K = 64 steps, fp32 accumulator), so it is bit-equal to the dtype
entry's tile; the sweep checks that on each shape (`bit_equal`) before a candidate may be picked.
"table" in the output is the tile matmul() runs now (config "matmul_tiles").

Timing: each call is replayed from a CUDA graph (24 calls per replay, median of 7 replays), so
Python launch cost is out of both sides (the verifier replays graphs too), and the calls cycle
over copies of the weight so that >= 160 MB of weights pass through the 50 MB L2 per replay
(a decode step streams each layer's weights from HBM).
"""
from __future__ import annotations

import argparse
import json
import math

import torch

from .bench import SHAPES
from .config import KERNEL_CONFIG, kernel_config_id, matmul_tile, parse_tile, tile_name, tile_names


def _tile(bm: int, bn: int, warps: int, stages: int) -> dict:
    return parse_tile(f"{bm}x{bn}w{warps}s{stages}")


CANDIDATES = [_tile(64, 32, 4, 8), _tile(64, 64, 4, 6), _tile(64, 128, 4, 5), _tile(64, 128, 4, 4),
              _tile(64, 256, 4, 4), _tile(64, 256, 8, 3), _tile(128, 64, 4, 5), _tile(128, 64, 8, 5),
              _tile(128, 128, 8, 4), _tile(128, 128, 4, 4), _tile(128, 256, 8, 3), _tile(64, 128, 8, 4)]


def graph_ms(fn, weights: list, reps: int = 24, replays: int = 7) -> float:
    """Median ms per call of fn(w) replayed from one CUDA graph of `reps` calls over `weights`."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in weights[:2]:
            fn(w)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for r in range(reps):
            fn(weights[r % len(weights)])
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / reps)
    del g
    return sorted(ts)[len(ts) // 2]


def _cublas(x, w, out_dtype):
    if out_dtype is None:
        return torch.mm(x, w.t())
    try:  # cuBLAS writing fp32 from bf16 inputs (torch >= 2.8 on CUDA)
        return torch.mm(x, w.t(), out_dtype=out_dtype)
    except (TypeError, RuntimeError, NotImplementedError):
        return torch.mm(x, w.t()).to(out_dtype)


def table_tiles(n: int, k: int, out_fp32: bool) -> list[dict]:
    """The tiles config "matmul_tiles" names for this shape (every row bucket), base tile first."""
    base = KERNEL_CONFIG["matmul"]["bfloat16"]
    return [base] + [parse_tile(x) for x in dict.fromkeys(tile_names(n, k, out_fp32)) if x != tile_name(base)]


def sweep(shapes: dict, ms: list[int], candidates: list[dict] | None) -> dict:
    """candidates None: each shape's own table tiles (a check of the table as it is)."""
    from .matmul_triton import matmul_with_tile
    base = KERNEL_CONFIG["matmul"]["bfloat16"]  # version 3's one tile: the bits to equal
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows, bits = [], {}
    for name, (n, k, out_dtype) in shapes.items():
        wbytes = n * k * 2
        copies = max(1, min(8, math.ceil(160e6 / wbytes)))
        ws = [(torch.randn(n, k, generator=gen) * 0.02).to("cuda", torch.bfloat16) for _ in range(copies)]
        probe = torch.randn(max(ms), k, generator=gen).to("cuda", torch.bfloat16)
        ref_bits = matmul_with_tile(probe, ws[0], base, out_dtype=out_dtype)
        ok = {}
        cands = candidates if candidates is not None else table_tiles(n, k, out_dtype == torch.float32)
        for t in cands:
            try:
                ok[tile_name(t)] = bool(torch.equal(matmul_with_tile(probe, ws[0], t, out_dtype=out_dtype), ref_bits))
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: not a candidate
                ok[tile_name(t)] = None
                print(f"{name} {tile_name(t)}: {type(e).__name__}: {str(e)[:120]}", flush=True)
        bits[name] = ok
        for m in ms:
            x = probe[:m].contiguous()
            ref = graph_ms(lambda w: _cublas(x, w, out_dtype), ws)
            res = {}
            for t in cands:
                if ok[tile_name(t)]:
                    res[tile_name(t)] = graph_ms(lambda w: matmul_with_tile(x, w, t, out_dtype=out_dtype), ws)
            best = min(res, key=res.get)
            chosen = matmul_tile("bfloat16", m, n, k, out_dtype == torch.float32)  # what matmul() runs
            tab = res.get(tile_name(chosen)) or graph_ms(lambda w: matmul_with_tile(x, w, chosen, out_dtype=out_dtype),
                                                         ws)
            rows.append(dict(shape=name, M=m, N=n, K=k, out=str(out_dtype or torch.bfloat16), cublas_ms=ref,
                             table=tile_name(chosen), table_ms=tab, table_ratio=ref / tab, best=best, best_ms=res[best],
                             best_ratio=ref / res[best], all_ms=res))
            print(f"{name:16s} M={m:5d} cublas {ref * 1e3:8.1f} us  table {tab * 1e3:8.1f} us ({ref / tab:4.2f}x)"
                  f"  best {best:14s} {res[best] * 1e3:8.1f} us ({ref / res[best]:4.2f}x)", flush=True)
        del ws, probe
        torch.cuda.empty_cache()
    return dict(rows=rows, bit_equal=bits)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--ms", default="1,8,16,32,64,128,256,512,1024")
    ap.add_argument("--shapes", default="", help="comma-separated name prefixes, e.g. 8b.qkv,8b.o")
    ap.add_argument("--candidates", default="",
                    help="tile names (default: CANDIDATES), e.g. 64x64w4s6,128x32w4s6; "
                         "'table': each shape's own table tiles")
    a = ap.parse_args(argv)
    prefixes = tuple(a.shapes.split(","))
    shapes = {k: (n, kk, None) for k, (n, kk) in SHAPES.items()}
    for k in [s for s in SHAPES if s.endswith("lm_head")]:  # the verifier's lm_head writes fp32
        shapes[k + "_f32"] = (*SHAPES[k], torch.float32)
    shapes = {k: v for k, v in shapes.items() if k.startswith(prefixes)}
    cands = (None if a.candidates == "table" else [parse_tile(n) for n in a.candidates.split(",")]
             if a.candidates else CANDIDATES)
    res = dict(config_id=kernel_config_id("cuda"), base_tile=KERNEL_CONFIG["matmul"]["bfloat16"],
               device_name=torch.cuda.get_device_name(), torch=torch.__version__,
               candidates=[tile_name(t) for t in cands] if cands is not None else "table",
               **sweep(shapes, [int(m) for m in a.ms.split(",")], cands))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
