"""The verifier's prefill of long prompts on a GPU: rows a second, where the time goes by kernel
class, against a plain torch forward of the same shape (cuBLAS projections, SDPA's causal
attention, one shot; a floor, roughly what the fast path computes for the same prompt).

    python benchmarks/prefill.py --out P.json [--model llama-8b] [--lengths 1250,8000]
        [--seq-limits 8192,131072] [--rows 4096] [--reps 3]

A prompt goes in verify calls of `--rows` rows, as the controller's catch-up sends it on a GPU
(`catchup_chunk` x 16 rows); the engine replays its CUDA graphs over them (at most the largest
bucket a replay). `--seq-limits` is the engine's sequence limit (a server's: the model's context):
the attention kernels size their partials by it. Random weights made on the device.
"""
from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from verifier import MODELS, _kernel_class, _timed, random_tensors  # benchmarks/verifier.py

from mg_server.verifier.engine import VerifierEngine
from mg_server.verifier.model import ModelSpec, VerifierModel, fused_checkpoint
from mg_server.wire.protocol import VerifyItem


def _prefill(engine: VerifierEngine, prompt: list[int], rows: int) -> None:
    engine.release("p")
    engine.drop_cache()  # a cold prompt: nothing mapped from the prefix cache
    for a in range(0, len(prompt), rows):
        b = min(len(prompt), a + rows)
        engine.step([VerifyItem(rid="p", pos=b - 1, tokens=prompt[a:b])])
    torch.cuda.synchronize()


def _by_class(fn) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
    by: dict[str, float] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            c = _kernel_class(e.name)
            c = "attention" if c.startswith("attention") else c
            by[c] = by.get(c, 0.0) + e.device_time_total / 1e3
    return {k: round(v, 2) for k, v in sorted(by.items(), key=lambda x: -x[1])}


def torch_forward(model: VerifierModel, n: int, reps: int) -> float:
    """Seconds for a one-shot bf16 prefill of n tokens in plain torch on the model's weights."""
    s = model.spec
    hq, hkv, d = s.n_heads, s.n_kv_heads, s.head_dim
    x0 = torch.randn(n, s.hidden, device="cuda", dtype=torch.bfloat16)

    def run():
        x = x0
        for lay in model.layers:
            h = F.rms_norm(x, (s.hidden,), lay.ln1, s.eps)
            qkv = F.linear(h, lay.wqkv)
            q = qkv[:, : hq * d].view(1, n, hq, d).transpose(1, 2)  # [1, Hq, n, D]: SDPA's flash kernel
            k = qkv[:, hq * d: (hq + hkv) * d].view(1, n, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
            v = qkv[:, (hq + hkv) * d:].view(1, n, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + F.linear(a.transpose(1, 2).reshape(n, hq * d), lay.wo)
            gu = F.linear(F.rms_norm(x, (s.hidden,), lay.ln2, s.eps), lay.w_gate_up)
            g, u = gu.chunk(2, dim=-1)
            x = x + F.linear(F.silu(g) * u, lay.w_down)
        F.linear(x[-1:], model.lm_head)
        torch.cuda.synchronize()

    with torch.inference_mode():
        return _timed(run, torch.device("cuda"), reps) / 1e3


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="prefill.py")
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama-8b", choices=sorted(MODELS))
    ap.add_argument("--lengths", default="1250,8000")
    ap.add_argument("--seq-limits", default="8192,131072")
    ap.add_argument("--rows", type=int, default=4096, help="rows per verify call (the controller's on a GPU)")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    lengths = [int(x) for x in a.lengths.split(",")]
    cfg = MODELS[a.model]
    spec = ModelSpec.from_hf_config(cfg)
    tensors = fused_checkpoint(random_tensors(cfg, "cuda", torch.bfloat16), spec)
    prompt = torch.randint(0, spec.vocab, (max(lengths),), generator=torch.Generator().manual_seed(1)).tolist()
    out: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": a.model,
                 "rows_per_call": a.rows, "cases": []}
    model = None
    for limit in (int(x) for x in a.seq_limits.split(",")):
        model = VerifierModel(spec, tensors, torch.bfloat16, torch.device("cuda"), max_positions=limit)
        t0 = time.perf_counter()
        engine = VerifierEngine(model, max_requests=4, pool_tokens=max(lengths) + 256, max_seq_len=limit)
        capture_s = time.perf_counter() - t0
        for n in lengths:
            run = functools.partial(_prefill, engine, prompt[:n], a.rows)
            sec = _timed(run, torch.device("cuda"), a.reps) / 1e3
            prof = _by_class(run)
            case = dict(seq_limit=limit, tokens=n, ms=round(sec * 1e3, 1), rows_per_s=round(n / sec),
                        graph_capture_s=round(capture_s, 1), kernel_ms=prof)
            out["cases"].append(case)
            print(json.dumps(case), flush=True)
        engine = None  # (its pool and graphs freed before the next limit's)
        torch.cuda.empty_cache()
    for n in lengths:
        sec = torch_forward(model, n, a.reps)
        out.setdefault("torch_one_shot", {})[n] = dict(ms=round(sec * 1e3, 1), rows_per_s=round(n / sec))
        print(f"torch one-shot {n}: {sec * 1e3:.1f} ms", flush=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
