"""Where the verifier's kernels should run: a window call beside a decode loop from another process
(the GPU time-slices two contexts) or from a thread of the decode's process on its own stream.

    python benchmarks/placement_cost.py OUT.json      (CUDA; ~3 min on an H200)

Decode proxy: window_cost.DecodeProxy (8B shape, bs 32 and 8, one CUDA graph). The verifier loop:
the engine's step over 8 requests x R rewound rows (random weights, context 512), then a sleep so
that a call starts every N decode steps' time. Per case: decode ms/step alone and beside the loop,
calls made, the call's median latency."""
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import window_cost as wc  # noqa: E402
from mg_server.verifier.bench import SHAPES  # noqa: E402

CTX = 512


def build():
    _, engine, prompt, rids, _ = wc._engine("llama-8b", CTX)
    return engine, prompt, rids


def vloop(eng, stop, started, lat, period_s, rows, stream=None):
    engine, prompt, rids = eng
    items = wc._items(rids, prompt, CTX, 8, rows)
    ctx = torch.cuda.stream(stream) if stream is not None else torch.cuda.stream(torch.cuda.current_stream())
    with ctx:
        for _ in range(3):
            engine.step(items)
        torch.cuda.synchronize()
        started.set()
        while not stop.is_set():
            t0 = time.perf_counter()
            engine.step(items)
            torch.cuda.current_stream().synchronize()
            dt = time.perf_counter() - t0
            lat.append(dt * 1e3)
            time.sleep(max(0.0, period_s - dt))


def child(cmd, stop, started, q):
    eng = build()
    q.put("ready")
    while True:
        c = cmd.get()
        if c is None:
            return
        lat = []
        vloop(eng, stop, started, lat, *c)
        q.put(lat)


def decode_loop(proxy, steps):
    torch.cuda.current_stream().synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        proxy.graph.replay()
    torch.cuda.current_stream().synchronize()
    return (time.perf_counter() - t0) * 1e3 / steps


def main():
    out = sys.argv[1]
    res = {"device": torch.cuda.get_device_name(), "runs": []}
    cfg = SHAPES["llama-8b"]
    steps = 400
    eng = build()
    c = mp.get_context("spawn")
    cmd, pstop, pstarted, q = c.Queue(), c.Event(), c.Event(), c.Queue()
    proc = c.Process(target=child, args=(cmd, pstop, pstarted, q), daemon=True)
    proc.start()
    assert q.get(timeout=400) == "ready"
    for b in (32, 8):
        proxy = wc.DecodeProxy(cfg, b, CTX)
        proxy.capture()
        decode_loop(proxy, 20)
        alone = statistics.median(decode_loop(proxy, steps) for _ in range(3))
        print(f"bs {b}: decode alone {alone:.3f} ms/step", flush=True)
        for rows, every in ((65, 12), (33, 16)):
            period = every * alone / 1e3
            for mode in ("thread", "process"):
                if mode == "thread":
                    stop, started, lat = threading.Event(), threading.Event(), []
                    side = torch.cuda.Stream()
                    th = threading.Thread(target=vloop, args=(eng, stop, started, lat, period, rows, side), daemon=True)
                    th.start()
                else:
                    stop, started = pstop, pstarted
                    stop.clear()
                    started.clear()
                    cmd.put((period, rows))
                started.wait(300)
                time.sleep(0.2)
                with_v = statistics.median(decode_loop(proxy, steps) for _ in range(3))
                stop.set()
                if mode == "thread":
                    th.join()
                else:
                    lat = q.get(timeout=120)
                base = statistics.median(decode_loop(proxy, steps) for _ in range(2))
                lat_s = sorted(lat[3:])
                r = {"bs": b, "rows": 8 * rows, "every_steps": every, "mode": mode, "decode_alone": round(base, 3),
                     "decode_with": round(with_v, 3), "overhead_pct": round(100 * (with_v / base - 1), 2),
                     "call_ms_p50": round(lat_s[len(lat_s) // 2], 2) if lat_s else None, "calls": len(lat)}
                print(json.dumps(r), flush=True)
                res["runs"].append(r)
                torch.cuda.empty_cache()
        del proxy
        torch.cuda.empty_cache()
    cmd.put(None)
    json.dump(res, open(out, "w"), indent=1)


if __name__ == "__main__":
    main()
