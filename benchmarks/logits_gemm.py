"""The fast path's LM head GEMM with bf16 and with fp32 output, as SGLang runs each (CUDA).

    python benchmarks/logits_gemm.py OUT.json [--rows 1,8,32,64] [--iters 50]

mg serves SGLang with `--enable-fp32-lm-head`, which on CUDA makes the LM head one bf16 GEMM
with an fp32 output, `torch.mm(h, W.T, out_dtype=float32, out=buf)`, where the default writes
bf16 logits that SGLang then casts into its fp32 logits buffer (its own Triton cast where the
installed SGLang has one, else `copy_`). Times the bf16 GEMM alone, with the cast, and the
fp32-output GEMM, per model shape and row count, `--iters` calls captured in one CUDA graph
(launch cost left out), median of 5 replays; random weights, the SmolLM2-135M and Llama-3-8B
LM heads.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch

SHAPES = {"smollm2-135m": (576, 49152), "llama-8b": (4096, 128256)}  # (hidden, vocab)


def bf16_to_fp32():
    """SGLang's cast of bf16 logits into its fp32 buffer (0.5.23), else torch's copy_."""
    try:
        from sglang.kernels.ops.activation.softcap import cast_to_float32_logits
        return "sglang", cast_to_float32_logits
    except ImportError:
        return "copy_", lambda x, out: out.copy_(x)


def graph_us(fn, iters: int) -> float:
    """Median µs per call of `fn`, `iters` calls captured in one CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()  # warm-up: cuBLAS picks and loads its kernel before capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(iters):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / iters)
    return statistics.median(times)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cast_name, cast = bf16_to_fp32()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "iters": args.iters,
           "bf16_cast": cast_name, "cases": []}
    for name, (hidden, vocab) in SHAPES.items():
        w = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) * hidden ** -0.5  # [V, H] bf16
        for m in (int(x) for x in args.rows.split(",")):
            h = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)  # [m, H] bf16, the final norm's output
            buf = torch.empty(m, vocab, device="cuda", dtype=torch.float32)  # SGLang's fp32 logits buffer
            gemm = graph_us(lambda: torch.matmul(h, w.T), args.iters)
            bf16 = graph_us(lambda: cast(torch.matmul(h, w.T), buf), args.iters)
            fp32 = graph_us(lambda: torch.mm(h, w.T, out_dtype=torch.float32, out=buf), args.iters)
            row = {"model": name, "rows": m, "bf16_gemm_us": round(gemm, 2), "bf16_gemm_cast_us": round(bf16, 2),
                   "fp32_gemm_us": round(fp32, 2), "fp32_over_bf16_cast": round(fp32 / bf16, 3)}
            res["cases"].append(row)
            print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
