"""Determinism of deterministic requests under mixed load, per mg mode, vs the verifier-alone
reference; with trigger rate, repair rate and audit mismatches. Prints a table, writes JSON.

    python benchmarks/determinism.py --modes margin,always,off --prompts 16 --tokens 64 \
        --out bench-out/determinism.json [--server-args "--mg-tau 0.5"] [--offset 64 --seed 1]

`--sampling T`: seeded sampling at temperature T against greedy decoding on the same prompts, one
server in mode margin: trigger rate (steps the verifier computed), repairs, audit mismatches and
answers equal to the verifier-alone reference of each rule. Prompts: `mixed_prompts` (half
HumanEval, half ShareGPT, chat-templated), seeds 1000 + i; requests go in concurrent groups of
--group (mixed batches), greedy first, then sampled.

    python benchmarks/determinism.py --sampling 0.8 --prompts 32 --tokens 64 --out bench-out/sampling.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from mg_server.evaluation.server_process import ServerProcess

from mg_server.evaluation.determinism import DeterminismConfig, build_workload, run, settled  # noqa: E402
from mg_server.model.prepare import prepare_model  # noqa: E402


def references(model: str, ids, tokens: int, temperature: float, seeds):
    import torch

    from mg_server.verifier.reference import greedy_reference, load_engine

    torch.set_num_threads(1)  # results do not depend on it; one thread leaves a core to the rest
    engine = load_engine(model)
    greedy = greedy_reference(engine, ids, tokens)
    sampled = greedy_reference(engine, ids, tokens, temperature=temperature, seeds=seeds)
    return [r.tokens for r in greedy], [r.tokens for r in sampled]


def one(url: str, ids: list[int], tokens: int, temperature: float, seed: int) -> tuple[list[int], str]:
    params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": temperature}
    if temperature > 0:
        params["sampling_seed"] = seed
    r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": params},
                      headers={"X-Deterministic": "1"}, timeout=1800)
    r.raise_for_status()
    return r.json()["output_ids"], r.headers.get("x-mg-verdict", "")


def run_rule(url: str, ids, refs, tokens: int, temperature: float, seeds, group: int) -> dict:
    before, t0 = settled(url), time.perf_counter()
    with ThreadPoolExecutor(group) as pool:
        got = list(pool.map(lambda a: one(url, a[0], tokens, temperature, a[1]), zip(ids, seeds)))
    after = settled(url)
    d = {k: after[k] - before[k] for k in after}
    steps = d["mg_deterministic_steps_total"] - d["mg_lookahead_steps_total"]
    return {"temperature": temperature, "equal_to_reference": sum(g == r for (g, _), r in zip(got, refs)),
            "answers": len(got), "verified_verdicts": sum(v == "verified" for _, v in got),
            "steps": steps, "verify_steps": d["steps_verify"], "trigger_rate": d["steps_verify"] / max(steps, 1),
            "repairs": d["mg_repair_total"], "audit_mismatches": d["mg_audit_mismatch_total"],
            "verify_errors": d["mg_verify_errors_total"], "seconds": time.perf_counter() - t0}


def sampling(args) -> int:
    from transformers import AutoTokenizer

    from mg_server.prompts import chat_ids, mixed_prompts

    model = str(prepare_model())
    tok = AutoTokenizer.from_pretrained(model)
    ids = [chat_ids(tok, ({"role": "user", "content": t},)) for t in mixed_prompts(args.prompts)]
    seeds = [1000 + i for i in range(len(ids))]
    print(f"references: {len(ids)} prompts x {args.tokens} tokens, greedy and T={args.sampling} ...", flush=True)
    greedy_refs, sampled_refs = references(model, ids, args.tokens, args.sampling, seeds)
    srv = ServerProcess(["--mg-mode", "margin", *shlex.split(args.server_args)], args.out.with_suffix(".log"))
    try:
        srv.wait_ready()
        rows = {"greedy": run_rule(srv.url, ids, greedy_refs, args.tokens, 0.0, seeds, args.group),
                f"T={args.sampling:g}": run_rule(srv.url, ids, sampled_refs, args.tokens, args.sampling,
                                                     seeds, args.group)}
    finally:
        srv.stop()
    print(f"\n{'rule':>7} {'equal':>7} {'verified':>8} {'steps':>6} {'trigger':>8} {'repairs':>7} {'audit-mm':>8} {'sec':>5}")
    for name, r in rows.items():
        print(f"{name:>7} {r['equal_to_reference']:>3}/{r['answers']:<3} {r['verified_verdicts']:>8} {r['steps']:>6.0f} "
              f"{r['trigger_rate']:>8.1%} {r['repairs']:>7.0f} {r['audit_mismatches']:>8.0f} {r['seconds']:>5.0f}")
    args.out.write_text(json.dumps({"prompts": len(ids), "tokens": args.tokens, "server_args": args.server_args,
                                    "rules": rows}, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(r["equal_to_reference"] == r["answers"] for r in rows.values()) else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--modes", default="margin,always,off")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--server-args", default="")
    ap.add_argument("--offset", type=int, default=0, help="skip the first N HumanEval problems (shortest first)")
    ap.add_argument("--seed", type=int, default=0, help="ShareGPT sample seed")
    ap.add_argument("--out", type=Path, default=Path("bench-out/determinism.json"))
    ap.add_argument("--sampling", type=float, metavar="T", help="seeded sampling at T against greedy (see above)")
    ap.add_argument("--group", type=int, default=8, help="--sampling: concurrent requests")
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.sampling is not None:
        return sampling(args)

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
