"""Determinism of deterministic requests under mixed load, per mg mode, vs the verifier-alone
reference; with trigger rate, repair rate and audit mismatches. Prints a table, writes JSON.

    python benchmarks/determinism.py --modes margin,always,off --prompts 16 --tokens 64 \
        --out bench-out/determinism.json [--server-args "--mg-tau 0.5"] [--offset 64 --seed 1]
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from mg_server.evaluation.server_process import ServerProcess

from mg_server.evaluation.determinism import DeterminismConfig, build_workload, run  # noqa: E402
from mg_server.model.prepare import prepare_model  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="margin,always,off")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--offset", type=int, default=0, help="skip the first N HumanEval problems (shortest first)")
    ap.add_argument("--seed", type=int, default=0, help="ShareGPT sample seed")
    ap.add_argument("--out", type=Path, default=Path("bench-out/determinism.json"))
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    model = str(prepare_model())
    print(f"references: {args.prompts} prompts x {args.tokens} tokens (verifier alone) ...", flush=True)
    wl = build_workload(model, args.prompts, args.tokens, seed=args.seed, offset=args.offset)
    low = [m for ms in wl.ref_margins for m in ms]
    results = {}
    for mode in args.modes.split(","):
        srv = ServerProcess(["--mg-mode", mode, *shlex.split(args.server_args)], args.out.with_suffix(f".{mode}.log"))
        try:
            ready = srv.wait_ready()
            print(f"[{mode}] server ready in {ready:.0f}s", flush=True)
            rep = run(DeterminismConfig(url=srv.url, max_new=args.tokens), wl.det, wl.refs, wl.other,
                      progress=lambda s, m=mode: print(f"[{m}] {s}", flush=True))
        finally:
            srv.stop()
        results[mode] = rep.to_json()
    print(f"\n{'mode':>7} {'equal':>9} {'steps':>6} {'trigger':>8} {'repair':>7} {'audit-mm':>8} {'sec':>5}")
    for mode, r in results.items():
        c = r["counters"]
        steps = c["mg_deterministic_steps_total"] or 1
        print(f"{mode:>7} {r['n_checked'] - r['n_mismatch']:>4}/{r['n_checked']:<4} "
              f"{c['mg_deterministic_steps_total']:>6.0f} {c['steps_verify'] / steps:>8.1%} {c['mg_repair_total'] / steps:>7.2%} "
              f"{c['mg_audit_mismatch_total']:>8.0f} {r['seconds']:>5.0f}")
    summary = {"prompts": args.prompts, "tokens": args.tokens, "server_args": args.server_args,
               "offset": args.offset, "seed": args.seed,
               "reference_margin_quantiles": {q: sorted(low)[int(q * (len(low) - 1))] for q in (0.01, 0.05, 0.1, 0.25, 0.5)},
               "modes": results}
    args.out.write_text(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(r["n_mismatch"] == 0 for m, r in results.items() if m != "off") else 1


if __name__ == "__main__":
    sys.exit(main())
