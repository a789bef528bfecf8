"""Decode ms/step of a real mg-server, measured through the HTTP API.

For each batch size B, B concurrent /generate requests with `ignore_eos` run N new tokens each;
a step's time is (wall time of the batch - time of a 1-token run of the same batch) / (N - 1),
which removes prefill and HTTP overhead. Run with and without X-Deterministic to see what mg
costs; `mg_control_seconds` (the hook's own time in forwards where nothing was verified: margins
plus the controller round trip) is reported next to the step time. Prints a table, writes JSON.

    python benchmarks/serve_decode.py --out bench-out/serve_decode.json [--url http://127.0.0.1:30000]
    python benchmarks/serve_decode.py --server-args "--mg-mode margin --mg-tau 0"   # control path only
(without --url a server is started on a free port with --server-args and stopped afterwards)
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from mg_server.evaluation.server_process import ServerProcess

PROMPTS = [
    "Explain how a hash table works.", "Write a short story about a robot.", "List the planets.",
    "What is photosynthesis?", "Describe the water cycle.", "Give three tips for studying.",
    "Summarize the history of Rome.", "How do vaccines work?",
]


def run_batch(url: str, batch: int, new_tokens: int, deterministic: bool) -> float:
    headers = {"X-Deterministic": "1"} if deterministic else {}

    def one(i: int) -> None:
        body = {"text": PROMPTS[i % len(PROMPTS)],
                "sampling_params": {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0}}
        r = requests.post(url + "/generate", json=body, headers=headers, timeout=600)
        r.raise_for_status()

    start = time.perf_counter()
    with ThreadPoolExecutor(batch) as pool:
        list(pool.map(one, range(batch)))
    return time.perf_counter() - start


def measure(url: str, batch: int, new_tokens: int, deterministic: bool, reps: int) -> dict:
    per_step = []
    for _ in range(reps):
        short = run_batch(url, batch, 1, deterministic)
        full = run_batch(url, batch, new_tokens, deterministic)
        per_step.append((full - short) / (new_tokens - 1) * 1000)
    return {"batch": batch, "deterministic": deterministic, "new_tokens": new_tokens,
            "ms_per_step_median": statistics.median(per_step), "ms_per_step_all": per_step}


def control_seconds(url: str) -> dict:
    text = requests.get(url + "/metrics", timeout=30).text
    get = lambda name: float(m.group(1)) if (m := re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)) else 0.0  # noqa: E731
    return {"sum": get("mg_control_seconds_sum"), "count": get("mg_control_seconds_count")}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-out/serve_decode.json"))
    ap.add_argument("--server-args", default="", help="flags for the server this script starts")
    args = ap.parse_args()

    srv = None
    url = args.url
    if url is None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        srv = ServerProcess(shlex.split(args.server_args), args.out.with_suffix(".server.log"))
        print(f"server ready in {srv.wait_ready():.1f}s", flush=True)
        url = srv.url
    try:
        run_batch(url, 2, 4, False)  # warm-up
        rows = [measure(url, b, args.new_tokens, det, args.reps)
                for b in (int(x) for x in args.batches.split(",")) for det in (False, True)]
        control = control_seconds(url)
    finally:
        if srv:
            srv.stop()
    print(f"{'batch':>5} {'X-Det':>5} {'ms/step (median)':>17}  all")
    for r in rows:
        print(f"{r['batch']:>5} {int(r['deterministic']):>5} {r['ms_per_step_median']:>17.1f}  "
              + " ".join(f"{x:.1f}" for x in r["ms_per_step_all"]))
    if control["count"]:
        mean_ms = control["sum"] / control["count"] * 1000
        step_ms = statistics.median(r["ms_per_step_median"] for r in rows if r["deterministic"])
        print(f"mg control path (forwards without a verify): {mean_ms:.3f} ms mean over {control['count']:.0f} "
              f"forwards = {100 * mean_ms / step_ms:.2f}% of a deterministic decode step ({step_ms:.1f} ms)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "control_seconds": control, "server_args": args.server_args},
                                   indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
