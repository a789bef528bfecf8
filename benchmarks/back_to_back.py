"""Deterministic batches posted back to back, against the same batches after a pause.

    python3 benchmarks/back_to_back.py --out OUT.json (--url http://HOST:PORT | --checkpoint DIR --tau T)
        [--prompts PROMPTS.json] [--tokens 64] [--reps 2]

Each batch is one streamed /generate body of 32 rows (X-Deterministic: 1), read to its end (the
verdict event included) before the next is posted. Per batch: the rows' first chunk, the chunk
at token 16 and the last chunk (seconds from the post; median and max over the rows), how long
after the last row's last chunk the verdict event came, and the differences of mg's counters
around it, so a slow batch shows whether it did more checks or waited. Patterns, in order: a warm-up batch; `--reps` batches back to back (8 prompts, each 4
times); `--reps` after a 2 s pause each; `--reps` of 32 distinct prompts back to back, then after a
pause each (a quarter of them ~1,250 tokens long); two plain batches back to back, then two of the
distinct prompts. PROMPTS.json: token ids under "det", "other" and "prefix" (default
benchmarks/data/gpu_prompts.json, gpu_sweep.py's). --checkpoint starts a margin server of the smol shape on CUDA at --tau
(gpu_e2e.start, lagged seam) and stops it after; on the device machine after
`benchmarks/device_real_smol.sh build`, e.g. --checkpoint /tmp/mg-models/smol-real --tau 0.578125.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stream_timing import read_stream, verdict_wait_ms  # noqa: E402

COUNTERS = ("mg_rollbacks_total", "mg_verify_seconds_count", "mg_verify_seconds_sum", "mg_lookahead_steps_total",
            "mg_rollback_dropped_steps_total", "mg_stale_steps_total", "steps_fast", "steps_verify")
ROWS = 32
PAUSE_S = 2.0
MIN_TOKENS = 16  # each row's chunk at token 16 is timed


def batch(url: str, rows: list[list[int]], tokens: int, det: bool) -> dict:
    """One streamed body, read to its end -> its rows' chunk times and mg's counter differences."""
    import requests

    from mg_server.evaluation.determinism import scrape

    params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream_interval": 8}
    before = scrape(url, COUNTERS)
    posted, marks = time.perf_counter(), {}
    with requests.post(url + "/generate", json={"input_ids": rows, "sampling_params": params, "stream": True},
                       headers={"X-Deterministic": "1"} if det else {}, timeout=600, stream=True) as r:
        r.raise_for_status()
        points, states = read_stream(r, marks=marks)
    done = time.perf_counter() - posted
    after = scrape(url, COUNTERS)
    if len(points) != len(rows):
        raise RuntimeError(f"{len(points)} of {len(rows)} rows streamed")
    first = [p[0][1] - posted for p in points.values()]
    t16 = [next(t for n, t in p if n >= MIN_TOKENS) - posted for p in points.values()]
    last = [p[-1][1] - posted for p in points.values()]
    return {"first_med": statistics.median(first), "first_max": max(first), "t16_med": statistics.median(t16),
            "last_med": statistics.median(last), "last_max": max(last), "done": done, "states": sorted(set(states)),
            "verdict_wait_ms": verdict_wait_ms(points, marks) if det else None,
            "counters": {k: after[k] - before[k] for k in COUNTERS}}


def run(url: str, prompts: dict, tokens: int, reps: int) -> list[dict]:
    other = prompts["other"]
    repeated = [other[i % len(other)] for i in range(ROWS)]
    distinct = (prompts["det"] + prompts["other"] + prompts["prefix"])[:ROWS]
    plan = [("warm-up", repeated, 1, 0.0, True), ("back to back", repeated, reps, 0.0, True),
            ("after a pause", repeated, reps, PAUSE_S, True), ("distinct, back to back", distinct, reps, 0.0, True),
            ("distinct, after a pause", distinct, reps, PAUSE_S, True),
            ("plain, back to back", repeated, 2, 0.0, False), ("plain, distinct", distinct, 2, 0.0, False)]
    out = []
    for name, rows, n, pause, det in plan:
        for i in range(n):
            time.sleep(pause)
            b = {"pattern": name, "i": i, **batch(url, rows, tokens, det)}
            out.append(b)
            wait = f"verdict {b['verdict_wait_ms']:.0f} ms after the last chunk, " if det else ""
            print(f"{name} #{i}: first chunk {b['first_med']:.3f} s (max {b['first_max']:.3f}), last "
                  f"{b['last_med']:.3f} s, {wait}{b['counters']['mg_verify_seconds_count']:.0f} verify calls, "
                  f"{b['counters']['mg_rollbacks_total']:.0f} rollbacks", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, default=Path(__file__).resolve().parent / "data" / "gpu_prompts.json")
    ap.add_argument("--url")
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--tau", type=float)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    if (args.url is None) == (args.checkpoint is None) or (args.checkpoint is None) != (args.tau is None):
        ap.error("give --url (a running server), or --checkpoint with --tau")
    if args.tokens < MIN_TOKENS:
        ap.error(f"--tokens must be at least {MIN_TOKENS}")
    prompts = json.loads(args.prompts.read_text())
    srv = None
    if args.checkpoint is not None:
        import gpu_e2e as E

        srv = E.start(args.checkpoint, "smol", "margin", args.out.parent,
                      ["--mg-tau", str(args.tau), *E.mem_flags("smol")], "cuda")
    try:
        res = run(srv.url if srv else args.url, prompts, args.tokens, args.reps)
    finally:
        if srv is not None:
            srv.stop()
    server = {"url": args.url} if args.url else {"checkpoint": str(args.checkpoint), "tau": args.tau}
    args.out.write_text(json.dumps({"tokens": args.tokens, "rows": ROWS, "pause_s": PAUSE_S, "server": server,
                                    "batches": res}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
