"""Benchmark: invariant kernels vs torch reference.

    python -m mg_server.verifier.kernels.bench --out bench.json [--device cuda|cpu] [--variants]

GPU: matmul vs torch.mm (cuBLAS) on SmolLM2-135M and Llama-3.1-8B projection shapes, bf16,
M in {1,8,32,64,256,1024}; attention decode (T=1) and prefill (a 512-token chunk ending at the
KV length, i.e. q_start = L-512) vs scaled_dot_product_attention (causal, GQA) at L in
{512, 4096, 32768}, Llama-8B heads (32 q / 8 kv, D=128).
CPU: the same tables, smaller, plus ms per verifier decode step of a SmolLM2-135M-shaped model.
`--variants` also times other matmul tile configs (timing only: a different config is a
different reduction order, so it would get a different kernel_config_id).
"""
from __future__ import annotations

import argparse
import copy
import json
import time

import torch

from . import KERNEL_CONFIG, kernel_config_id
from . import matmul, prepare_weight, add_rms_norm, silu_mul, attention
from . import top2, log_softmax

SHAPES = {  # name: (N, K) for y = x @ W.T, W [N, K]
    "135m.qkv": (960, 576), "135m.o": (576, 576), "135m.gate_up": (3072, 576),
    "135m.down": (576, 1536), "135m.lm_head": (49152, 576),
    "8b.qkv": (6144, 4096), "8b.o": (4096, 4096), "8b.gate_up": (28672, 4096),
    "8b.down": (4096, 14336), "8b.lm_head": (128256, 4096),
}


def _time(fn, device: str, reps: int) -> float:
    """Median milliseconds."""
    if device == "cuda":
        from triton.testing import do_bench
        return float(do_bench(fn, warmup=10, rep=max(20, reps * 5), return_mode="median"))
    fn()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts) // 2] * 1e3


def bench_matmul(device, ms, shapes, reps):
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
        pw = prepare_weight(w)
        for m in ms:
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            ours = _time(lambda: matmul(x, pw), device, reps)
            ref = _time(lambda: torch.mm(x, w.t()), device, reps)
            fl = 2.0 * m * n * k
            byt = 2.0 * (m * k + n * k + m * n)
            rows.append(dict(shape=name, M=m, N=n, K=k, ours_ms=ours, ref_ms=ref,
                             ratio=ref / ours, ours_tflops=fl / ours / 1e9,
                             ref_tflops=fl / ref / 1e9, ours_gbps=byt / ours / 1e6,
                             intensity=fl / byt))
            print(f"{name:14s} M={m:5d} ours {ours:8.3f} ms  ref {ref:8.3f} ms  "
                  f"speed ratio {ref / ours:5.2f}  ours {fl / ours / 1e9:7.1f} TF/s "
                  f"{byt / ours / 1e6:7.0f} GB/s", flush=True)
        del w, pw
    return rows


def bench_attention(device, lengths, reps, hq=32, hkv=8, d=128, chunk=512):
    import torch.nn.functional as F
    rows = []
    dt = torch.bfloat16
    for L in lengths:
        k = torch.randn(L, hkv, d, device=device, dtype=dt)
        v = torch.randn(L, hkv, d, device=device, dtype=dt)
        for mode, T in (("decode", 1), ("prefill", min(chunk, L))):
            q = torch.randn(T, hq, d, device=device, dtype=dt)
            ours = _time(lambda: attention(q, k, v, L - T), device, reps)
            qt, kt, vt = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
            if T == L:
                ref_fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True,
                                                                enable_gqa=True)
            elif T == 1:
                ref_fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
            else:
                from torch.nn.attention.bias import causal_lower_right
                bias = causal_lower_right(T, L)
                ref_fn = lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=bias,
                                                                enable_gqa=True)
            try:
                ref = _time(ref_fn, device, reps)
            except Exception as e:  # pragma: no cover
                print("sdpa failed:", e)
                ref = float("nan")
            rows.append(dict(mode=mode, L=L, T=T, ours_ms=ours, ref_ms=ref, ratio=ref / ours))
            print(f"attn {mode:8s} L={L:6d} T={T:4d} ours {ours:8.3f} ms  sdpa {ref:8.3f} ms  "
                  f"speed ratio {ref / ours:5.2f}", flush=True)
    return rows


def decode_step_135m(device, kv_len=512, reps=10, dtype=torch.bfloat16):
    """ms per verifier decode step (batch 1) of a SmolLM2-135M-shaped stack (random weights;
    RoPE and embedding lookup omitted: element-wise / gather, negligible)."""
    h, hq, hkv, d, inter, layers, vocab = 576, 9, 3, 64, 1536, 30, 49152
    g = torch.Generator(device="cpu").manual_seed(0)

    def W(n, k):
        return prepare_weight((torch.randn(n, k, generator=g) * 0.02).to(device, dtype))
    lay = [dict(qkv=W(hq * d + 2 * hkv * d, h), o=W(h, hq * d), gu=W(2 * inter, h),
                down=W(h, inter), n1=torch.ones(h, device=device, dtype=dtype),
                n2=torch.ones(h, device=device, dtype=dtype),
                kc=torch.randn(kv_len + 1, hkv, d, device=device, dtype=dtype),
                vc=torch.randn(kv_len + 1, hkv, d, device=device, dtype=dtype))
           for _ in range(layers)]
    lm = W(vocab, h)
    nf = torch.ones(h, device=device, dtype=dtype)
    x0 = torch.randn(1, h, device=device, dtype=dtype)

    def step():
        x, res = x0, torch.zeros_like(x0)
        for L in lay:
            hN, res = add_rms_norm(x, res, L["n1"], 1e-5)
            qkv = matmul(hN, L["qkv"])
            q = qkv[:, : hq * d].view(1, hq, d)
            L["kc"][kv_len] = qkv[0, hq * d: hq * d + hkv * d].view(hkv, d)
            L["vc"][kv_len] = qkv[0, hq * d + hkv * d:].view(hkv, d)
            a = attention(q, L["kc"], L["vc"], kv_len).view(1, hq * d)
            x = matmul(a, L["o"])
            hN, res = add_rms_norm(x, res, L["n2"], 1e-5)
            gu = matmul(hN, L["gu"])
            x = matmul(silu_mul(gu[:, :inter], gu[:, inter:]), L["down"])
        hN, _ = add_rms_norm(x, res, nf, 1e-5)
        logits = matmul(hN, lm)
        return top2(logits), log_softmax(logits)
    if device == "cuda":
        torch.cuda.synchronize()
    ms = _time(step, device, reps)
    print(f"135M-shaped decode step ({device}, {dtype}, kv_len={kv_len}, "
          f"threads={torch.get_num_threads()}): {ms:.1f} ms", flush=True)
    return dict(kv_len=kv_len, ms=ms, dtype=str(dtype), threads=torch.get_num_threads())


VARIANTS = [  # timing-only alternatives for the bf16 matmul tile table
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 5,
     "tma": True},
    {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 5},
    {"BLOCK_M": 64, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 4,
     "tma": True},
    {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 5,
     "tma": True},
    # narrow column tiles: more programs for the few-column-tile shapes (8B qkv / o / down)
    {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 6,
     "tma": True},
    {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 8,
     "tma": True},
]


def _bits_vs_table(device):
    """Is a variant's output bit-equal to the table config's?  (Tells whether tile shape alone,
    at fixed K order, changes bits on this GPU.)"""
    g = torch.Generator(device="cpu").manual_seed(0)
    out = {}
    for k in (4096, 14336):
        x = torch.randn(1024, k, generator=g).to(device, torch.bfloat16)
        w = (torch.randn(4096, k, generator=g) * 0.02).to(device, torch.bfloat16)
        out[k] = (x, w)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--splitk", action="store_true",
                    help="GPU: time the 8B split-K shapes at other split sizes and without split-K")
    ap.add_argument("--quick", action="store_true", help="CPU: fewer shapes")
    ap.add_argument("--threads", type=int, default=0, help="CPU: torch.set_num_threads")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dev = a.device
    res = dict(device=dev, config_id=kernel_config_id(dev), config=KERNEL_CONFIG,
               torch=torch.__version__, threads=torch.get_num_threads(),
               device_name=torch.cuda.get_device_name() if dev == "cuda" else "cpu")
    if dev == "cuda":
        res["matmul"] = bench_matmul(dev, [1, 8, 32, 64, 256, 1024], SHAPES, 10)
        res["attention"] = bench_attention(dev, [512, 4096, 32768], 10)
        res["decode_step_135m"] = decode_step_135m(dev, 512, 20)
        if a.variants:
            base = copy.deepcopy(KERNEL_CONFIG["matmul"]["bfloat16"])
            probe = _bits_vs_table(dev)
            ref_out = {k: matmul(x, w) for k, (x, w) in probe.items()}
            res["variants"] = []
            for var in VARIANTS:
                KERNEL_CONFIG["matmul"]["bfloat16"] = var
                print("variant", var, flush=True)
                try:
                    eq = {k: bool(torch.equal(matmul(x, w), ref_out[k]))
                          for k, (x, w) in probe.items()}
                    print("  bit-equal to table config (K=4096, K=14336):", eq, flush=True)
                    rows = bench_matmul(dev, [1, 8, 32, 64, 256, 1024],
                                        {k: v for k, v in SHAPES.items() if k.startswith("8b")},
                                        10)
                    res["variants"].append(dict(config=var, rows=rows, bit_equal=eq))
                except Exception as e:  # pragma: no cover
                    res["variants"].append(dict(config=var, error=repr(e)))
            KERNEL_CONFIG["matmul"]["bfloat16"] = base
        if a.splitk:  # timing only: another split size is another reduction order
            base = dict(KERNEL_CONFIG["matmul_splitk"])
            shapes = {k: SHAPES[k] for k in ("8b.qkv", "8b.o", "8b.down")}
            res["splitk"] = []
            for ks, tiles in ((512, 32), (1024, 32), (2048, 32), (512, 0)):  # max_n_tiles 0: no split-K
                KERNEL_CONFIG["matmul_splitk"].update(K_SPLIT=ks, max_n_tiles=tiles)
                res["splitk"].append(dict(K_SPLIT=ks if tiles else None,
                                          rows=bench_matmul(dev, [1, 8, 32, 64, 256, 1024], shapes, 10)))
            KERNEL_CONFIG["matmul_splitk"].update(base)
    else:
        shapes = {k: v for k, v in SHAPES.items() if k.startswith("135m")}
        if not a.quick:
            shapes["8b.o"] = SHAPES["8b.o"]
        res["matmul"] = bench_matmul(dev, [1, 8, 64] if a.quick else [1, 8, 32, 64, 256],
                                     shapes, 5)
        res["attention"] = bench_attention(dev, [512, 4096], 3, hq=9, hkv=3, d=64, chunk=128)
        res["decode_step_135m"] = [decode_step_135m(dev, 512, 5)]
        if not a.quick:
            res["decode_step_135m"].append(decode_step_135m(dev, 2048, 5))
            res["decode_step_135m"].append(decode_step_135m(dev, 512, 5, torch.float32))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return res


if __name__ == "__main__":
    main()
