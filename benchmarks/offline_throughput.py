"""Offline throughput at a share of deterministic requests, and streaming latency, on one GPU:

    python benchmarks/offline_throughput.py --out DIR --tokenizer DIR [--model llama8b-planted]
        [--shares 0,0.02,0.1,0.5,1] [--tau-rate 0.1] [--stream-taus target,0] [--ab-tree DIR]

Throughput (the protocol of LLM-42, arXiv 2601.17768): --requests requests with ShareGPT-like
prompt and answer lengths (benchmarks/data/sharegpt_lengths.json), at most --concurrency in
flight, each its own /generate request, greedy, answers of exactly their length (ignore_eos);
the first request of every 1/share is deterministic (X-Deterministic: 1). Output tokens per
second over the whole run, on mg's server at each share beside plain SGLang (mg off) timed
alternately in the same minutes. A deterministic request answered in several runs (other shares,
so other batch neighbours) must give the same tokens every time: the run reports any that differ.

Streams: --stream-batch requests at once, half deterministic, streamed one token per chunk;
time to first token and inter-token gaps (p50, p99) of each half, at tau for --tau-rate (or a
given tau) and at tau 0 (nothing released before its check). A chunk of k tokens counts as k gaps
of its share of the wait, so a held burst shows as its average: the first hold shows in TTFT. JSON after each part and a table (OUT/throughput.{json,md}).

--ab-tree DIR: an A/B of two versions in one run. A second mg server runs DIR's mg_server (another
checkout of this repository, e.g. `git worktree add DIR REV`), and every rep times plain SGLang,
this tree's mg and DIR's mg ("mg_b") in turn (the order rotated each rep), so both versions meet
the same plain SGLang in the same minutes: run to run, plain SGLang drifted 5-16 % on one card.

--stacks DIR samples every server process's main thread (benchmarks/stacks), one file per process
and timed run ("mg-share1.0-rep0", "plain-share1.0-rep0", ...); `python benchmarks/stacks/sitecustomize.py DIR PHASE`
reads them. The sampler costs the runs a little: time ratios with it on, not throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gpu_e2e as E  # the sibling script is the shared harness (its folder is on sys.path when run)
from gpu_sweep import tau_for_rate_quantized

# mg's counters read around each share: rollbacks, and where the verifier's time went
DIAG = ("mg_rollbacks_total", "mg_verify_seconds_sum", "mg_verify_seconds_count", "mg_verify_rows_sum",
        "mg_verifier_forward_seconds_sum", "mg_control_seconds_sum", "mg_control_seconds_count", "mg_stale_steps_total",
        "mg_rollback_dropped_steps_total", "mg_lookahead_steps_total")
LENGTHS = E.REPO / "benchmarks" / "data" / "sharegpt_lengths.json"
STACKS = E.REPO / "benchmarks" / "stacks"  # the stack sampler (--stacks)
PHASE: Path | None = None  # --stacks: the file that names the timed run in progress


def workload(n: int) -> list[tuple[list[int], int]]:
    """n (prompt ids, answer length) pairs: ShareGPT's lengths, tokens from the benchmark prompts
    (the content does not matter to a random-weight model; the lengths set the work)."""
    pairs = json.loads(LENGTHS.read_text())["pairs"]
    pool = [t for p in json.loads(E.PROMPTS_FILE.read_text())["other"] for t in p]
    out = []
    for i in range(n):
        inp, new = pairs[i % len(pairs)]
        start = (i * 37) % len(pool)
        out.append(((pool[start:] + pool) [:inp], new))
    return out


def det_indices(n: int, share: float) -> set[int]:
    """Requests spread evenly through the run, round(share * n) of them."""
    k = round(share * n)
    return {round(j * n / k) for j in range(k)} if k else set()


def run_offline(url: str, work, det: set[int], concurrency: int, phase: str = "warm") -> dict:
    """Every request of `work` through the front, at most `concurrency` at once -> tokens/s,
    verdicts, errors and the deterministic answers. `phase` names the run for --stacks."""
    if PHASE is not None:
        PHASE.write_text(phase)
        time.sleep(0.1)  # (the samplers look every 2 ms)
    try:
        return _run_offline(url, work, det, concurrency)
    finally:
        if PHASE is not None:
            PHASE.write_text("idle")
            time.sleep(0.1)


def _run_offline(url: str, work, det: set[int], concurrency: int) -> dict:
    import requests

    answers: dict[int, list[int]] = {}
    verdicts: dict[str, int] = {}
    errors: list[str] = []
    lock = threading.Lock()

    latency: list[float] = []

    def one(i: int) -> None:
        ids, new = work[i]
        t_req = time.perf_counter()
        headers = {"X-Deterministic": "1"} if i in det else {}
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "ignore_eos": True, "temperature": 0}}
        try:
            r = requests.post(url + "/generate", json=body, headers=headers, timeout=900)
            r.raise_for_status()
            with lock:
                latency.append(time.perf_counter() - t_req)
            got = r.json()
            got = got[0] if isinstance(got, list) else got
            with lock:
                if i in det:
                    answers[i] = got["output_ids"]
                    v = r.headers.get("x-mg-verdict", "none")
                    verdicts[v] = verdicts.get(v, 0) + 1
        except Exception as e:  # noqa: BLE001 - counted and reported
            with lock:
                errors.append(f"{i}: {e!r}"[:300])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(work))))
    wall = time.perf_counter() - t0
    tokens = sum(new for _, new in work)
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens, "verdicts": verdicts,
            "errors": errors, "answers": answers, "latency_s_p50": pct(latency, 0.5) if latency else 0.0,
            "latency_s_p99": pct(latency, 0.99) if latency else 0.0}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run_streams(url: str, work, batch: int) -> dict:
    """`batch` streamed requests at once, the even ones deterministic: TTFT and inter-token gaps."""
    import requests

    from gpu_sweep import read_stream

    got: dict[int, tuple[float, list]] = {}
    errors: list[str] = []

    def one(i: int, t0: float) -> None:
        ids, _ = work[i]
        headers = {"X-Deterministic": "1"} if i % 2 == 0 else {}
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": 128, "ignore_eos": True, "temperature": 0, "stream_interval": 1}}
        try:
            with requests.post(url + "/generate", json=body, headers=headers, timeout=900, stream=True) as r:
                r.raise_for_status()
                points, _ = read_stream(r)
            got[i] = (t0, points.get(0, []))
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(f"{i}: {e!r}"[:300])

    t0 = time.perf_counter()
    jobs = [threading.Thread(target=one, args=(i, t0)) for i in range(batch)]
    for j in jobs:
        j.start()
    for j in jobs:
        j.join()
    res: dict = {"errors": errors}
    for kind, rows in (("det", [v for i, v in got.items() if i % 2 == 0]), ("plain", [v for i, v in got.items() if i % 2])):
        ttft, gaps = [], []
        for start, pts in rows:
            if not pts:
                continue
            ttft.append(pts[0][1] - start)
            for (n0, t0_), (n1, t1) in zip(pts, pts[1:]):
                if n1 > n0:  # (an event without new tokens adds no gap)
                    gaps += [(t1 - t0_) / (n1 - n0)] * (n1 - n0)  # a chunk of k tokens: k gaps of its share
        if ttft:
            res[kind] = {"ttft_ms_p50": 1e3 * pct(ttft, 0.5), "ttft_ms_p99": 1e3 * pct(ttft, 0.99),
                         "itl_ms_p50": 1e3 * pct(gaps, 0.5), "itl_ms_p99": 1e3 * pct(gaps, 0.99),
                         "itl_ms_mean": 1e3 * statistics.fmean(gaps), "rows": len(ttft)}
    return res


def table(res: dict) -> str:
    lines = [f"# Offline throughput and streaming latency ({res['model']}, {res['device']})", "",
             f"{res['requests']} requests, ShareGPT-like lengths (mean prompt {res['mean_prompt']:.0f}, answer "
             f"{res['mean_answer']:.0f} tokens), at most {res['concurrency']} in flight; tau {res['tau']:.4g} "
             f"(trigger target {res['tau_rate']}); median of {res['reps']} reps, plain SGLang timed alternately.", ""]
    if res["throughput"]:
        lines += ["| deterministic share | plain tok/s | mg tok/s | mg / plain | verdicts | errors | rollbacks |",
                  "|---|---|---|---|---|---|---|"]
    for s in res["throughput"]:
        lines.append(f"| {s['share']:.0%} | {s['plain_tok_s']:.0f} | {s['mg_tok_s']:.0f} | {s['ratio']:.3f} | "
                     f"{s['verdicts']} | {s['errors']} | {s['rollbacks']:.0f} |")
        if "mg_b_tok_s" in s:
            lines.append(f"| {s['share']:.0%}, --ab-tree | | {s['mg_b_tok_s']:.0f} | {s['ratio_b']:.3f} | "
                         f"{s['verdicts_b']} | | {s['rollbacks_b']:.0f} |")
    if res.get("sglang_det"):
        d = res["sglang_det"]
        lines.append(f"| SGLang deterministic mode (all) | | {d['tok_s']:.0f} | {d['ratio']:.3f} | | | |")
    if res["throughput"]:
        lines += ["", f"Deterministic answers that differed between runs: {res['differing_answers']} of "
                  f"{res['repeated_answers']} answered more than once.", ""]
    if res.get("streams"):
        lines += [f"Streams: {res['stream_batch']} at once, half deterministic, one token per chunk, 128 tokens.", "",
                  "| tau | rows | TTFT p50 / p99 ms | ITL p50 / p99 ms | ITL mean ms |", "|---|---|---|---|---|"]
        for st in res["streams"]:
            for kind in ("det", "plain"):
                if kind in st:
                    x = st[kind]
                    lines.append(f"| {st['tau']:.4g} | {kind} | {x['ttft_ms_p50']:.1f} / {x['ttft_ms_p99']:.1f} | "
                                 f"{x['itl_ms_p50']:.1f} / {x['itl_ms_p99']:.1f} | {x['itl_ms_mean']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out/throughput"))
    ap.add_argument("--wheels", type=Path)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--model", default="llama8b-planted", choices=sorted(E.SHAPES))
    ap.add_argument("--models-dir", default="/tmp/mg-models")
    ap.add_argument("--checkpoint", help="a real checkpoint of --model's shape instead of random weights (e.g. "
                                         "the SmolLM2 of `benchmarks/device.sh smol`)")
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=60)
    ap.add_argument("--shares", default="0,0.02,0.1,0.5,1")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tau-rate", type=float, default=0.1, help="tau: this share of the reference bf16 margins below it")
    ap.add_argument("--stream-batch", type=int, default=16)
    ap.add_argument("--stream-taus", default="target,0", help="'target' (--tau-rate's tau) and/or numbers; '' skips")
    ap.add_argument("--sglang-det", action="store_true",
                    help="also time SGLang's --enable-deterministic-inference (mg off) on the same requests")
    ap.add_argument("--ab-tree", type=Path, help="time a second mg from this checkout in the same reps (module doc)")
    ap.add_argument("--stacks", type=Path, help="sample the servers' stacks into this folder (module doc)")
    args = ap.parse_args()
    E.setup_python(args.wheels)
    if args.stacks:  # before any server starts: its processes inherit both
        global PHASE
        args.stacks.mkdir(parents=True, exist_ok=True)
        PHASE = args.stacks / "phase"
        os.environ["STACK_SAMPLES_DIR"] = str(args.stacks.resolve())
        os.environ["PYTHONPATH"] = os.pathsep.join([str(STACKS), os.environ.get("PYTHONPATH", "")])
    args.tokenizer = args.tokenizer or E._default_tokenizer()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    name = args.model
    mdir = Path(args.checkpoint) if args.checkpoint else E.write_model(name, Path(args.models_dir) / name, args.tokenizer)
    prompts = json.loads(E.PROMPTS_FILE.read_text())
    refs = E.references(mdir, prompts, 64, args.out / f"refs-{name}.json", "cuda")
    margins = [m for key in ("det", "prefix") for row in refs[key + "_margins_bf16"] for m in row]
    tau, _ = tau_for_rate_quantized(margins, args.tau_rate)
    work = workload(args.requests)
    shares = [float(s) for s in args.shares.split(",") if s]
    mem = E.mem_flags(name)
    res = {"model": name, "device": torch.cuda.get_device_name(0), "requests": args.requests,
           "concurrency": args.concurrency, "mean_prompt": statistics.fmean(len(w[0]) for w in work),
           "mean_answer": statistics.fmean(w[1] for w in work), "tau": tau, "tau_rate": args.tau_rate,
           "reps": args.reps, "throughput": [], "streams": [], "stream_batch": args.stream_batch}
    from mg_server.evaluation.determinism import scrape

    def mg(tau_value: float, tree: Path | None = None):
        return E.start(mdir, name, "margin", args.out, ["--mg-tau", f"{tau_value:.6g}", *mem], "cuda", graph_bs, tree)

    # CUDA graphs up to the concurrency: past them SGLang's bare-host eager decode of the 8B shape
    # ran at ~80 ms a step (730 tokens/s at 60 requests), which would hide any verifier cost
    graph_bs = max(32, args.concurrency)
    stream_taus = [tau if spec == "target" else float(spec) for spec in args.stream_taus.split(",") if spec]
    base = E.start(mdir, name, "off", args.out, mem, "cuda", graph_bs) if shares else None
    srv_tau = tau if shares or not stream_taus else stream_taus[0]
    srv = mg(srv_tau)
    srv_b = mg(srv_tau, args.ab_tree) if args.ab_tree and shares else None
    mgs = [("mg", srv), *([("mg_b", srv_b)] if srv_b else [])]
    seen: dict[str, dict[int, list[int]]] = {k: {} for k, _ in mgs}  # each version's answers, by request
    differing = repeated = 0
    if srv_b:
        res["ab_tree"] = str(args.ab_tree)
    try:
        if base:
            run_offline(base.url, work[:16], set(), 16)  # warm all
            for _, s in mgs:
                run_offline(s.url, work[:16], set(range(16)), 16)
        for share in shares:
            det = det_indices(len(work), share)
            tok: dict[str, list[float]] = {"plain": [], **{k: [] for k, _ in mgs}}
            mg_wall, mg_latency = [], []
            before = {k: scrape(s.url, DIAG) for k, s in mgs}
            verdicts: dict[str, dict[str, int]] = {k: {} for k, _ in mgs}
            errors = 0
            for rep in range(args.reps):
                order = [("plain", base, set()), *((k, s, det) for k, s in mgs)]
                for kind, s, d in order[rep % len(order):] + order[:rep % len(order)]:
                    r = run_offline(s.url, work, d, args.concurrency, f"{kind}-share{share}-rep{rep}")
                    tok[kind].append(r["tokens_per_s"])
                    if kind == "mg":
                        mg_wall.append(r["wall_s"])
                        mg_latency.append([r["latency_s_p50"], r["latency_s_p99"]])
                    errors += len(r["errors"])
                    if r["errors"]:
                        E.log(f"share {share}: {kind} errors {r['errors'][:3]}")
                    for k, v in r["verdicts"].items():
                        verdicts[kind][k] = verdicts[kind].get(k, 0) + v
                    for i, ans in r["answers"].items():
                        if i in seen[kind]:
                            repeated += 1
                            differing += ans != seen[kind][i]
                        else:
                            seen[kind][i] = ans
            p, m = statistics.median(tok["plain"]), statistics.median(tok["mg"])
            diag = {k: {n: v - before[k][n] for n, v in scrape(s.url, DIAG).items()} for k, s in mgs}
            row = {"share": share, "plain_tok_s": p, "mg_tok_s": m, "ratio": m / p, "plain_all": tok["plain"],
                   "mg_all": tok["mg"], "verdicts": verdicts["mg"], "errors": errors,
                   "rollbacks": diag["mg"]["mg_rollbacks_total"], "mg_wall_s": sum(mg_wall),
                   "mg_latency_s_p50_p99": mg_latency, "diagnostics": diag["mg"]}
            if srv_b:
                mb = statistics.median(tok["mg_b"])
                row.update(mg_b_tok_s=mb, ratio_b=mb / p, mg_b_all=tok["mg_b"], verdicts_b=verdicts["mg_b"],
                           rollbacks_b=diag["mg_b"]["mg_rollbacks_total"], diagnostics_b=diag["mg_b"])
                E.log(f"share {share:.0%}: mg_b {mb:.0f} tok/s ({mb / p:.3f}), {verdicts['mg_b']}")
            res["throughput"].append(row)
            E.log(f"share {share:.0%}: plain {p:.0f} tok/s, mg {m:.0f} tok/s ({m / p:.3f}), {verdicts['mg']}, "
                  f"errors {errors}")
            res.update(differing_answers=differing, repeated_answers=repeated)
            (args.out / "throughput.json").write_text(json.dumps(res, indent=2))
        for s in (base, srv_b):
            if s:
                s.stop()
        base = srv_b = None
        if args.sglang_det and shares:  # SGLang's own deterministic mode (every request), mg off
            det_srv = E.start(mdir, name, "off", args.out, ["--enable-deterministic-inference", *mem], "cuda", graph_bs)
            try:
                run_offline(det_srv.url, work[:16], set(), 16)
                runs = [run_offline(det_srv.url, work, set(), args.concurrency, f"sglang-det-rep{rep}")["tokens_per_s"]
                        for rep in range(args.reps)]
            finally:
                det_srv.stop()
            plain_all = [x for s in res["throughput"] for x in s["plain_all"]]
            res["sglang_det"] = {"tok_s": statistics.median(runs), "all": runs,
                                 "ratio": statistics.median(runs) / statistics.median(plain_all)}
            E.log(f"SGLang deterministic mode: {res['sglang_det']}")
            (args.out / "throughput.json").write_text(json.dumps(res, indent=2))
        for t in stream_taus:
            if t != srv_tau:
                srv.stop()
                srv, srv_tau = mg(t), t
            run_streams(srv.url, work, 4)  # warm
            st = run_streams(srv.url, work, args.stream_batch)
            st["tau"] = t
            res["streams"].append(st)
            E.log(f"streams at tau {t:.4g}: {st}")
            (args.out / "throughput.json").write_text(json.dumps(res, indent=2))
    finally:
        for s in (base, srv_b, srv):
            if s:
                s.stop()
    (args.out / "throughput.md").write_text(table(res))
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
