"""Bounded soak of a real mg-server (not in CI): mixed Locust traffic for >= 5 minutes.

Starts `mg-server serve` (loopback), computes the verifier-alone references of a small
deterministic prompt set, runs benchmarks/soak_locustfile.py headless (deterministic requests,
plain chat and penalty requests, random client disconnects, /abort_request aborts, bad bodies
and grammar requests) and samples the server meanwhile: /health, its shared-memory segments,
its temp folders (and the files in them), the open files of its process tree. Writes JSON and
exits non-zero if any check fails:
- 0 unexpected statuses (any 5xx; any status a request kind must not get),
- 0 `verified` answers that differ from their reference,
- /health 200 at every sample, the server process alive throughout,
- no growth of /dev/shm segments, temp folders or open files (last sample vs the first after
  warm-up, open files with a small slack for connection churn).

    python benchmarks/soak.py --minutes 5 --out benchmarks/results/soak_cpu.json

`--burst N` runs a burst instead of Locust: N deterministic requests at once (the prompt set's
prompts in turn), then N more and a SIGTERM while they run. Checks: every request ends with an
HTTP status (none lost to a reset connection), every `verified` answer equals its reference,
/health answers within 1 s at every sample (a 503 once the drain began), the server stops within
its drain bound. Reports throughput and latency percentiles of the first burst.

    python benchmarks/soak.py --burst 200 --out benchmarks/results/burst_cpu.json

On a GPU host, `--device cuda --model DIR --server-args "..."` (references from the GPU verifier).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import requests

from mg_server.evaluation.server_process import ServerProcess

HERE = Path(__file__).resolve().parent

FD_SLACK = 16  # open files may differ by in-flight connections at the moment of sampling


def sample(srv: ServerProcess) -> dict:
    pid = srv.proc.pid
    try:
        health = requests.get(srv.url + "/health", timeout=10).status_code
    except requests.RequestException:
        health = 0
    dirs = glob.glob(os.path.join(tempfile.gettempdir(), f"mg-*-{srv.port}-{pid}-*"))
    by_proc: dict[str, int] = {}
    try:
        procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        try:
            name = (p.cmdline() or ["?"])[0].rsplit("/", 1)[-1]
            by_proc[name] = by_proc.get(name, 0) + p.num_fds()
        except psutil.Error:
            pass
    fds = sum(by_proc.values())
    return {"t": round(time.monotonic(), 1), "health": health, "alive": srv.proc.poll() is None,
            "shm": len(os.listdir("/dev/shm")), "temp_dirs": len(dirs),
            "temp_files": sum(len(files) for d in dirs for _, _, files in os.walk(d)), "open_files": fds,
            "open_files_by_process": by_proc, "processes": len(procs)}


# ---- --burst ----------------------------------------------------------------------------------
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--model", help="checkpoint folder (default: the embedded SmolLM2); passed to the server too")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="the server's and the references' device (the references must come from the same kernels)")
    ap.add_argument("--out", type=Path, default=Path("bench-out/soak.json"))
    ap.add_argument("--burst", type=int, default=0, help="a burst of N deterministic requests and a SIGTERM "
                                                         "under load instead of the Locust soak")
    ap.add_argument("--drain", type=float, default=30.0, help="--burst: the server's --mg-drain-timeout")
    args = ap.parse_args()

    from mg_server.evaluation.determinism import build_workload
    from mg_server.model.prepare import prepare_model
    from mg_server.prompts import sharegpt_prompts

    model = args.model or str(prepare_model(progress=False))
    args.server_args = f"--model {model} --device {args.device} {args.server_args}"
    t0 = time.monotonic()
    w = build_workload(model, args.prompts, args.max_new, device=args.device)
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    work = tempfile.mkdtemp(prefix="mg-soak-")
    wl = Path(work) / "workload.json"
    wl.write_text(json.dumps({"det": w.det, "refs": w.refs, "max_new": args.max_new, "vocab": vocab,
                              "other_texts": sharegpt_prompts(16, seed=3)}))
    print(f"references of {args.prompts} prompts in {time.monotonic() - t0:.0f}s", flush=True)

    if args.burst:
        return run_burst(args, w, work)
    srv = ServerProcess(args.server_args.split(), Path(work) / "server.log")
    samples: list[dict] = []
    stop = threading.Event()
    try:
        srv.wait_ready()
        print("server ready", flush=True)
        requests.post(srv.url + "/generate", json={"input_ids": w.det[0], "sampling_params": {"max_new_tokens": 2}},
                      headers={"X-Deterministic": "1"}, timeout=120)  # warm-up: segments and files exist

        def sampler():
            while not stop.wait(2.0):
                samples.append(sample(srv))

        time.sleep(15)  # idle after the warm-up, as at the end
        first = sample(srv)
        threading.Thread(target=sampler, daemon=True).start()
        result = Path(work) / "locust.json"
        env = {**os.environ, "MG_SOAK_WORKLOAD": str(wl), "MG_SOAK_RESULT": str(result)}
        locust = Path(sys.executable).with_name("locust")
        cmd = [str(locust), "-f", str(HERE / "soak_locustfile.py"), "--headless", "-u", str(args.users),
               "-r", str(args.users), "--run-time", f"{int(args.minutes * 60)}s", "--stop-timeout", "30",
               "--host", srv.url, "--csv", str(Path(work) / "soak"), "--only-summary", "--loglevel", "WARNING"]
        t1 = time.monotonic()
        subprocess.run(cmd, env=env, check=False, timeout=args.minutes * 60 + 300)
        ran_s = time.monotonic() - t1
        time.sleep(15)  # idle: aborted/disconnected requests end, kept-alive connections close
        last = sample(srv)
        stop.set()
        traffic = json.loads(result.read_text())
        stats_csv = (Path(work) / "soak_stats.csv").read_text()
    finally:
        stop.set()
        srv.stop()
    samples = [first] + samples + [last]
    half = samples[len(samples) // 2]
    unexpected = sum(traffic["unexpected"].values())
    fivexx = sum(n for k, n in traffic["status"].items() if k.split()[-1].startswith("5"))
    checks = {
        "unexpected_statuses": unexpected == 0,
        "unexpected_5xx": fivexx == 0,
        "verified_equal_reference": traffic["verified_mismatch"] == 0 and traffic["verified_compared"] > 0,
        "server_up_throughout": all(s["health"] == 200 and s["alive"] for s in samples),
        "no_shm_growth": last["shm"] <= first["shm"],
        "no_temp_growth": last["temp_dirs"] <= first["temp_dirs"] and last["temp_files"] <= first["temp_files"],
        # thread pools and connections warm up in the first minutes: growth is judged over the
        # second half of the run (the whole run's first -> last is reported too)
        "no_open_file_growth": last["open_files"] <= half["open_files"] + FD_SLACK,
        "ran_at_least_5_min": ran_s >= 300 or args.minutes < 5,
    }
    report = {
        "command": " ".join(["python", *sys.argv]), "minutes": args.minutes, "users": args.users,
        "locust_seconds": round(ran_s, 1), "checks": checks, "passed": all(checks.values()),
        "requests_by_kind_and_status": traffic["status"], "unexpected": traffic["unexpected"],
        "unexpected_examples": traffic["examples"], "deterministic_verdicts": traffic["verdicts"],
        "verified_compared": traffic["verified_compared"], "verified_mismatch": traffic["verified_mismatch"],
        "five_xx": fivexx,
        "resources": {"first": first, "half": half, "last": last,
                      "open_files_timeline": [[round(s["t"] - first["t"]), s["open_files"]] for s in samples[::5]],
                      "max": {k: max(s[k] for s in samples) for k in ("shm", "temp_dirs", "temp_files",
                                                                       "open_files", "processes")}},
        "samples": len(samples), "locust_stats_csv": stats_csv,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: report[k] for k in ("checks", "passed", "five_xx", "verified_compared",
                                             "verified_mismatch", "unexpected")}, indent=1))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
