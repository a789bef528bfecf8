"""What a deterministic bs-8 decode step waits for: a torch-profiler timeline of SGLang's scheduler
process (both CUDA streams' kernels and the CUDA API calls; with CPU activity also the scheduler
loop's phases and mg's calls), per server configuration, reduced to a per-step table.

    python benchmarks/step_timeline.py --out DIR --checkpoint /tmp/mg-models/smol-real \
        [--configs plain,lag,lag-host] [--steps 120] [--activities GPU | CPU,GPU]
    python benchmarks/step_timeline.py --out DIR --configs plain,lag,lag-host --events 8   # CUDA events
    python benchmarks/step_timeline.py --analyze DIR/trace-plain/events.json,...  # the table again

Per configuration: one server (gpu_e2e.start), bodies of 8 requests of 128 tokens kept coming,
then SGLang's own /start_profile for `--steps` forwards. With CPU activity the server also runs
under MG_PROF=trace (benchmarks/prof_site: SGLang's receive / next batch / run batch / process
result and mg's seam, controller and verifier calls become profiler ranges). Never with Python
stacks: that tracer would slow the host several times over.

A step is one CUDA-graph launch on SGLang's stream (its decode forward), to the next one. Per
step: SGLang's stream busy and idle time, its idle time before the next graph and how late the
host launched that graph, the verifier's stream busy time (the stream running mg's kernels) and
how much of it ran beside SGLang's kernels; means over all steps and over the steps with verifier
work. The profiler costs time itself (measured on the H100: plain SGLang's bs-8 step 3.7 ms
unprofiled, 4.7 ms GPU-only, 4.5 ms with CPU activity), so read the shape, not the absolute
numbers (benchmarks/results/gpu/HISTORY.md, "Fused prologue matmuls, and what one verify call
costs a bs-8 step").
"""

from __future__ import annotations

import argparse
import bisect
import collections
import gzip
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import shutil

import requests

HERE = Path(__file__).resolve().parent
CONFIGS = {  # name -> (mg mode, serve flags); tau 0.245557 gave 9.8 % triggers at bs 8 (real SmolLM2)
    "plain": ("off", []),
    "window-tau0": ("margin", ["--mg-tau", "0"]),  # checks by window only
    "window": ("margin", ["--mg-tau", "0.245557"]),
}
# the verifier's kernels (mg_server.kernels; the seam's decide/gate kernels run on SGLang's stream)
MG_KERNELS = ("_matmul_tma_kernel", "_matmul_kernel", "_rms_kernel", "_rope_store_kernel", "_silu_mul_kernel",
              "_attn_", "_top2_kernel", "_prologue_matmul_kernel")
GO = "/tmp/mgprof_events_go"  # mgprof_events records only while this file exists
PHASES = ("s_recv", "s_next_batch", "s_run_batch", "s_process_result")
MG_RANGES = ("client_step", "client_report", "wait_host", "v_direct_call", "v_graph_run", "drain")


def _events(path: Path) -> list[dict]:
    raw = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()
    return [e for e in json.loads(raw)["traceEvents"] if e.get("ph") == "X" and "dur" in e]


def _span(ev: dict) -> tuple[float, float]:
    return float(ev["ts"]), float(ev["ts"]) + float(ev["dur"])


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the intersection of two sorted lists of disjoint intervals (µs)."""
    i = j = 0
    tot = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        tot += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return tot


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def analyze(path: Path) -> dict:
    """The per-step table of one trace (module doc). A step is one CUDA-graph launch whose
    kernels run on the main stream (SGLang's decode forward); the scheduler-loop ranges are
    used when the trace has them (CPU activity on)."""
    evs = _events(path)
    ranges = collections.defaultdict(list)  # "s_run_batch" ... -> [(t0, t1, tid)]
    for e in evs:
        if e.get("cat") == "user_annotation" and e["name"].startswith("mg:"):
            ranges[e["name"][3:]].append((*_span(e), e.get("tid")))
    launches, graph_calls = {}, []  # correlation -> (host time of the launch call, tid); graph launches
    for e in evs:
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = (float(e["ts"]), e.get("tid"))
            if e["name"] == "cudaGraphLaunch":
                graph_calls.append(e["args"]["correlation"])
    kernels = collections.defaultdict(list)  # stream -> [(t0, t1, correlation)]
    mg_time = collections.Counter()  # stream -> time in mg's verifier kernels
    for e in evs:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            a = e.get("args", {})
            st = a.get("stream", e.get("tid"))
            kernels[st].append((*_span(e), a.get("correlation")))
            if e["name"].startswith(MG_KERNELS):
                mg_time[st] += float(e["dur"])
    busy = {s: sum(k[1] - k[0] for k in ks) for s, ks in kernels.items()}
    if not busy:
        raise SystemExit(f"{path}: no kernels (GPU activity off?)")
    # the verifier's stream: the one running most of mg's kernels; SGLang's: the busiest other one
    vstream = mg_time.most_common(1)[0][0] if mg_time and mg_time.most_common(1)[0][1] > 0.5 * busy[
        mg_time.most_common(1)[0][0]] else None
    main = max((s for s in busy if s != vstream), key=busy.get)
    mk = sorted(kernels[main])
    main_spans = _union([(a, b) for a, b, _ in mk])
    vk = _union([(a, b) for a, b, _ in kernels.get(vstream, [])])
    by_corr = collections.defaultdict(list)
    for k in mk:
        by_corr[k[2]].append(k)
    graphs = sorted((min(k[0] for k in by_corr[c]), max(k[1] for k in by_corr[c]), launches[c][0], launches[c][1])
                    for c in set(graph_calls) if c in by_corr)  # (GPU start, GPU end, host launch, tid)
    if len(graphs) < 3:
        raise SystemExit(f"{path}: fewer than three decode graphs on the main stream")
    sched_tid = graphs[0][3]
    ends = [b for _, b in main_spans]
    rows = []
    for cur, nxt in zip(graphs, graphs[1:]):
        lo, hi = cur[0], nxt[0]  # one step: this graph's start to the next one's
        m_in = [(max(a, lo), min(b, hi)) for a, b in main_spans if b > lo and a < hi]
        v_in = [(max(a, lo), min(b, hi)) for a, b in vk if b > lo and a < hi]
        i = bisect.bisect_left(ends, hi) - 1  # the main stream's last busy span before the next graph
        idle_before = max(0.0, hi - ends[i]) if i >= 0 else 0.0
        host = {p: sum(max(0.0, min(b, hi) - max(a, lo)) for a, b, t in ranges.get(p, []) if t == sched_tid)
                for p in PHASES + MG_RANGES}
        rows.append({
            "period_us": hi - lo, "main_busy_us": sum(b - a for a, b in m_in),
            "main_idle_us": (hi - lo) - sum(b - a for a, b in m_in),
            "idle_before_next_graph_us": idle_before,
            # the next graph was launched after the stream went idle: the step waited for the host
            "next_launch_late_us": max(0.0, min(nxt[2], hi) - (hi - idle_before)) if idle_before > 5 else 0.0,
            "verifier_busy_us": sum(b - a for a, b in v_in),
            "verifier_beside_main_us": _overlap(v_in, m_in),
            **{f"host_{k}_us": v for k, v in host.items() if ranges.get(k)}})
    med = statistics.median(r["period_us"] for r in rows)
    steady = [r for r in rows if r["period_us"] < 3 * med]  # decode only: prefill-like outliers out

    def mean(rs):
        return {k: round(statistics.fmean(r[k] for r in rs), 1) for k in rs[0]} if rs else {}
    with_v = [r for r in steady if r["verifier_busy_us"] > 0]
    return {"trace": str(path), "streams": {"main": main, "verifier": vstream},
            "steps": len(steady), "dropped": len(rows) - len(steady), "mean_per_step": mean(steady),
            "mean_per_step_with_verifier": mean(with_v),
            "mean_per_step_without_verifier": mean([r for r in steady if r["verifier_busy_us"] == 0]),
            "steps_with_verifier": len(with_v),
            "steps_with_gap_over_20us": sum(r["idle_before_next_graph_us"] > 20 for r in steady)}


def _pairs(log: list, name: str) -> list[tuple]:
    """b/e entries of `name` paired per thread -> [(thread, stream, host_b, gpu_b, host_e, gpu_e)]."""
    open_, out = {}, []
    for n, ph, h, g, st, tid in log:
        if n != name:
            continue
        if ph == "b":
            open_.setdefault(tid, []).append((st, h, g))
        elif open_.get(tid):
            st0, h0, g0 = open_[tid].pop()
            out.append((tid, st0, h0, g0, h, g))
    return sorted(out, key=lambda x: x[2])


def analyze_events(path: Path) -> dict:
    """The per-step table of one mgprof_events dump (module doc: --events)."""
    log = json.loads(path.read_text())["log"]
    graphs = [x for x in _pairs(log, "graph") if x[3] is not None and x[5] is not None]
    if not graphs:
        raise SystemExit(f"{path}: no graph replays")
    # SGLang's decode graphs: one per step, launched by the scheduler thread (the one running
    # run_batch); with --mg-verify-ahead another thread launches more verifier graphs than that
    threads = collections.Counter(x[0] for x in _pairs(log, "run_batch"))
    sched = threads.most_common(1)[0][0] if threads else collections.Counter(x[0] for x in graphs).most_common(1)[0][0]
    main = collections.Counter(x[1] for x in graphs if x[0] == sched).most_common(1)[0][0]
    sg = [x for x in graphs if x[1] == main]
    vg = [x for x in graphs if x[1] != main]
    host = {n: [(x[2], x[4]) for x in _pairs(log, n) if x[0] == sched]
            for n in ("run_batch", "process_result", "recv", "next_batch", "drain", "mg_launch", "step_call",
                      "wait_published")}
    host["ahead_call"] = [(x[2], x[4]) for x in _pairs(log, "ahead_call")]  # (its own thread: --mg-verify-ahead)
    rows = []
    for cur, nxt in zip(sg, sg[1:]):
        lo, hi = cur[3], nxt[3]
        v_in = [(max(x[3], lo), min(x[5], hi)) for x in vg if x[5] > lo and x[3] < hi]
        rows.append({
            "period_ms": hi - lo, "graph_ms": cur[5] - cur[3], "after_graph_ms": hi - cur[5],
            # how long the next launch waited for earlier work on the stream: ~0 -> the stream sat
            # idle until the host launched it (the step waited for the host)
            "next_launch_waited_ms": max(0.0, hi - nxt[2]),
            "host_bound": 1.0 if hi - nxt[2] < 0.05e-3 else 0.0,
            "verifier_graphs": len(v_in), "verifier_gpu_ms": sum(b - a for a, b in v_in),
            "verifier_beside_graph_ms": sum(max(0.0, min(b, cur[5]) - max(a, cur[3])) for a, b in v_in),
            **{f"host_{n}_ms": sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in iv) for n, iv in host.items()}})
    rows = [{k: v * 1e3 if k.endswith("_ms") else v for k, v in r.items()} for r in rows]  # s -> ms
    med = statistics.median(r["period_ms"] for r in rows)
    steady = [r for r in rows if r["period_ms"] < 3 * med]

    def mean(rs):
        return {k: round(statistics.fmean(r[k] for r in rs), 3) for k in rs[0]} if rs else {}
    with_v = [r for r in steady if r["verifier_graphs"]]
    # the seam's verify calls (Step calls with exactly one verifier graph inside): host work before
    # the graph's launch, the graph on the GPU, host work after it until the call returns
    calls = []
    for tid, _, b, _, e, _ in _pairs(log, "step_call"):
        inside = [x for x in vg if b <= x[2] <= e]
        if len(inside) == 1:
            x = inside[0]
            calls.append({"call_ms": e - b, "before_graph_ms": x[2] - b, "graph_gpu_ms": x[5] - x[3],
                          "after_graph_ms": e - x[5]})
    call_med = {k: round(1e3 * statistics.median(c[k] for c in calls), 3) for k in calls[0]} if calls else {}
    return {"dump": str(path), "steps": len(steady), "dropped": len(rows) - len(steady),
            "verify_calls": len(calls), "verify_call_median": call_med,
            "mean_per_step": mean(steady), "mean_per_step_with_verifier": mean(with_v),
            "mean_per_step_without_verifier": mean([r for r in steady if not r["verifier_graphs"]]),
            "steps_with_verifier": len(with_v)}


def table_events(results: dict) -> str:
    cols = [(n, p) for n in results for p in ("mean_per_step", "mean_per_step_with_verifier",
                                              "mean_per_step_without_verifier") if results[n].get(p)]
    head = {"mean_per_step": "", "mean_per_step_with_verifier": ", verifier steps",
            "mean_per_step_without_verifier": ", other steps"}
    keys = list(results[cols[0][0]][cols[0][1]]) if cols else []
    lines = ["| per step (mean) | " + " | ".join(n + head[p] for n, p in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {k} | " + " | ".join(str(results[n][p].get(k, "")) for n, p in cols) + " |" for k in keys]
    calls = [n for n in results if results[n].get("verify_call_median")]
    if calls:
        lines += ["", "| seam's verify call (median ms) | " + " | ".join(calls) + " |", "|---" * (len(calls) + 1) + "|"]
        lines += [f"| {k} | " + " | ".join(str(results[n]["verify_call_median"][k]) for n in calls) + " |"
                  for k in results[calls[0]]["verify_call_median"]]
    lines.insert(len(keys) + 2, "| steps | " + " | ".join(str(results[n]["steps"] if p == "mean_per_step" else
                                                 results[n]["steps_with_verifier"] if "with_v" in p else
                                                 results[n]["steps"] - results[n]["steps_with_verifier"])
                                             for n, p in cols) + " |")
    return "\n".join(lines)


def table(results: dict) -> str:
    keys = ["period_us", "main_busy_us", "main_idle_us", "idle_before_next_graph_us", "next_launch_late_us",
            "verifier_busy_us", "verifier_beside_main_us", *[f"host_{p}_us" for p in PHASES + MG_RANGES]]
    cols = [(n, part) for n in results for part in ("mean_per_step", "mean_per_step_with_verifier")
            if results[n].get(part)]
    lines = ["| per step (mean µs) | " + " | ".join(n + ("" if p == "mean_per_step" else ", verifier steps")
                                                 for n, p in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for k in keys:
        if any(k in results[n][p] for n, p in cols):
            lines.append(f"| {k} | " + " | ".join(str(results[n][p].get(k, "")) for n, p in cols) + " |")
    names = list(results)
    lines.append("| steps (verifier ran / gap > 20 µs) | " + " | ".join(
        f"{results[n]['steps']} ({results[n]['steps_with_verifier']} / {results[n]['steps_with_gap_over_20us']})"
        for n in names) + " |")
    return "\n".join(lines)


def run(args) -> None:
    sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]  # gpu_e2e, and its server_util
    import gpu_e2e as E
    import gpu_sweep as S

    acts = args.activities.split(",")
    if args.events:  # the CUDA-event timeline (prof_site/mgprof_events.py) instead of the profiler
        os.environ["MG_PROF"] = "events"
        os.environ["PYTHONPATH"] = f"{HERE / 'prof_site'}:{os.environ.get('PYTHONPATH', '')}"
    elif "CPU" in acts:  # the scheduler loop's phases and mg's calls as profiler ranges
        os.environ["MG_PROF"] = "trace"
        os.environ["PYTHONPATH"] = f"{HERE / 'prof_site'}:{os.environ.get('PYTHONPATH', '')}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(E.PROMPTS_FILE.read_text())["other"]
    results, step_ms = {}, {}
    for name in args.configs.split(","):
        mode, flags = CONFIGS[name]
        tdir = out / f"trace-{name}"
        tdir.mkdir(exist_ok=True)
        if args.events:
            shutil.rmtree("/tmp/mgprof_events", ignore_errors=True)
            Path(GO).unlink(missing_ok=True)
        srv = E.start(Path(args.checkpoint), "smol", mode, out, flags + E.mem_flags("smol"), "cuda")
        n_det, times, stop = (0 if mode == "off" else 8), [], threading.Event()

        t = threading.Thread(target=S.keep_bodies, args=(srv.url, prompts, n_det, stop, times), daemon=True)
        try:
            t.start()
            time.sleep(args.warm_s)  # past the first bodies (compiles, prefix cache)
            if args.events:  # record from now on (mgprof_events.GO), for that long, then two dumps more
                Path(GO).touch()
                time.sleep(args.events + 4.5)
            else:
                r = requests.post(srv.url + "/start_profile", json={
                    "output_dir": str(tdir), "num_steps": args.steps, "activities": acts,
                    "with_stack": False, "record_shapes": False}, timeout=60)
                E.log(f"{name}: start_profile {r.status_code} {r.text[:200]}")
                deadline = time.time() + 120
                while time.time() < deadline and not list(tdir.glob("*.trace.json*")):
                    time.sleep(1)
                time.sleep(3)  # (the export finishes writing)
        finally:
            stop.set()
            t.join(120)
            srv.stop()
        step_ms[name] = [round(1e3 * x / 128, 3) for x in times if x]
        if args.events:
            res = []
            for f in Path("/tmp/mgprof_events").glob("*.json"):
                try:
                    res.append(analyze_events(f))
                except SystemExit:
                    continue  # (a process without decode graphs)
                except json.JSONDecodeError as e:  # (a dump cut short by an older mgprof_events)
                    E.log(f"{name}: {f} unreadable ({e}); skipped")
            if not res:
                E.log(f"{name}: no event dump with graph replays")
                continue
            results[name] = max(res, key=lambda r: r["steps"])
            shutil.copy(results[name]["dump"], tdir / "events.json")
            results[name]["body_ms_per_token"] = step_ms[name]
            E.log(f"{name}: {json.dumps(results[name]['mean_per_step'])}")
            continue
        traces = sorted(tdir.glob("*.trace.json*"))
        if not traces:
            E.log(f"{name}: no trace written")
            continue
        try:
            results[name] = analyze(traces[-1])
        except SystemExit as e:  # (the trace stays in DIR for --analyze)
            E.log(f"{name}: {e}")
            continue
        results[name]["body_ms_per_token"] = step_ms[name]
        E.log(f"{name}: {json.dumps(results[name]['mean_per_step'])}")
    (out / "step_timeline.json").write_text(json.dumps(results, indent=1))
    text = table_events(results) if args.events else table(results)
    (out / "step_timeline.md").write_text(text + "\n")
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--analyze", help="saved traces (.trace.json[.gz]) or event dumps (events.json), comma-separated")
    ap.add_argument("--checkpoint", default="/tmp/mg-models/smol-real")
    ap.add_argument("--configs", default="plain,window")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--warm-s", type=float, default=10.0)
    ap.add_argument("--events", type=float, default=0.0,
                    help="SECONDS: record a CUDA-event timeline (benchmarks/prof_site/mgprof_events.py) for that "
                         "long instead of a profiler trace")
    ap.add_argument("--activities", default="GPU",
                    help="GPU (kernels and CUDA API calls only: the host runs near full speed) or CPU,GPU (adds "
                         "the scheduler's phases and mg's calls, but CPU-op recording slowed the plain step from "
                         "3.7 to 4.5 ms on the H100)")
    args = ap.parse_args()
    if args.analyze:  # one table over the files, each named by its folder (trace-NAME) or file
        files = [Path(f) for f in args.analyze.split(",")]
        ev = not files[0].name.endswith((".gz", ".trace.json"))
        res = {f.parent.name.removeprefix("trace-") if f.parent.name.startswith("trace-") else f.name:
               (analyze_events if ev else analyze)(f) for f in files}
        print(json.dumps(res, indent=1))
        print(table_events(res) if ev else table(res))
    elif args.out:
        run(args)
    else:
        ap.error("--out or --analyze")


if __name__ == "__main__":
    main()
