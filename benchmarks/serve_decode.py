"""Decode ms/step of a real mg-server, measured through the HTTP API.

For each batch size B, B concurrent /generate requests with `ignore_eos` run N new tokens each;
a step's time is (wall time of the batch - time of a 1-token run of the same batch) / (N - 1),
which removes prefill and HTTP overhead. Run with and without X-Deterministic to see what the
mg hook costs. Prints a table and writes JSON.

    python benchmarks/serve_decode.py --out bench-out/serve_decode.json [--url http://127.0.0.1:30000]
(without --url a server is started on a free port and stopped afterwards)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from server_util import ServerProcess  # noqa: E402

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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench-out/serve_decode.json"))
    args = ap.parse_args()

    srv = None
    url = args.url
    if url is None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        srv = ServerProcess([], args.out.with_suffix(".server.log"))
        print(f"server ready in {srv.wait_ready():.1f}s", flush=True)
        url = srv.url
    try:
        run_batch(url, 2, 4, False)  # warm-up
        rows = [measure(url, b, args.new_tokens, det, args.reps)
                for b in (int(x) for x in args.batches.split(",")) for det in (False, True)]
    finally:
        if srv:
            srv.stop()
    print(f"{'batch':>5} {'X-Det':>5} {'ms/step (median)':>17}  all")
    for r in rows:
        print(f"{r['batch']:>5} {int(r['deterministic']):>5} {r['ms_per_step_median']:>17.1f}  "
              + " ".join(f"{x:.1f}" for x in r["ms_per_step_all"]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
