"""Host time per call of the lagged seam's per-forward launches on a GPU (decide, the step gate,
force), next to variants, to say where the seam's ~0.4 ms of host time per deterministic forward
goes (benchmarks/results/gpu/profile_verify_path_h100.json) and what a change would save.

    python benchmarks/seam_launch.py --out $OUT/seam_launch.json [--rows 8] [--vocab 49152]

Host time = wall time of `iters` enqueues with no sync between them (the GPU work of each is a
few microseconds, so the queue never fills), divided by iters; median of 5 rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def host_us(fn, iters: int) -> float:
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        rounds.append((time.perf_counter() - t0) / iters * 1e6)
        torch.cuda.synchronize()
    return statistics.median(rounds)


def main() -> None:
    from mg_server.kernels import decide as D
    from mg_server.kernels import gate as G
    from mg_server.kernels.launch import current_stream, spec_key

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=200)
    a = ap.parse_args()
    dev = torch.device("cuda")
    n, V, cap = a.rows, a.vocab, 64
    logits = torch.randn(n, V, device=dev)  # [n, V] fp32, SGLang's sampler logits
    positions = torch.arange(n, device=dev, dtype=torch.int64)  # [n]
    meta_pin = torch.zeros(3 * cap, dtype=torch.int64, pin_memory=True)
    meta_pin[:n] = torch.arange(n)
    meta_pin[n:2 * n] = -5  # never the step mg expects: need = 0, the gate passes through
    tau_pin = torch.zeros(1, dtype=torch.float64, pin_memory=True)
    meta_dev, tau_dev = meta_pin.to(dev), tau_pin.to(dev)
    margin = torch.zeros(cap, device=dev)
    fast, pos, rows, chosen = (torch.zeros(cap, dtype=torch.int64, device=dev) for _ in range(4))
    need = torch.zeros(cap, dtype=torch.int32, device=dev)
    L, hkv, d = 30, 3, 64  # SmolLM2's pool shape
    slots = torch.zeros(4, L, 2, hkv, d, dtype=torch.bfloat16, device=dev)
    kb = [torch.zeros(16, hkv, d, dtype=torch.bfloat16, device=dev) for _ in range(L)]
    vb = [torch.zeros(16, hkv, d, dtype=torch.bfloat16, device=dev) for _ in range(L)]
    r2t = torch.zeros(4, 16, dtype=torch.int32, device=dev)
    gate = G.StepGate(cap, kb, vb, slots, r2t)
    target = [0]

    def dec(meta, tau):
        return lambda: D.decide(logits, positions, meta, tau, False, margin[:n], fast[:n], pos[:n], need[:n],
                                rows[:n])

    def gate_launch():
        target[0] += 1
        gate.launch(margin[:n], fast[:n], pos[:n], need[:n], chosen[:n], target[0])

    dec(meta_pin, tau_pin)()
    D.force(logits, rows[:n], chosen[:n])
    gate_launch()
    torch.cuda.synchronize()
    stream = torch.cuda.current_stream(dev).cuda_stream
    meta, tau = meta_pin, tau_pin
    args_d = (logits, logits.stride(0), V, positions, meta, tau, n, margin[:n], fast[:n], pos[:n], need[:n], rows[:n])
    cases = {
        "torch add_ (reference: one torch op)": lambda: logits.add_(0.0),
        "torch.cuda.current_stream(dev).cuda_stream": lambda: torch.cuda.current_stream(dev).cuda_stream,
        "kernels.launch.current_stream(dev)": lambda: current_stream(dev),
        "decide, JIT launch (meta, tau page-locked)": lambda: D._decide_kernel[(n,)](*args_d, ALWAYS=False,
                                                                                     CHUNK=D.CHUNK, num_warps=8),
        "decide, JIT launch (meta, tau on the device)": lambda: D._decide_kernel[(n,)](
            *args_d[:4], meta_dev, tau_dev, *args_d[6:], ALWAYS=False, CHUNK=D.CHUNK, num_warps=8),
        "decide() (kernels.launch.Launcher)": dec(meta_pin, tau_pin),
        "force, JIT launch": lambda: D._force_kernel[(n,)](logits, logits.stride(0), V, rows, chosen,
                                                           CHUNK=D.CHUNK, num_warps=4),
        "force() (kernels.launch.Launcher)": lambda: D.force(logits, rows[:n], chosen[:n]),
        "decide kernel through its Launcher (same args as the JIT rows)": lambda: D._DECIDE(
            (n,), *args_d, False, D.CHUNK),
        "force kernel through its Launcher (same args as the JIT row)": lambda: D._FORCE(
            (n,), logits, logits.stride(0), V, rows, chosen, D.CHUNK),
        "spec_key of decide's arguments": lambda: spec_key((*args_d, False, D.CHUNK), 2),
        "gate.launch (publish + wait + apply, passing; Launcher)": gate_launch,
        "cuStreamWaitValue64 alone (already raised)": lambda: G._stream_wait_geq(stream, gate.flag.data_ptr(), 0),
        "margin[:n] (a view)": lambda: margin[:n],
    }
    res = {}
    for name, fn in cases.items():
        res[name] = host_us(fn, a.iters)
        print(f"| {name} | {res[name]:.1f} us |", flush=True)
    launchers = {name: {"direct": lc.direct, "refused": lc.refused, "compiled": len(lc.compiled),
                        "runners": len(lc.runners)}
                 for name, lc in (("decide", D._DECIDE), ("force", D._FORCE), ("publish", G._PUBLISH),
                                  ("apply", G._APPLY))}
    print(json.dumps(launchers))
    import triton
    out = {"launchers": launchers, "rows": n, "vocab": V, "iters": a.iters, "torch": torch.__version__, "triton": triton.__version__,
           "device": torch.cuda.get_device_name(), "host_us_per_call": res}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
