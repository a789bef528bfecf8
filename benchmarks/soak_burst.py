"""`python benchmarks/soak.py --burst N`: N deterministic requests at once, then N more and a
SIGTERM under them; a module of soak.py (its docstring says what is checked), no command of its own."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from mg_server.evaluation.server_process import ServerProcess

DET = {"X-Deterministic": "1"}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def fire(url: str, w, n: int, max_new: int) -> list[dict]:
    """n deterministic /generate requests at once -> per request: status, verdict, seconds, match."""
    def one(i: int) -> dict:
        k = i % len(w.det)
        t0 = time.monotonic()
        try:
            r = requests.post(url + "/generate", headers=DET, timeout=900,
                              json={"input_ids": w.det[k], "sampling_params": {"max_new_tokens": max_new}})
        except requests.RequestException as e:
            return {"status": None, "error": repr(e)[:200], "s": time.monotonic() - t0}
        out = {"status": r.status_code, "verdict": r.headers.get("x-mg-verdict", ""), "s": time.monotonic() - t0}
        if r.status_code == 200 and out["verdict"] == "verified":
            out["equal"] = r.json()["output_ids"] == w.refs[k][:len(r.json()["output_ids"])]
        return out

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def health_sampler(url: str, stop: threading.Event, got: list) -> None:
    while not stop.wait(0.5):
        t0 = time.monotonic()
        try:
            status = requests.get(url + "/health", timeout=5).status_code
        except requests.RequestException:
            status = 0
        got.append((round(time.monotonic() - t0, 3), status))


def summary(rows: list[dict], wall: float, max_new: int) -> dict:
    by: dict[str, int] = {}
    for r in rows:
        key = f"{r['status']} {r.get('verdict', '')}".strip()
        by[key] = by.get(key, 0) + 1
    ok = [r for r in rows if r["status"] == 200]
    return {"requests": len(rows), "by_status_verdict": by, "lost": sum(r["status"] is None for r in rows),
            "verified_differing": sum(not r.get("equal", True) for r in rows),
            "verified": sum(r.get("verdict") == "verified" for r in rows), "wall_s": round(wall, 1),
            "tokens_per_s": round(len(ok) * max_new / wall, 1),
            "latency_s_p50": round(pct([r["s"] for r in ok], 0.5), 2),
            "latency_s_p99": round(pct([r["s"] for r in ok], 0.99), 2)}


def run_burst(args, w, work: str) -> int:
    srv = ServerProcess(["--mg-drain-timeout", str(args.drain), *args.server_args.split()], Path(work) / "server.log")
    health: list = []
    stop = threading.Event()
    try:
        srv.wait_ready()
        fire(srv.url, w, 2, 2)  # warm-up
        threading.Thread(target=health_sampler, args=(srv.url, stop, health), daemon=True).start()
        t0 = time.monotonic()
        first = summary(fire(srv.url, w, args.burst, args.max_new), time.monotonic() - t0, args.max_new)
        before_term = len(health)
        print("burst:", json.dumps(first), flush=True)
        box: dict = {}
        second = threading.Thread(target=lambda: box.update(rows=fire(srv.url, w, args.burst, args.max_new)))
        second.start()
        time.sleep(5)
        t_term = time.monotonic()
        os.kill(srv.proc.pid, signal.SIGTERM)
        second.join(args.drain + 120)
        srv.proc.wait(args.drain + 60)
        stopped_s = time.monotonic() - t_term
        stop.set()
        term = summary(box.get("rows", []), time.monotonic() - t_term, args.max_new)
    finally:
        stop.set()
        srv.stop()
    slow = [h for h in health if h[0] >= 1.0]
    checks = {"none_lost": first["lost"] == 0 and term["lost"] == 0,
              "verified_equal_reference": first["verified_differing"] == 0 and term["verified_differing"] == 0,
              "all_first_burst_verified": first["verified"] == args.burst,
              "health_within_1s": not slow,
              "health_200_before_sigterm": all(s == 200 for _, s in health[:before_term]),
              "stopped_within_drain_bound": stopped_s < args.drain + 15}
    report = {"command": " ".join(["python", *sys.argv]), "burst": args.burst, "max_new": args.max_new,
              "first_burst": first, "sigterm_burst": term, "stopped_s_after_sigterm": round(stopped_s, 1),
              "health_samples": len(health), "health_max_s": max((h[0] for h in health), default=0),
              "health_statuses": sorted({s for _, s in health}), "checks": checks, "passed": all(checks.values())}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    return 0 if report["passed"] else 1
