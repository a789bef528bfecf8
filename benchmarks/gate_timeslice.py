"""Does a held stream gate slow down another process's GPU work? (issue 10, lagged seam)

The lagged seam holds SGLang's stream while the verifier, a separate process, verifies on the
same GPU. This times a stand-in for the verifier (another process: 100 small kernels, then a
sync, repeated; or with a sync after every kernel pair, as a verify call's host round trips)
while this process holds one stream in each of three ways:
  idle  - nothing held (baseline);
  spin  - a kernel spinning on an SM until a page-locked host flag is raised (mg's first gate);
  wait  - mg's step gate (kernels/gate.py, holding: cuStreamWaitValue64 on a page-locked host
          flag, the GPU's front end waits, no SM busy) until the host answers.

    python benchmarks/gate_timeslice.py --out DIR

Prints a table (median / p90 ms per victim round) and writes DIR/gate_timeslice.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path

HOLD_S = 2.0


def _spin_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def spin(flag_ptr):
        v = tl.load(flag_ptr, volatile=True)
        while v == 0:
            v = tl.load(flag_ptr, volatile=True)

    return spin


def victim(q, seconds: float, sync_each: bool) -> None:
    import torch

    x = torch.randn(512, 512, device="cuda")
    for _ in range(20):
        x = (x @ x).tanh_()
    torch.cuda.synchronize()
    q.put("ready")
    rounds, end = [], time.monotonic() + seconds
    while time.monotonic() < end:
        t0 = time.perf_counter()
        for _ in range(50):
            x = (x @ x).tanh_()
            if sync_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        rounds.append(1e3 * (time.perf_counter() - t0))
    q.put(rounds)


def hold(mode: str) -> None:
    """Hold the current stream for HOLD_S in `mode`, then let it go."""
    import torch

    if mode == "idle":
        time.sleep(HOLD_S)
        return
    dev = torch.device("cuda")
    if mode == "spin":
        flag = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        _spin_kernel()[(1,)](flag)
        time.sleep(HOLD_S)
        flag.numpy()[0] = 1
    else:
        from mg_server.kernels.gate import StepGate

        slots = torch.zeros(2, 1, 2, 1, 8, dtype=torch.bfloat16, device=dev)
        pool = [torch.zeros(4, 1, 8, dtype=torch.bfloat16, device=dev)]
        gate = StepGate(4, pool, pool, slots, torch.zeros(1, 4, dtype=torch.int32, device=dev))
        one = torch.ones(1, device=dev)
        chosen = torch.zeros(1, dtype=torch.int64, device=dev)
        gate.launch(one, chosen + 1, chosen, torch.ones(1, dtype=torch.int32, device=dev), chosen, 1)
        time.sleep(HOLD_S)
        gate.release(1, [1], [])
    t0 = time.monotonic()
    torch.cuda.synchronize()
    if time.monotonic() - t0 > 5:
        raise RuntimeError(f"{mode}: the stream did not resume")


def run(mode: str, sync_each: bool) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=victim, args=(q, HOLD_S, sync_each))
    import torch

    torch.zeros(1, device="cuda")
    p.start()
    assert q.get(timeout=120) == "ready"
    hold(mode)
    rounds = q.get(timeout=60)
    p.join()
    rounds.sort()
    return {"mode": mode, "sync_each": sync_each, "rounds": len(rounds), "median_ms": statistics.median(rounds),
            "p90_ms": rounds[int(0.9 * (len(rounds) - 1))]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out/gate-timeslice"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    res = []
    for sync_each in (False, True):
        for mode in ("idle", "spin", "wait", "idle"):
            try:
                res.append(run(mode, sync_each))
            except Exception as e:  # noqa: BLE001 - report what could not be measured
                res.append({"mode": mode, "sync_each": sync_each, "error": f"{type(e).__name__}: {e}"})
            print(res[-1], flush=True)
    (args.out / "gate_timeslice.json").write_text(json.dumps(res, indent=2))
    print("| held by | victim syncs | victim rounds | median ms / round | p90 ms |\n|---|---|---|---|---|")
    for r in res:
        syncs = "every kernel pair" if r["sync_each"] else "per round"
        print(f"| {r['mode']} | {syncs} | {r.get('rounds', '')} | {r.get('median_ms', float('nan')):.2f} | "
              f"{r.get('p90_ms', float('nan')):.2f} |" if "error" not in r else f"| {r['mode']} | {syncs} | error: {r['error']} | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
