"""What `serve --mg-prefill-ahead N` changes for deterministic requests with long prompts: the
rows each held check carries (its catch-up of the prompt and of the fast tokens since) and its
time, with and without, on the same prompts and the same server flags otherwise.

    python benchmarks/prefill_ahead.py --out benchmarks/results/prefill_ahead_cpu.json
    python benchmarks/prefill_ahead.py --device cuda --ahead 16 --prompt-tokens 1024 --out ...

Per configuration: a fresh server; `--requests` deterministic completions sent one after another
(each its own prompt: no prefix sharing in SGLang's cache); mg's counters before and after. A
check's time is `mg_verify_seconds` (what a held forward waits for: the controller's catch-up
chunks and its verify call); the prefill ahead's own calls are not in it (`mg_prefill_ahead_rows`
counts their rows). Rows per check count the verify call's rows, not the chunks before it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mg_server.evaluation.determinism import scrape as scrape_names  # noqa: E402
from mg_server.evaluation.server_process import ServerProcess  # noqa: E402

COUNTERS = ("mg_prefill_ahead_rows_total", "mg_verify_rows_sum", "mg_verify_rows_count", "mg_verify_seconds_sum",
            "mg_verify_seconds_count", "mg_verify_total")
TOPICS = ["a transformer decodes text", "a compiler optimizes loops", "a database plans a join",
          "a kernel schedules threads", "a GPU runs a matrix multiply", "a network routes a packet"]


def scrape(url: str) -> dict[str, float]:
    return {k: v for k, v in scrape_names(url, COUNTERS).items() if k in COUNTERS}


def run(ahead: int, args, log_dir: Path) -> dict:
    flags = ["--device", args.device, "--mg-tau", str(args.tau)] + (["--mg-prefill-ahead", str(ahead)] if ahead else [])
    srv = ServerProcess(flags, log_dir / f"server-ahead{ahead}.log")
    try:
        srv.wait_ready()
        before, walls, verdicts = scrape(srv.url), [], []
        for i in range(args.requests):
            words = f"Request {i}: explain step by step how {TOPICS[i % len(TOPICS)]}. "
            prompt = (words * (args.prompt_tokens // 8 + 1))[: args.prompt_tokens * 4]  # ~prompt_tokens tokens
            t0 = time.perf_counter()
            r = requests.post(srv.url + "/v1/completions", headers={"X-Deterministic": "1"}, timeout=900,
                              json={"model": "x", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0})
            r.raise_for_status()
            walls.append(time.perf_counter() - t0)
            verdicts.append(r.headers.get("x-mg-verdict", ""))
            print(f"  ahead {ahead}: request {i} {walls[-1]:.2f} s, verdict {verdicts[-1]}", flush=True)
        d = {k: v - before[k] for k, v in scrape(srv.url).items()}
    finally:
        srv.stop()
    calls = d["mg_verify_seconds_count"]
    return {"prefill_ahead": ahead, "requests": args.requests, "verdicts": verdicts,
            "wall_s_median": statistics.median(walls), "wall_s": walls, "checks": calls,
            "rows_per_check": d["mg_verify_rows_sum"] / d["mg_verify_rows_count"] if d["mg_verify_rows_count"] else None,
            "check_ms": 1e3 * d["mg_verify_seconds_sum"] / calls if calls else None,
            "prefill_ahead_rows": d["mg_prefill_ahead_rows_total"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ahead", type=int, default=16, help="the --mg-prefill-ahead N compared with 0 (off)")
    ap.add_argument("--prompt-tokens", type=int, default=200, help="about this many prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--tau", type=float, default=0.5, help="serve --mg-tau (high: checks are frequent)")
    a = ap.parse_args()
    if a.ahead < 1:
        ap.error("--ahead must be >= 1 (it is compared with 0, off)")
    with tempfile.TemporaryDirectory() as tmp:
        res = [run(n, a, Path(tmp)) for n in (0, a.ahead)]
    print("| prefill ahead | checks | rows per check | check ms | rows taught ahead | median request s | verdicts |")
    print("|---|---|---|---|---|---|---|")
    for r in res:
        print(f"| {r['prefill_ahead'] or 'off'} | {r['checks']:.0f} | "
              + " | ".join("" if r[k] is None else f"{r[k]:.1f}" for k in ("rows_per_check", "check_ms"))
              + f" | {r['prefill_ahead_rows']:.0f} | {r['wall_s_median']:.2f} | {','.join(sorted(set(r['verdicts'])))} |")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({"device": a.device, "prompt_tokens": a.prompt_tokens, "max_tokens": a.max_tokens,
                                 "tau": a.tau, "runs": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
