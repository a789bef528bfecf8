"""How much of a verify call hides beside SGLang's forward on another stream of one process?

    python benchmarks/stream_share.py --out DIR [--variants base,conn32,green32,...]

In the scheduler placement (`serve --mg-verifier-in scheduler`) the verifier's CUDA graph runs on
a stream of its own beside SGLang's decode graph. At bs 8 on this host SGLang's step keeps the GPU
busy with a chain of small kernels (README, "Where performance stands"), each using a few of the
132 SMs, so the verifier's kernels could run in the SMs left free; measured in serving, the step
still grows by ~80 % of the verifier's GPU time. This script takes SGLang and the sockets out:

- load A: one CUDA graph of a SmolLM2-shaped decode step at bs 8 written with torch's ops the way
  this host's SGLang runs it (no sgl_kernel: native RMSNorm, RoPE, SiLU; cuBLAS linears; SDPA),
  replayed back to back on stream SA, like SGLang's forward stream;
- load B: mg's verifier graph (random SmolLM2 weights, 16 rows: a catch-up call at bs 8), replayed
  on stream SB after a fixed 61 % of A's replays (the verify calls per forward measured at bs 8).

Per variant (a fresh process each, since some are environment variables read at CUDA's start):
A alone, B alone, and both, with how much longer A took beside B and what share of B's GPU time
hid. Variants: `base`; `conn1` / `conn32` (CUDA_DEVICE_MAX_CONNECTIONS: hardware queues that
streams share; 1 forces one queue); `prio` (SA at the highest priority); `greenN` (B's stream
in a green context of N SMs, torch.cuda.green_contexts). JSON and a table in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PATTERN = [i * 61 // 100 != (i + 1) * 61 // 100 for i in range(100)]  # 61 of every 100 forwards


def _load_a(torch, dev, bs: int = 8, ctx: int = 512):
    """A SmolLM2-shaped decode step at batch `bs` in torch ops, and its static input."""
    import torch.nn.functional as F

    h, inter, layers, hq, hkv, d, vocab = 576, 1536, 30, 9, 3, 64, 49152
    g = torch.Generator(device=dev).manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, device=dev, generator=g) * shape[-1] ** -0.5).to(torch.bfloat16)

    ws = [dict(ln1=torch.ones(h, device=dev, dtype=torch.bfloat16), qkv=w((hq + 2 * hkv) * d, h), o=w(h, hq * d),
               ln2=torch.ones(h, device=dev, dtype=torch.bfloat16), gu=w(2 * inter, h), down=w(h, inter),
               k=torch.randn(bs, hq, ctx, d, device=dev, generator=g).to(torch.bfloat16),
               v=torch.randn(bs, hq, ctx, d, device=dev, generator=g).to(torch.bfloat16)) for _ in range(layers)]
    lm = w(vocab, h)
    cos = torch.randn(bs, d, device=dev, generator=g)
    sin = torch.randn(bs, d, device=dev, generator=g)
    x0 = torch.randn(bs, h, device=dev, generator=g).to(torch.bfloat16)

    def norm(x, wt):  # SGLang's RMSNorm.forward_native
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)
        return xf.to(x.dtype) * wt

    def rope(t):  # rotate-half RoPE in torch ops
        t1, t2 = t[..., : d // 2], t[..., d // 2:]
        return (t.float() * cos[:, None] + torch.cat([-t2, t1], -1).float() * sin[:, None]).to(t.dtype)

    def step():
        x = x0
        for lw in ws:
            res = x
            qkv = F.linear(norm(x, lw["ln1"]), lw["qkv"])
            q = rope(qkv[:, : hq * d].view(bs, hq, d))
            k = rope(qkv[:, hq * d: (hq + hkv) * d].view(bs, hkv, d))
            lw["k"][:, : hkv, -1] = k  # the new column into the cache (as the pool write)
            lw["v"][:, : hkv, -1] = qkv[:, (hq + hkv) * d:].view(bs, hkv, d)
            att = F.scaled_dot_product_attention(q[:, :, None], lw["k"], lw["v"])
            x = res + F.linear(att.reshape(bs, hq * d), lw["o"])
            res = x
            gu = F.linear(norm(x, lw["ln2"]), lw["gu"])
            x = res + F.linear(F.silu(gu[:, :inter]) * gu[:, inter:], lw["down"])
        return torch.argmax(F.linear(norm(x, ws[0]["ln1"]), lm).float(), -1)

    return step


def _load_b(torch, dev, rows: int):
    """mg's verifier graphs (random SmolLM2 weights) with one request prefilled; -> replay fn."""
    from mg_server.runtime.protocol import VerifyItem
    from mg_server.runtime.verifier.bench import SHAPES, random_tensors
    from mg_server.runtime.verifier.engine import VerifierEngine
    from mg_server.runtime.verifier.graphs import BUCKETS
    from mg_server.runtime.verifier.model import ModelSpec, VerifierModel

    cfg = SHAPES["smollm2-135m"]
    model = VerifierModel(ModelSpec.from_hf_config(cfg), random_tensors(cfg, str(dev), torch.bfloat16),
                          torch.bfloat16, dev, 2048)
    eng = VerifierEngine(model, max_requests=4, pool_tokens=4 * 1024, max_seq_len=1024)
    eng.step([VerifyItem(rid="r", pos=511, tokens=list(range(1, 513)))])
    g = eng.graphs
    b = next(x for x in BUCKETS if x >= rows)
    st = eng.seqs["r"]
    slots = st.slots[-rows:]
    g._fill([list(range(5, 5 + rows)), list(range(512 - rows, 512)), slots, [st.table_row] * rows])
    graph = g.graphs[b][0]
    return graph, g


def measure(variant: str, reps: int, rows: int) -> dict:
    import torch

    dev = torch.device("cuda", 0)
    torch.cuda.init()
    out: dict = {"variant": variant, "env": {k: v for k, v in os.environ.items() if k.startswith("CUDA_DEVICE")}}
    prio_hi = torch.cuda.Stream.priority_range()[1] if hasattr(torch.cuda.Stream, "priority_range") else -1
    sa = torch.cuda.Stream(dev, priority=prio_hi if variant == "prio" else 0)
    sb = torch.cuda.Stream(dev)
    if variant.startswith("green"):
        from torch.cuda import green_contexts as gcm
        n = int(variant[5:])
        try:
            ctx = gcm.GreenContext.create(num_sms=n, device_id=0)
        except TypeError:
            ctx = gcm.GreenContext.create(n, 0)
        if hasattr(ctx, "Stream"):
            sb = ctx.Stream()
        else:  # older API: a stream made while the green context is current belongs to it
            ctx.set_context()
            sb = torch.cuda.Stream(dev)
            ctx.pop_context()
        out["green_api"] = [a for a in dir(ctx) if not a.startswith("_")]
    step = _load_a(torch, dev)
    with torch.cuda.stream(sa):
        step()
        torch.cuda.synchronize()
        ga = torch.cuda.CUDAGraph()
        with torch.cuda.graph(ga, stream=sa):
            step()
    if variant.startswith("green") and hasattr(ctx, "set_context"):
        ctx.set_context()  # B's engine, warm-up and capture streams are made inside the green context
    with torch.cuda.stream(sb):
        gb, rg = _load_b(torch, dev, rows)
    if variant.startswith("green") and hasattr(ctx, "pop_context"):
        ctx.pop_context()
    torch.cuda.synchronize()

    def run(a: bool, b: bool) -> tuple[float, float]:
        ev0, ea, eb = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        ev0.record(sa)
        sb.wait_event(ev0)
        for i in range(reps):
            if a:
                with torch.cuda.stream(sa):
                    ga.replay()
            if b and PATTERN[i % 100]:
                with torch.cuda.stream(sb):
                    gb.replay()
        ea.record(sa)
        eb.record(sb)
        torch.cuda.synchronize()
        return ev0.elapsed_time(ea), ev0.elapsed_time(eb)

    run(True, True)  # warm-up
    a_alone = min(run(True, False)[0] for _ in range(3))
    b_alone = min(run(False, True)[1] for _ in range(3))
    both = [run(True, True) for _ in range(3)]
    a_both = min(x[0] for x in both)
    end_both = min(max(x) for x in both)
    nb = sum(PATTERN[i % 100] for i in range(reps))
    out.update(reps=reps, b_calls=nb, rows=rows, a_ms=a_alone / reps, b_ms=b_alone / nb,
               a_beside_b_ms=a_both / reps, a_slowdown_pct=100 * (a_both / a_alone - 1),
               hidden_pct=100 * (1 - (end_both - a_alone) / b_alone), end_both_ms=end_both)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default="base,conn1,conn32,prio,green16,green32,green66")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a child process: measure this variant
    a = ap.parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(measure(a.one, a.reps, a.rows)), flush=True)
        return {}
    outd = Path(a.out)
    outd.mkdir(parents=True, exist_ok=True)
    results = []
    for v in a.variants.split(","):
        env = dict(os.environ)
        if v.startswith("conn"):
            env["CUDA_DEVICE_MAX_CONNECTIONS"] = v[4:]
        t0 = time.time()
        p = subprocess.run([sys.executable, __file__, "--out", a.out, "--one", v, "--reps", str(a.reps),
                            "--rows", str(a.rows)], env=env, capture_output=True, text=True, timeout=300)
        line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
        r = json.loads(line[7:]) if line else {"variant": v, "error": (p.stderr or p.stdout)[-1500:]}
        r["wall_s"] = round(time.time() - t0, 1)
        results.append(r)
        print(json.dumps(r)[:300], flush=True)
    head = f"{'variant':10} {'A ms':>7} {'B ms':>7} {'A beside B':>11} {'A slower':>9} {'B hidden':>9}"
    lines = [head]
    for r in results:
        if "error" in r:
            lines.append(f"{r['variant']:10} error: {r['error'].splitlines()[-1] if r['error'] else '?'}")
        else:
            lines.append(f"{r['variant']:10} {r['a_ms']:7.3f} {r['b_ms']:7.3f} {r['a_beside_b_ms']:11.3f} "
                         f"{r['a_slowdown_pct']:8.1f}% {r['hidden_pct']:8.1f}%")
    print("\n".join(lines))
    (outd / "stream_share.json").write_text(json.dumps(results, indent=1))
    (outd / "stream_share.txt").write_text("\n".join(lines) + "\n")
    return {"results": results}


if __name__ == "__main__":
    main()
