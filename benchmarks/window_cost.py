"""Window verify forwards: latency, per-kernel-class profile, and their cost beside a decode loop.

    python benchmarks/window_cost.py windows --out W.json [--model llama-8b] [--ctx 512]
    python benchmarks/window_cost.py cost --out C.json [--windows 8,16,32,64]

`windows`: the verifier engine (random weights of the shape, made on the device) with `--requests`
(8) requests prefilled to `ctx`; the median latency of verify calls of n requests x r rows each (r - 1 caught
up plus the current step, rewound and repeated), a torch.profiler breakdown by kernel class of
8 x 17 and 8 x 65, and per case digests of every row's (margin, argmax) and of the answer rows'
logits, so two runs (two versions of the code) can be compared bit for bit. Uses only the
engine's public API, so it also runs against an older checkout (PYTHONPATH=that checkout).

`cost`: a bs-8 decode proxy (plain torch bf16/cuBLAS step of the model's shape over a `ctx`
K/V context, in one CUDA graph) timed alone and with one verifier window forward (8 requests x
W rows, a graph replay) launched on a second stream every W steps: ms/step and overhead %.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from mg_server.verifier.bench import SHAPES, random_tensors
from mg_server.verifier.engine import VerifierEngine
from mg_server.verifier.model import ModelSpec, VerifierModel
from mg_server.wire.protocol import VerifyItem

CASES = "1x1,8x1,1x17,8x17,8x33,8x65"  # requests x rows each
PROFILED = "8x17,8x65"


def _pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in c.split("x")) for c in text.split(",") if c]


def _engine(name: str, ctx: int, n_req: int = 8, device: str = "cuda", seq_limit: int = 0):
    cfg = SHAPES[name]
    seq_limit = seq_limit or ctx + 128  # the engine's sequence limit (a server's: the model's context)
    model = VerifierModel(ModelSpec.from_hf_config(cfg), random_tensors(cfg, device, torch.bfloat16),
                          torch.bfloat16, torch.device(device), max_positions=seq_limit)
    t0 = time.perf_counter()
    slots = max(16, n_req)
    engine = VerifierEngine(model, max_requests=slots, pool_tokens=slots * (ctx + 128), max_seq_len=seq_limit)
    capture_s = time.perf_counter() - t0
    prompt = torch.randint(0, model.spec.vocab, (ctx + 128,), generator=torch.Generator().manual_seed(1)).tolist()
    rids = [f"r{k}" for k in range(n_req)]
    for r in rids:
        engine.step([VerifyItem(rid=r, pos=ctx - 1, tokens=prompt[:ctx])])
    return model, engine, prompt, rids, capture_s


def _items(rids, prompt, ctx, n, rows):
    return [VerifyItem(rid=r, pos=ctx + rows - 1, tokens=prompt[ctx: ctx + rows], rewind=True) for r in rids[:n]]


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _median_ms(fn, iters: int) -> float:
    fn()
    ts = []
    for _ in range(iters):
        _sync()
        t0 = time.perf_counter()
        fn()
        _sync()
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def _kernel_class(name: str) -> str:
    n = name.lower()
    for key, cls in (("_attn_rows_split", "attention_split"), ("_attn_tiles_split", "attention_split"),
                     ("_attn_rows_merge", "attention_merge"), ("_matmul", "matmul"), ("_rms", "rmsnorm"),
                     ("_silu", "silu_mul"), ("_rope", "rope_store"), ("_top2", "top2"), ("_copy_kernel", "zerocopy")):
        if key in n:
            return cls
    return "other"


def _profile(engine, items, n_layers: int, reps: int = 3) -> dict:
    from torch.profiler import ProfilerActivity, profile

    engine.step(items)
    _sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            engine.step(items)
        torch.cuda.synchronize()
    kern = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    by: dict[str, float] = {}
    count: dict[str, int] = {}
    per_mm = 4 * n_layers + 1  # qkv, o, gate_up, down per layer, then lm_head: one forward (one replay)
    k_mm = 0
    for e in kern:
        c = _kernel_class(e.name)
        if c == "matmul":
            i = k_mm % per_mm
            c = "matmul.lm_head" if i == per_mm - 1 else "matmul." + ("qkv", "o", "gate_up", "down")[i % 4]
            k_mm += 1
        by[c] = by.get(c, 0.0) + e.device_time_total / 1e3 / reps
        count[c] = count.get(c, 0) + 1
    return {"kernel_ms": {k: round(v, 4) for k, v in sorted(by.items(), key=lambda x: -x[1])},
            "kernels": {k: v // reps for k, v in count.items()},
            "total_kernel_ms": round(sum(by.values()), 4), "replays": k_mm // per_mm // reps}


def windows(a) -> dict:
    if bad := [f"{n}x{r}" for n, r in _pairs(a.cases) if not (0 < n <= a.requests and 0 < r <= 128)]:
        raise SystemExit(f"cases {bad}: 1 to --requests ({a.requests}) requests of 1 to 128 rows (ctx + 128 is the "
                         "engine's sequence limit)")
    if bad := sorted(set(a.profile.split(",")) - set(a.cases.split(",")) - {""}):
        raise SystemExit(f"--profile cases {bad} are not in --cases")
    model, engine, prompt, rids, capture_s = _engine(a.model, a.ctx, a.requests, a.device, a.seq_limit)
    cuda = a.device == "cuda"
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__,
           "model": a.model, "ctx": a.ctx, "seq_limit": engine.max_seq_len, "mg_server": sys.modules["mg_server"].__file__,
           "graph_capture_s": round(capture_s, 2), "max_graph_rows": engine.graphs.max_rows if cuda else 0,
           "cases": {}}
    for n, rows in _pairs(a.cases):
        items = _items(rids, prompt, a.ctx, n, rows)
        res = engine.step(items)
        assert all(r.token == res[0].token and r.margin == res[0].margin for r in res), "batch variance!"
        before = engine.graph_forwards
        ms = _median_ms(lambda: engine.step(items), a.iters)
        h = hashlib.blake2b(digest_size=12)
        for r in res:
            h.update(json.dumps([r.audit_tokens, r.audit_margins, r.token, r.margin]).encode())
        lg = hashlib.blake2b(torch.stack([r.logits for r in res]).cpu().numpy().tobytes(), digest_size=12)
        out["cases"][f"{n}x{rows}"] = {"ms": round(ms, 3), "replays_per_call": (engine.graph_forwards - before)
                                       / (a.iters + 1), "rows_digest": h.hexdigest(), "logits_digest": lg.hexdigest()}
        print(f"{n}x{rows}: {ms:.2f} ms", flush=True)
    if not cuda:
        return out
    for n, rows in _pairs(a.profile):
        out["cases"][f"{n}x{rows}"]["profile"] = _profile(engine, _items(rids, prompt, a.ctx, n, rows),
                                                          model.spec.n_layers)
        print(f"profile {n}x{rows}:", json.dumps(out["cases"][f"{n}x{rows}"]["profile"]), flush=True)
    out["memory_allocated_gb"] = round(torch.cuda.memory_allocated() / 2**30, 2)
    out["memory_reserved_gb"] = round(torch.cuda.memory_reserved() / 2**30, 2)
    return out


class DecodeProxy:
    """A bs-`b` decode step of a Llama shape in plain torch (bf16, cuBLAS, SDPA) over a `ctx`
    K/V context: every weight read once per step as in a serving engine's decode; one CUDA graph."""

    def __init__(self, cfg: dict, b: int, ctx: int):
        s = ModelSpec.from_hf_config(cfg)
        self.s, self.b, self.ctx = s, b, ctx
        dev, dt = "cuda", torch.bfloat16
        h, d = s.hidden, s.head_dim

        def w(*shape):  # [out, in] bf16
            return (torch.randn(*shape, device=dev) * shape[-1] ** -0.5).to(dt)
        self.layers = [(w((s.n_heads + 2 * s.n_kv_heads) * d, h), w(h, s.n_heads * d), w(2 * s.intermediate, h),
                        w(h, s.intermediate)) for _ in range(s.n_layers)]
        self.lm_head = w(s.vocab, h)  # [V, H] bf16
        self.k = torch.randn(s.n_layers, b, s.n_kv_heads, ctx, d, device=dev, dtype=dt)  # [L, B, Hkv, ctx, D]
        self.v = torch.randn_like(self.k)
        self.x = torch.randn(b, h, device=dev, dtype=dt)  # [B, H] bf16 static input
        self.graph = None

    def step(self) -> torch.Tensor:
        s, b, d = self.s, self.b, self.s.head_dim
        x = self.x
        for li, (wqkv, wo, wgu, wd) in enumerate(self.layers):
            hn = F.rms_norm(x, (s.hidden,), eps=s.eps)
            qkv = hn @ wqkv.t()
            q = qkv[:, : s.n_heads * d].view(b, s.n_heads, 1, d)
            kn = qkv[:, s.n_heads * d:(s.n_heads + s.n_kv_heads) * d].view(b, s.n_kv_heads, d)
            self.k[li, :, :, -1] = kn  # the step's K into the last context position
            a = F.scaled_dot_product_attention(q, self.k[li], self.v[li], enable_gqa=True)  # [B, Hq, 1, D]
            x = x + a.reshape(b, s.n_heads * d) @ wo.t()
            gu = F.rms_norm(x, (s.hidden,), eps=s.eps) @ wgu.t()
            x = x + (F.silu(gu[:, : s.intermediate]) * gu[:, s.intermediate:]) @ wd.t()
        return (F.rms_norm(x, (s.hidden,), eps=s.eps) @ self.lm_head.t()).float().argmax(-1)

    def capture(self) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.step()


def cost(a) -> dict:
    cfg = SHAPES[a.model]
    model, engine, prompt, rids, _ = _engine(a.model, a.ctx)
    rg = engine.graphs
    proxy = DecodeProxy(cfg, 8, a.ctx)
    proxy.capture()
    steps = a.steps
    res = {"device": torch.cuda.get_device_name(), "model": a.model, "ctx": a.ctx, "steps": steps,
           "max_graph_rows": rg.max_rows, "windows": {}}

    def loop(every: int, replay=None, stream=None) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(steps):
            proxy.graph.replay()
            if replay is not None and i % every == 0:
                with torch.cuda.stream(stream):
                    replay()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3 / steps

    loop(1)
    alone = statistics.median(loop(1) for _ in range(3))
    res["decode_alone_ms_per_step"] = round(alone, 3)
    print(f"decode proxy alone: {alone:.3f} ms/step", flush=True)
    # torch: a lower number is a higher priority, 0 (the default) the lowest
    for prio_name, decode_prio in (("same_priority", 0), ("decode_high_priority", -1)):
        main, side = torch.cuda.Stream(priority=decode_prio), torch.cuda.Stream(priority=0)
        for w in a.windows:
            items = _items(rids, prompt, a.ctx, 8, w)
            seen = []
            orig = rg.run
            rg.run = lambda *args, _o=orig: (seen.append(args), _o(*args))[1]
            engine.step(items)
            rg.run = orig
            assert len(seen) == 1, f"8 x {w} rows took {len(seen)} replays"
            rg._fill(list(seen[0]))
            b = next(x for x in rg.buckets if x >= len(seen[0][0])) if hasattr(rg, "buckets") else 128
            g = rg.graphs[b][0]
            verify_ms = _median_ms(g.replay, 5)
            with torch.cuda.stream(main):
                loop(w, g.replay, side)
                with_v = statistics.median(loop(w, g.replay, side) for _ in range(3))
                base = statistics.median(loop(1) for _ in range(2))
            key = f"{prio_name}/W{w}"
            res["windows"][key] = {"rows": len(seen[0][0]), "bucket": b, "verify_alone_ms": round(verify_ms, 3),
                                   "decode_alone_ms_per_step": round(base, 3),
                                   "with_verify_ms_per_step": round(with_v, 3),
                                   "overhead_pct": round(100 * (with_v / base - 1), 2),
                                   "serial_bound_pct": round(100 * verify_ms / w / base, 2)}
            print(key, json.dumps(res["windows"][key]), flush=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["windows", "cost"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--device", default="cuda", help="windows: cpu for a smoke run (no graphs, no profile)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seq-limit", type=int, default=0,
                    help="windows: the engine's sequence limit (default ctx + 128; a server's is the model's context, "
                         "8192 for Llama-3-8B)")
    ap.add_argument("--requests", type=int, default=8, help="windows: requests prefilled to ctx (the most a case takes)")
    ap.add_argument("--steps", type=int, default=128, help="cost: decode steps per timed loop")
    ap.add_argument("--windows", default="8,16,32,64", help="cost: W, rows per request per window")
    ap.add_argument("--cases", default=CASES, help="windows: requests x rows, comma-separated")
    ap.add_argument("--profile", default=PROFILED, help="windows: the cases profiled by kernel class")
    ap.add_argument("--tile", action="append", default=[],
                    help='an A/B of the matmul tile table: SHAPE@ROWS=TILE, e.g. 28672x4096@640=128x128w4s4 '
                         '(sets the "matmul_tiles" entry of that rows column; no bits change)')
    a = ap.parse_args(argv)
    if a.tile:
        from mg_server.verifier.kernels import KERNEL_CONFIG
        table = KERNEL_CONFIG["matmul_tiles"]
        for t in a.tile:
            key, rest = t.split("@")
            rows, name = rest.split("=")
            table[key][table["rows"].index(int(rows))] = name
        print("tiles:", a.tile, flush=True)
    a.windows = [int(x) for x in a.windows.split(",")]
    res = windows(a) if a.mode == "windows" else cost(a)
    res["tile_overrides"] = a.tile
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
