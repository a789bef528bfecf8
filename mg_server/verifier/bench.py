"""Verifier latency benchmark: `python -m mg_server.verifier.bench --out X.json`.

Per model shape (random weights made on the device, nothing downloaded): prefill of a context,
then verify latency for a catch-up of g tokens plus the current step (g+1 rows, g = 0/1/16/64),
alone and with 7 other requests in the same forward; through the worker process (IPC + shared
slot read) for the small model; and the slot-buffer round trip. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch

from mg_server.verifier import ops
from mg_server.verifier.engine import VerifierEngine
from mg_server.verifier.model import ModelSpec, VerifierModel, fused_checkpoint
from mg_server.wire.protocol import VerifyItem

SHAPES = {
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=49152,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
    "llama-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                     rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False),
}
SHAPES["tiny"] = dict(SHAPES["smollm2-135m"], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
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
    cfg = SHAPES[name]
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

    cfg = dict(SHAPES[name])
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


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__)
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
        from mg_server.verifier.kernels import KERNEL_CONFIG
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


if __name__ == "__main__":
    main()
