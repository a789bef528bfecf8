"""The verifier's benchmarks: its calls, its window forwards, its kernels. One subcommand each,
random weights made on the device (nothing downloaded); each writes JSON.

    python benchmarks/verifier.py calls --out X.json [--models tiny --device cpu --ctx 16 --iters 1]
    python benchmarks/verifier.py windows --out W.json [--model llama-8b] [--ctx 512] [--device cpu]
    python benchmarks/verifier.py cost --out C.json [--windows 8,16,32,64]
    python benchmarks/verifier.py kernels --out K.json [--device cpu --threads 1 --quick] [--variants] [--splitk]
    python benchmarks/verifier.py tiles --out T.json [--ms 1,8,64,256,1024] [--shapes 8b] [--candidates table]
    python benchmarks/verifier.py fused --out F.json [--ms 1,8,17,32,64] [--shapes 135m,8b]
    python benchmarks/verifier.py lm-head --out L.json [--rows 1,8,32,64]
    python benchmarks/verifier.py noise --out N.json [--rows 8,64,128] [--vocab 128256]

- `calls`: per model shape, prefill of a context, then a verify call's latency for a catch-up of
  g tokens plus the current step (g+1 rows, g = 0/1/16/64), alone and with 7 other requests in
  the same forward (graphs and eager on CUDA); then the same call through a CPU worker process
  (zmq). CPU and CUDA.
- `windows`: the engine with `--requests` requests prefilled to `ctx`; the median latency of
  calls of n requests x r rows, a profile by kernel class, and digests of every row's (margin,
  argmax) and logits, so two checkouts can be compared bit for bit. CPU (no graphs, no profile)
  and CUDA.
- `cost`: a bs-8 decode proxy (a plain torch bf16 step of the model's shape in one CUDA graph)
  alone and with one window forward (8 requests x W rows) on a second stream every W steps.
- `kernels`: the batch-invariant matmul and attention against torch.mm / SDPA on SmolLM2-135M
  and Llama-3-8B shapes, and a 135M-shaped decode step; `--variants` / `--splitk` time other
  tile and split-K configs (timing only: another config is another reduction order). CPU and CUDA.
- `tiles`: candidate bf16 matmul tiles against cuBLAS per weight shape and row count, each checked
  bit-equal to the base tile before it may be picked (how `KERNEL_CONFIG["matmul_tiles"]` was
  chosen). CUDA.
- `fused`: the fused prologue matmuls (RMSNorm or SiLU*up inside the next matmul) against the two
  ops they replace, pointer and TMA weight loads, and whether their outputs are bit-equal. CUDA.
- `lm-head`: the fast path's LM head GEMM with bf16 output plus SGLang's cast, and with fp32 output
  (`--enable-fp32-lm-head`, which mg passes on CUDA), at the SmolLM2 and 8B LM heads. CUDA.
- `noise`: seeded sampling's scores (logits / T + Gumbel noise) of n rows, the one kernel
  (kernels/noise_triton.py) against the torch ops it computes, and whether they are bit-equal. CUDA.

GPU timings replay CUDA graphs where the served path does (tiles, fused, lm-head, cost), cycling
the weights through L2 as a decode step streams them.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import torch.nn.functional as F

from mg_server.verifier import ops
from mg_server.verifier.engine import VerifierEngine
from mg_server.verifier.kernels import (KERNEL_CONFIG, add_rms_norm, attention, kernel_config_id, log_softmax,
                                        matmul, prepare_weight, silu_mul, top2)
from mg_server.verifier.kernels.config import matmul_tile, parse_tile, tile_name, tile_names
from mg_server.verifier.model import ModelSpec, VerifierModel, fused_checkpoint
from mg_server.wire.protocol import VerifyItem



# --- calls --------------------------------------------------------------------------------

MODELS = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                     rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
}
MODELS["tiny"] = dict(MODELS["smollm2-135m"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)  # smoke tests
GAPS = (0, 1, 16, 64)


def random_tensors(cfg: dict, device: str, dtype: torch.dtype, seed: int = 0) -> dict:
    """HF-named random weights, generated on `device` (an 8B model in seconds on a GPU)."""
    torch.manual_seed(seed)
    s = ModelSpec.from_hf_config(cfg)
    h, i, d = s.hidden, s.intermediate, s.head_dim

    def rnd(*shape, std):
        return (torch.randn(*shape, device=device, dtype=torch.float32) * std).to(dtype)

    t = {"model.embed_tokens.weight": rnd(s.vocab, h, std=1.0), "model.norm.weight": 1 + rnd(h, std=0.1)}
    for li in range(s.n_layers):
        p = f"model.layers.{li}."
        t.update({p + "input_layernorm.weight": 1 + rnd(h, std=0.1),
                  p + "post_attention_layernorm.weight": 1 + rnd(h, std=0.1),
                  p + "self_attn.q_proj.weight": rnd(s.n_heads * d, h, std=h ** -0.5),
                  p + "self_attn.k_proj.weight": rnd(s.n_kv_heads * d, h, std=h ** -0.5),
                  p + "self_attn.v_proj.weight": rnd(s.n_kv_heads * d, h, std=h ** -0.5),
                  p + "self_attn.o_proj.weight": rnd(h, s.n_heads * d, std=0.25 * (s.n_heads * d) ** -0.5),
                  p + "mlp.gate_proj.weight": rnd(i, h, std=h ** -0.5),
                  p + "mlp.up_proj.weight": rnd(i, h, std=h ** -0.5),
                  p + "mlp.down_proj.weight": rnd(h, i, std=0.25 * i ** -0.5)})
    if not s.tie_embeddings:
        t["lm_head.weight"] = rnd(s.vocab, h, std=h ** -0.5)
    return t


def _sync(device: torch.device | None = None) -> None:
    """Wait for `device` (None: the current CUDA device, when there is one)."""
    if device is None and torch.cuda.is_available() or device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device, iters: int) -> float:
    """Median wall time of fn() in ms (device synchronised around each call)."""
    fn()  # warm-up (Triton compiles on first use of a shape class)
    ts = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def bench_model(name: str, device: str, ctx: int, iters: int, profile: bool = False, profile_gap: int = 0) -> dict:
    cfg = MODELS[name]
    dtype = torch.bfloat16
    spec = ModelSpec.from_hf_config(cfg)
    model = VerifierModel(spec, fused_checkpoint(random_tensors(cfg, device, dtype), spec), dtype,
                          torch.device(device), max_positions=ctx + 128)
    dev = model.device
    engine = VerifierEngine(model, max_requests=16, pool_tokens=16 * (ctx + 128), max_seq_len=ctx + 128)
    prompt = torch.randint(0, model.spec.vocab, (ctx + 80,), generator=torch.Generator().manual_seed(1)).tolist()
    out: dict = {}

    def prefill():
        engine.release("r")
        engine.step([VerifyItem(rid="r", pos=ctx - 1, tokens=prompt[:ctx])])

    out[f"prefill_{ctx}_ms"] = _timed(prefill, dev, max(2, iters // 4))
    prefill()
    others = [f"o{k}" for k in range(7)]
    for o in others:
        engine.step([VerifyItem(rid=o, pos=ctx - 1, tokens=prompt[:ctx])])
    for g in GAPS:
        items = [VerifyItem(rid="r", pos=ctx + g, tokens=prompt[ctx: ctx + g + 1], rewind=True)]
        out[f"verify_gap{g}_ms"] = _timed(lambda: engine.step(items), dev, iters)
        batch = items + [VerifyItem(rid=o, pos=ctx + g, tokens=prompt[ctx: ctx + g + 1], rewind=True)
                         for o in others]
        res = engine.step(batch)
        assert all(r.token == res[0].token and r.margin == res[0].margin for r in res), "batch variance!"
        out[f"verify_gap{g}_x8_ms"] = _timed(lambda: engine.step(batch), dev, iters)
    if engine.graphs is not None:  # the same steps op by op, for comparison (same run)
        eager = VerifierEngine(model, max_requests=2, pool_tokens=2 * (ctx + 128), max_seq_len=ctx + 128,
                               cuda_graphs=False)
        eager.step([VerifyItem(rid="r", pos=ctx - 1, tokens=prompt[:ctx])])
        for g in (0, 16):
            items = [VerifyItem(rid="r", pos=ctx + g, tokens=prompt[ctx: ctx + g + 1], rewind=True)]
            out[f"verify_gap{g}_eager_ms"] = _timed(lambda: eager.step(items), dev, iters)
            assert eager.step(items)[0].margin == engine.step(items)[0].margin, "graph != eager"
        del eager
    if profile:
        from torch.profiler import ProfilerActivity, profile as tprofile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        g = profile_gap  # (16: a lag call at bs 8 carries ~17 rows)
        items = [VerifyItem(rid="r", pos=ctx + g, tokens=prompt[ctx: ctx + g + 1], rewind=True)]
        with tprofile(activities=acts) as prof:
            for _ in range(5):
                engine.step(items)
            _sync(dev)
        print(f"--- profile: {name}, 5 x verify gap {g} ---")
        sort = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=24, max_name_column_width=48))
        if dev.type == "cuda":  # kernels per step and their summed device time (the graph's floor)
            kern = [e for e in prof.events() if e.device_type.name == "CUDA"]
            out["profile_kernels_per_step"] = len(kern) / 5
            out["profile_kernel_ms_per_step"] = sum(e.device_time_total for e in kern) / 5 / 1e3
    del engine, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def bench_ipc(name: str, ctx: int, iters: int, tmp: Path) -> dict:
    """A CPU worker process of shape `name`: verify (1 step after `ctx` tokens) through zmq (a CUDA
    worker computes on a server's SGLang weights: it has none here)."""
    from mg_server.verifier.client import VerifierClient
    from mg_server.verifier.server import VerifierConfig, start_verifier

    from safetensors.torch import save_file

    cfg = dict(MODELS[name])
    d = tmp / name
    d.mkdir()
    save_file({k: v.cpu().contiguous() for k, v in random_tensors(cfg, "cpu", torch.bfloat16).items()},
              str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(cfg))
    ipc = str(tmp / f"bench-{uuid.uuid4().hex[:6]}.sock")
    proc = start_verifier(VerifierConfig(model_path=str(d), ipc_path=ipc, device="cpu", max_seq_len=ctx + 16))
    out = {}
    try:
        with VerifierClient(ipc, timeout_s=300) as c:
            c.connect()
            out["model"] = name
            c.verify("r", ctx - 1, [1 + i % (cfg["vocab_size"] - 1) for i in range(ctx)])  # ids < vocab
            c.verify("r", ctx, [7])

            def one():
                c.verify("r", ctx, [7], rewind=True)

            out["ipc_verify_gap0_ms"] = _timed(one, torch.device("cpu"), iters)
            out["ipc_stats_roundtrip_ms"] = _timed(lambda: c.stats(), torch.device("cpu"), iters)
            c.shutdown()
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


def calls_main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="verifier.py calls")
    ap.add_argument("--out", default="verifier_bench.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--models", default="", help="comma list; default: both on cuda, smollm2 on cpu")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table per model")
    ap.add_argument("--profile-gap", type=int, default=0, help="the profiled step's catch-up tokens (default 0)")
    ap.add_argument("--fused", action="store_true",
                    help="RMSNorm and SiLU inside the next matmul (KERNEL_CONFIG['fused'] on; off in the table)")
    args = ap.parse_args(argv)
    if args.fused:
        KERNEL_CONFIG["fused"] = {op: True for op in KERNEL_CONFIG["fused"]}  # (the id below follows)
    models = args.models.split(",") if args.models else (
        ["smollm2-135m", "llama-8b"] if args.device.startswith("cuda") else ["smollm2-135m"])
    dev = torch.device(args.device)
    res: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "torch": torch.__version__, "kernel_config_id": ops.config_id(dev), "ctx": args.ctx,
                 "models": {}}
    for m in models:
        res["models"][m] = bench_model(m, args.device, args.ctx, args.iters, args.profile, args.profile_gap)
        print(m, json.dumps(res["models"][m]), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        res["ipc"] = bench_ipc(models[0], args.ctx, args.iters, Path(tmp))
    print(f"\nverifier latency, {res['device']}, context {args.ctx}, median ms ({res['kernel_config_id']})")
    print(f"{'model':14s} {'prefill':>9s} " + " ".join(f"{'g=' + str(g):>8s} {'x8':>8s}" for g in GAPS))
    for m, r in res["models"].items():
        print(f"{m:14s} {r[f'prefill_{args.ctx}_ms']:9.2f} "
              + " ".join(f"{r[f'verify_gap{g}_ms']:8.2f} {r[f'verify_gap{g}_x8_ms']:8.2f}" for g in GAPS))
    print("ipc:", json.dumps(res["ipc"]))
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return res


# --- windows --------------------------------------------------------------------------------

CASES = "1x1,8x1,1x17,8x17,8x33,8x65"  # requests x rows each
PROFILED = "8x17,8x65"


def _pairs(text: str) -> list[tuple[int, int]]:
    return [tuple(int(v) for v in c.split("x")) for c in text.split(",") if c]


def _engine(name: str, ctx: int, n_req: int = 8, device: str = "cuda", seq_limit: int = 0):
    cfg = MODELS[name]
    seq_limit = seq_limit or ctx + 128  # the engine's sequence limit (a server's: the model's context)
    spec = ModelSpec.from_hf_config(cfg)
    model = VerifierModel(spec, fused_checkpoint(random_tensors(cfg, device, torch.bfloat16), spec), torch.bfloat16, torch.device(device), max_positions=seq_limit)
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
    cfg = MODELS[a.model]
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
        windows_main, side = torch.cuda.Stream(priority=decode_prio), torch.cuda.Stream(priority=0)
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
            with torch.cuda.stream(windows_main):
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


def windows_main(argv=None):
    ap = argparse.ArgumentParser(prog="verifier.py")
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


# --- kernels --------------------------------------------------------------------------------

MATMUL_SHAPES = {  # name: (N, K) for y = x @ W.T, W [N, K]
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


def kernels_main(argv=None):
    ap = argparse.ArgumentParser(prog="verifier.py kernels")
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
        res["matmul"] = bench_matmul(dev, [1, 8, 32, 64, 256, 1024], MATMUL_SHAPES, 10)
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
                                        {k: v for k, v in MATMUL_SHAPES.items() if k.startswith("8b")},
                                        10)
                    res["variants"].append(dict(config=var, rows=rows, bit_equal=eq))
                except Exception as e:  # pragma: no cover
                    res["variants"].append(dict(config=var, error=repr(e)))
            KERNEL_CONFIG["matmul"]["bfloat16"] = base
        if a.splitk:  # timing only: another split size is another reduction order
            base = dict(KERNEL_CONFIG["matmul_splitk"])
            shapes = {k: MATMUL_SHAPES[k] for k in ("8b.qkv", "8b.o", "8b.down")}
            res["splitk"] = []
            for ks, tiles in ((512, 32), (1024, 32), (2048, 32), (512, 0)):  # max_n_tiles 0: no split-K
                KERNEL_CONFIG["matmul_splitk"].update(K_SPLIT=ks, max_n_tiles=tiles)
                res["splitk"].append(dict(K_SPLIT=ks if tiles else None,
                                          rows=bench_matmul(dev, [1, 8, 32, 64, 256, 1024], shapes, 10)))
            KERNEL_CONFIG["matmul_splitk"].update(base)
    else:
        shapes = {k: v for k, v in MATMUL_SHAPES.items() if k.startswith("135m")}
        if not a.quick:
            shapes["8b.o"] = MATMUL_SHAPES["8b.o"]
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


# --- tiles --------------------------------------------------------------------------------

def _tile_of(bm: int, bn: int, warps: int, stages: int) -> dict:
    return parse_tile(f"{bm}x{bn}w{warps}s{stages}")


CANDIDATES = [_tile_of(64, 32, 4, 8), _tile_of(64, 64, 4, 6), _tile_of(64, 128, 4, 5), _tile_of(64, 128, 4, 4),
              _tile_of(64, 256, 4, 4), _tile_of(64, 256, 8, 3), _tile_of(128, 64, 4, 5), _tile_of(128, 64, 8, 5),
              _tile_of(128, 128, 8, 4), _tile_of(128, 128, 4, 4), _tile_of(128, 256, 8, 3), _tile_of(64, 128, 8, 4)]


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


def tiles_sweep(shapes: dict, ms: list[int], candidates: list[dict] | None) -> dict:
    """candidates None: each shape's own table tiles (a check of the table as it is)."""
    from mg_server.verifier.kernels.matmul_triton import matmul_with_tile
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


def tiles_main(argv=None):
    ap = argparse.ArgumentParser(prog="verifier.py tiles")
    ap.add_argument("--out", default=None)
    ap.add_argument("--ms", default="1,8,16,32,64,128,256,512,1024")
    ap.add_argument("--shapes", default="", help="comma-separated name prefixes, e.g. 8b.qkv,8b.o")
    ap.add_argument("--candidates", default="",
                    help="tile names (default: CANDIDATES), e.g. 64x64w4s6,128x32w4s6; "
                         "'table': each shape's own table tiles")
    a = ap.parse_args(argv)
    prefixes = tuple(a.shapes.split(","))
    shapes = {k: (n, kk, None) for k, (n, kk) in MATMUL_SHAPES.items()}
    for k in [s for s in MATMUL_SHAPES if s.endswith("lm_head")]:  # the verifier's lm_head writes fp32
        shapes[k + "_f32"] = (*MATMUL_SHAPES[k], torch.float32)
    shapes = {k: v for k, v in shapes.items() if k.startswith(prefixes)}
    cands = (None if a.candidates == "table" else [parse_tile(n) for n in a.candidates.split(",")]
             if a.candidates else CANDIDATES)
    res = dict(config_id=kernel_config_id("cuda"), base_tile=KERNEL_CONFIG["matmul"]["bfloat16"],
               device_name=torch.cuda.get_device_name(), torch=torch.__version__,
               candidates=[tile_name(t) for t in cands] if cands is not None else "table",
               **tiles_sweep(shapes, [int(m) for m in a.ms.split(",")], cands))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


# --- fused --------------------------------------------------------------------------------

FUSED_SHAPES = {  # name -> (N, K, prologue)
    "135m.qkv": (960, 576, "norm"), "135m.gate_up": (3072, 576, "norm"), "135m.down": (576, 1536, "silu"),
    "8b.qkv": (6144, 4096, "norm"), "8b.gate_up": (28672, 4096, "norm"), "8b.down": (4096, 14336, "silu"),
}


def fused_shape(n: int, k: int, kind: str, m: int) -> dict:
    from mg_server.verifier.kernels import fused_triton as FT, matmul_triton as MM, triton_ops as TO

    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device="cpu").manual_seed(0)
    copies = max(2, (160 << 20) // (n * k * 2) + 1)  # >= 160 MB of weights per replay (as in tiles)
    ws = [(torch.randn(n, k, generator=g) * 0.05).to(dev, dt) for _ in range(min(copies, 24))]
    if kind == "norm":
        x, r = (torch.randn(m, k, generator=g).to(dev, dt) for _ in range(2))
        gn = torch.randn(k, generator=g).to(dev, dt)
        fns = {"unfused": lambda w: MM.matmul(TO.add_rms_norm(x, r, gn, 1e-5)[0], w),
               "fused_ptr": lambda w: FT.norm_matmul(x, r, gn, 1e-5, w, tma=False)[0],
               "fused_tma": lambda w: FT.norm_matmul(x, r, gn, 1e-5, w, tma=True)[0]}
    else:
        gu = torch.randn(m, 2 * k, generator=g).to(dev, dt)
        fns = {"unfused": lambda w: MM.matmul(TO.silu_mul(gu[:, :k], gu[:, k:]), w),
               "fused_ptr": lambda w: FT.silu_matmul(gu, w, tma=False),
               "fused_tma": lambda w: FT.silu_matmul(gu, w, tma=True)}
    outs = {name: fn(ws[0]) for name, fn in fns.items()}
    res = {f"{name}_ms": graph_ms(fn, ws) for name, fn in fns.items()}
    res["ptr_eq_tma"] = bool(torch.equal(outs["fused_ptr"], outs["fused_tma"]))
    res["fused_eq_unfused"] = bool(torch.equal(outs["fused_tma"], outs["unfused"]))
    return res


def fused_main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="verifier.py fused")
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,8,17,32,64")
    ap.add_argument("--shapes", default="135m", help="comma list of prefixes: 135m, 8b")
    args = ap.parse_args(argv)
    ms = [int(v) for v in args.ms.split(",")]
    res = {"device": torch.cuda.get_device_name(), "kernel_config_id": kernel_config_id("cuda"), "shapes": {}}
    print(f"{'shape':14s} {'M':>4s} {'unfused':>9s} {'fused ptr':>10s} {'fused tma':>10s}  ptr==tma fused==unfused")
    for name, (n, k, kind) in FUSED_SHAPES.items():
        if not any(name.startswith(p) for p in args.shapes.split(",")):
            continue
        for m in ms:
            r = res["shapes"].setdefault(name, {})[m] = fused_shape(n, k, kind, m)
            print(f"{name:14s} {m:4d} {r['unfused_ms'] * 1e3:8.1f}u {r['fused_ptr_ms'] * 1e3:9.1f}u "
                  f"{r['fused_tma_ms'] * 1e3:9.1f}u  {r['ptr_eq_tma']!s:8s} {r['fused_eq_unfused']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return res


# --- lm-head --------------------------------------------------------------------------------

LM_HEADS = {"smollm2-135m": (576, 49152), "llama-8b": (4096, 128256)}  # (hidden, vocab)


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


def lm_head_main(argv=None) -> dict:
    ap = argparse.ArgumentParser(prog="verifier.py lm-head")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cast_name, cast = bf16_to_fp32()
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "iters": args.iters,
           "bf16_cast": cast_name, "cases": []}
    for name, (hidden, vocab) in LM_HEADS.items():
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


def noise_main(argv=None) -> dict:
    from mg_server.verifier import sampling

    ap = argparse.ArgumentParser(prog="verifier.py noise")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="8,64,128")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)
    res = {"device": torch.cuda.get_device_name(), "vocab": args.vocab, "cases": []}
    for n in (int(x) for x in args.rows.split(",")):
        call = (torch.randn(n, args.vocab, device="cuda"), [0.8] * n, list(range(n)), [300 + k for k in range(n)])
        row = {"rows": n, "equal": torch.equal(sampling.sampled_scores_rows(*call), sampling._scores_torch(*call))}
        for name, fn in (("kernel_ms", sampling.sampled_scores_rows), ("torch_ms", sampling._scores_torch)):
            fn(*call)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.iters):
                fn(*call)
            end.record()
            torch.cuda.synchronize()
            row[name] = round(start.elapsed_time(end) / args.iters, 4)
        res["cases"].append(row)
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    return res


COMMANDS = {"calls": calls_main, "windows": windows_main, "cost": windows_main, "kernels": kernels_main,
            "tiles": tiles_main, "fused": fused_main, "lm-head": lm_head_main, "noise": noise_main}


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        raise SystemExit(f"usage: verifier.py {{{','.join(COMMANDS)}}} [options]  (see the module's docstring)")
    cmd, rest = argv[0], argv[1:]
    return COMMANDS[cmd]([cmd, *rest] if COMMANDS[cmd] is windows_main else rest)


if __name__ == "__main__":
    main()
