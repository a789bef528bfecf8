"""Time to first token of long prompts, and prefix-shaped deterministic traffic, mg beside plain SGLang:

    python benchmarks/reuse.py --out DIR [--model llama8b-planted] [--parts ttft,eval,rl]
        [--lengths 1250,8000] [--shares 0.02,0.25,1] [--spacing-ms 80,480] [--ab-tree DIR] [--kv-budget-gb X]
        [--preamble 2000] [--plain-from OLD/reuse.json]

Each server runs alone on the GPU at its own defaults (plain SGLang = mg-server with --mg-mode off;
then mg; then, with --ab-tree, another checkout's mg; --plain-from takes plain's results from an earlier run
of the same workload instead), one after the other, every part on each:
- ttft: for each length and share, --requests distinct random prompts (new ones each run: no
  radix-cache hit), at most --concurrency in flight, 16 tokens each, streamed one token per chunk;
  the first of every 1/share deterministic. TTFT (the first event carrying a token) p50 / p99 of
  the deterministic requests on mg against the same requests on plain SGLang, and the plain rows
  of the same run on each server. Two arrival protocols: a burst (every request at once, at most
  --concurrency in flight: a request's TTFT is mostly its place in SGLang's queue, so a few
  milliseconds of extra path can move it a whole prefill later) and, with --spacing-ms (one value
  per length), request k sent k * spacing after the first (an open-loop rate).
- eval: one preamble of --preamble tokens (2,000) before 64 distinct ~40-token questions, all deterministic, 64
  tokens each, greedy: output tokens/s, and the verifier's rows per request (mg_verify_rows_sum:
  rows computed; mg_verifier_reused_rows_total: prompt rows mapped from its prefix cache).
- rl: 32 distinct 300-token prompts, each n = 8 seeded samples (temperature 0.8), 64 tokens each.
Every deterministic answer must be `verified`; answers given twice (the same request on two
servers of mg) must agree. JSON after each part, a table at the end (OUT/reuse.{json,md}).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gpu_e2e as E  # the sibling scripts are the shared harness (their folder is on sys.path when run)
from gpu_sweep import read_stream
from offline_throughput import det_indices, pct

ROWS = ("mg_verify_rows_sum", "mg_verifier_reused_rows_total", "mg_arrival_prefills_total",
        "mg_verifier_recomputes_total", "mg_rollbacks_total")
VOCAB = 32000  # token ids of the random prompts (any id below every shape's vocabulary)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, VOCAB) for _ in range(n)]


def post(url: str, body: dict, det: bool, stream: bool = False):
    import requests

    return requests.post(url + "/generate", json=body, headers={"X-Deterministic": "1"} if det else {},
                         timeout=900, stream=stream)


def ttft_run(url: str, prompts: list[list[int]], det: set[int], concurrency: int, mg: bool,
             spacing_s: float = 0.0) -> dict:
    """TTFT of every request (seconds), its verdict and tokens; request k is sent k * spacing_s
    after the first (0: all at once)."""
    out: dict[int, dict] = {}
    lock = threading.Lock()
    start = time.perf_counter()

    def one(i: int) -> None:
        if spacing_s:
            time.sleep(max(0.0, start + i * spacing_s - time.perf_counter()))
        body = {"input_ids": prompts[i], "stream": True, "sampling_params": {
            "max_new_tokens": 16, "ignore_eos": True, "temperature": 0, "stream_interval": 1}}
        t0 = time.perf_counter()
        try:
            with post(url, body, mg and i in det, stream=True) as r:
                r.raise_for_status()
                points, states = read_stream(r)
            pts = [t for n, t in points.get(0, []) if n > 0]  # (the first event that carries a token)
            row = {"ttft_s": pts[0] - t0 if pts else None, "states": states}
        except Exception as e:  # noqa: BLE001 - reported
            row = {"error": repr(e)[:300]}
        with lock:
            out[i] = row

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(prompts))))
    return out


def batch_run(url: str, bodies: list[dict], det: bool, concurrency: int) -> dict:
    """Non-streamed bodies, at most `concurrency` at once: output tokens/s, verdicts, answers."""
    answers: dict[int, list] = {}
    verdicts: dict[str, int] = {}
    errors: list[str] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        try:
            r = post(url, bodies[i], det)
            r.raise_for_status()
            got = r.json()
            got = got if isinstance(got, list) else [got]
            with lock:
                answers[i] = [g["output_ids"] for g in got]
                v = r.headers.get("x-mg-verdict", "none")
                verdicts[v] = verdicts.get(v, 0) + 1
        except Exception as e:  # noqa: BLE001 - reported
            with lock:
                errors.append(f"{i}: {e!r}"[:300])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(bodies))))
    wall = time.perf_counter() - t0
    tokens = sum(len(a) for ans in answers.values() for a in ans)
    return {"tokens_per_s": tokens / wall, "wall_s": wall, "verdicts": verdicts, "errors": errors,
            "answers": answers}


def workloads(args) -> dict:
    rng = random.Random(1)
    preamble = ids(rng, args.preamble)
    return {
        # distinct prompts for every run: a prompt seen before would be a radix-cache hit in SGLang
        "ttft": {f"{L}@{share}@{sp}": [ids(rng, L) for _ in range(args.requests)]
                 for L, spacings in zip(args.lengths, args.spacings) for sp in spacings for share in args.shares},
        "eval": [{"input_ids": preamble + ids(rng, 30 + k % 20),
                  "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0}} for k in range(64)],
        "rl": [{"input_ids": ids(rng, 300), "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "n": 8,
                                                               "temperature": 0.8, "sampling_seed": 1000 + k}}
               for k in range(32)],
    }


def serve_parts(srv, kind: str, work: dict, args) -> dict:
    from mg_server.evaluation.determinism import scrape

    mg = kind != "plain"
    res: dict = {}
    if "ttft" in args.parts:
        rng = random.Random(2)
        ttft_run(srv.url, [ids(rng, L) for L in args.lengths * 2], set(range(4)), 4, mg)  # (shapes compiled)
        res["ttft"] = {}
        for key, prompts in work["ttft"].items():
            _, share, spacing = key.split("@")
            det = det_indices(len(prompts), float(share))  # (plain: the same requests, no header)
            before = scrape(srv.url, ROWS) if mg else {}
            runs = ttft_run(srv.url, prompts, det, args.concurrency, mg, float(spacing) / 1e3)
            after = scrape(srv.url, ROWS) if mg else {}
            res["ttft"][key] = {"runs": runs, "det": sorted(det), "counters": {k: after[k] - before[k] for k in after}}
            E.log(f"{kind} ttft {key}: done")
    for part in ("eval", "rl"):
        if part not in args.parts:
            continue
        before = scrape(srv.url, ROWS) if mg else {}
        r = batch_run(srv.url, work[part], mg, args.concurrency)
        after = scrape(srv.url, ROWS) if mg else {}
        r["counters"] = {k: after[k] - before[k] for k in after}
        r["requests"] = sum(w["sampling_params"].get("n", 1) for w in work[part])
        res[part] = r
        E.log(f"{kind} {part}: {r['tokens_per_s']:.0f} tok/s, {r['verdicts']}, errors {r['errors'][:2]}")
    return res


def summarize(res: dict) -> dict:
    out: dict = {"ttft": [], "prefix": []}
    plain = res["servers"]["plain"]
    for kind in [k for k in res["servers"] if k != "plain"]:
        got = res["servers"][kind]
        for key, run in got.get("ttft", {}).items():
            L, share, spacing = key.split("@")
            base = plain["ttft"][key]["runs"]
            det = run["det"]

            def ttfts(runs: dict, rows) -> list[float]:
                return [runs[i]["ttft_s"] for i in rows if runs[i].get("ttft_s") is not None]

            d, p = ttfts(run["runs"], det), ttfts(base, det)
            others = [i for i in run["runs"] if i not in set(det)]  # the run's plain rows, on each server
            mo, po = ttfts(run["runs"], others), ttfts(base, others)
            states = [s for i in det for s in run["runs"][i].get("states", [])]
            row = {"server": kind, "prompt": int(L), "share": float(share), "spacing_ms": float(spacing), "n": len(d),
                   "det_p50_ms": 1e3 * pct(d, 0.5), "det_p99_ms": 1e3 * pct(d, 0.99),
                   "plain_p50_ms": 1e3 * pct(p, 0.5), "plain_p99_ms": 1e3 * pct(p, 0.99),
                   "others_p50_ms": 1e3 * pct(mo, 0.5) if mo else None,
                   "others_plain_p50_ms": 1e3 * pct(po, 0.5) if po else None,
                   "verified": sum(s == "verified" for s in states), "errors": sum("error" in r for r in run["runs"].values()),
                   "counters": run["counters"],
                   # the verifier's work per deterministic request (prompt + answer tokens, more where recomputed)
                   "rows_per_det": run["counters"].get("mg_verify_rows_sum", 0) / max(1, len(det)),
                   "recomputes": run["counters"].get("mg_verifier_recomputes_total", 0)}
            row["p50_ratio"] = row["det_p50_ms"] / row["plain_p50_ms"]
            out["ttft"].append(row)
        for part in ("eval", "rl"):
            if part in got:
                g, c = got[part], got[part]["counters"]
                out["prefix"].append({"server": kind, "part": part, "requests": g["requests"],
                                      "mg_tok_s": g["tokens_per_s"], "plain_tok_s": plain[part]["tokens_per_s"],
                                      "ratio": g["tokens_per_s"] / plain[part]["tokens_per_s"],
                                      "rows_per_request": c["mg_verify_rows_sum"] / g["requests"],
                                      "reused_per_request": c["mg_verifier_reused_rows_total"] / g["requests"],
                                      "verdicts": g["verdicts"], "errors": len(g["errors"])})
    return out


def table(s: dict) -> str:
    lines = ["| server | prompt | arrivals | det. share | det. TTFT p50 / p99 ms | same rows on plain p50 / p99 ms | "
             "p50 ratio | other rows p50 mg / plain ms | verifier rows / det. request, recomputes | verified |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def ms(x) -> str:
        return "-" if x is None else f"{x:.0f}"

    for r in s["ttft"]:
        arrivals = f"every {r['spacing_ms']:.0f} ms" if r["spacing_ms"] else "burst"
        lines.append(f"| {r['server']} | {r['prompt']} | {arrivals} | {r['share']:.0%} | {r['det_p50_ms']:.0f} / "
                     f"{r['det_p99_ms']:.0f} | {r['plain_p50_ms']:.0f} / {r['plain_p99_ms']:.0f} | {r['p50_ratio']:.2f}× | "
                     f"{ms(r['others_p50_ms'])} / {ms(r['others_plain_p50_ms'])} | {r['rows_per_det']:.0f}, "
                     f"{r['recomputes']:.0f} | {r['verified']}/{r['n']} |")
    lines += ["", "| server | workload | requests | verifier rows / request | reused / request | mg / plain tok/s | verdicts |",
              "|---|---|---|---|---|---|---|"]
    for r in s["prefix"]:
        lines.append(f"| {r['server']} | {r['part']} | {r['requests']} | {r['rows_per_request']:.0f} | "
                     f"{r['reused_per_request']:.0f} | {r['mg_tok_s']:.0f} / {r['plain_tok_s']:.0f} = {r['ratio']:.3f}× | "
                     f"{r['verdicts']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--wheels", type=Path)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--model", default="llama8b-planted", choices=sorted(E.SHAPES))
    ap.add_argument("--models-dir", default="/tmp/mg-models")
    ap.add_argument("--parts", default="ttft,eval,rl")
    ap.add_argument("--lengths", default="1250,8000")
    ap.add_argument("--shares", default="0.02,0.25,1")
    ap.add_argument("--spacing-ms", default="", help="per length: also send the TTFT requests this far apart "
                    "(after the burst), e.g. 80,480")
    ap.add_argument("--preamble", type=int, default=2000, help="eval: the shared preamble's tokens (longer than "
                    "a verify call's 4,096 rows: reused chunk by chunk)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tau", type=float, default=0.117, help="mg's tau (the 8B shape's benchmarks' tau: 10 %% of steps below it)")
    ap.add_argument("--kv-budget-gb", type=float, default=0.0, help="mg's --mg-kv-budget-gb (0: its default)")
    ap.add_argument("--ab-tree", type=Path, help="also time this checkout's mg (e.g. the commit before)")
    ap.add_argument("--plain-from", type=Path, help="plain SGLang's results from an earlier reuse.json of the same "
                    "workload (model, parts, lengths, shares, spacings, requests, concurrency: the same prompts), "
                    "instead of running it again")
    args = ap.parse_args()
    args.parts = args.parts.split(",")
    args.lengths = [int(x) for x in args.lengths.split(",")]
    args.shares = [float(x) for x in args.shares.split(",")]
    spacing = [float(x) for x in args.spacing_ms.split(",")] if args.spacing_ms else []
    if spacing and len(spacing) != len(args.lengths):
        ap.error("--spacing-ms takes one value per length")
    args.spacings = [[0.0, sp] for sp in spacing] if spacing else [[0.0] for _ in args.lengths]
    E.setup_python(args.wheels)
    args.tokenizer = args.tokenizer or E._default_tokenizer()
    args.out.mkdir(parents=True, exist_ok=True)
    import torch

    mdir = E.write_model(args.model, Path(args.models_dir) / args.model, args.tokenizer)
    work = workloads(args)
    res = {"model": args.model, "device": torch.cuda.get_device_name(0), "tau": args.tau, "args": vars(args) | {
        "out": str(args.out), "wheels": str(args.wheels), "tokenizer": str(args.tokenizer), "ab_tree": str(args.ab_tree)},
        "servers": {}}
    budget = ["--mg-kv-budget-gb", str(args.kv_budget_gb)] if args.kv_budget_gb else []
    plan = [("plain", "off", [], None), ("mg", "margin", ["--mg-tau", str(args.tau), *budget], None)]
    if args.plain_from:
        old = json.loads(args.plain_from.read_text())
        same = ("model", "parts", "lengths", "shares", "spacings", "requests", "concurrency", "preamble")
        old["args"].setdefault("preamble", 2000)  # (before the flag: always 2,000)
        if any(old["args"].get(k) != res["args"][k] for k in same):
            ap.error(f"--plain-from {args.plain_from}: another workload (it must match in {', '.join(same)})")
        res["servers"]["plain"] = old["servers"]["plain"]
        res["plain_from"] = str(args.plain_from)
        plan = plan[1:]
    if args.ab_tree:
        plan.append(("mg_b", "margin", ["--mg-tau", str(args.tau), *budget], args.ab_tree))
    for kind, mode, extra, tree in plan:
        srv = E.start(mdir, args.model, mode, args.out, extra, "cuda", args.concurrency * 8, tree)
        try:
            res["servers"][kind] = serve_parts(srv, kind, work, args)
        finally:
            srv.stop()
            if srv.log_path.exists():  # one log per server kind (mg and mg_b would share a name)
                srv.log_path.rename(args.out / f"server-{kind}.log")
        (args.out / "reuse.json").write_text(json.dumps(res))
    mg_answers = [res["servers"][k].get(p, {}).get("answers", {}) for k in ("mg", "mg_b") if k in res["servers"]
                  for p in ("eval",)]
    res["summary"] = summarize(res)
    if len(mg_answers) == 2:
        res["summary"]["eval_answers_equal"] = mg_answers[0] == mg_answers[1]
    (args.out / "reuse.json").write_text(json.dumps(res))
    (args.out / "reuse.md").write_text(table(res["summary"]))
    print(table(res["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
