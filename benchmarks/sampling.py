"""Seeded sampling vs greedy on the same prompts, one real server in mode margin: trigger rate
(steps the verifier computed), repairs, audit mismatches, and answers equal to the verifier-alone
reference of each rule. Prints a table, writes JSON.

    python benchmarks/sampling.py --prompts 32 --tokens 64 --temperature 0.8 \
        --out bench-out/sampling.json [--server-args "--mg-tau 0.5"]

Prompts: `mixed_prompts` (half HumanEval, half ShareGPT, chat-templated); seeds 1000 + i. Requests
go in concurrent groups of --group (mixed batches), greedy first, then sampled.
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

from mg_server.evaluation.determinism import settled  # noqa: E402
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--group", type=int, default=8, help="concurrent requests")
    ap.add_argument("--server-args", default="")
    ap.add_argument("--out", type=Path, default=Path("bench-out/sampling.json"))
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)

    from transformers import AutoTokenizer

    from mg_server.prompts import chat_ids, mixed_prompts

    model = str(prepare_model())
    tok = AutoTokenizer.from_pretrained(model)
    ids = [chat_ids(tok, ({"role": "user", "content": t},)) for t in mixed_prompts(args.prompts)]
    seeds = [1000 + i for i in range(len(ids))]
    print(f"references: {len(ids)} prompts x {args.tokens} tokens, greedy and T={args.temperature} ...", flush=True)
    greedy_refs, sampled_refs = references(model, ids, args.tokens, args.temperature, seeds)
    srv = ServerProcess(["--mg-mode", "margin", *shlex.split(args.server_args)], args.out.with_suffix(".log"))
    try:
        srv.wait_ready()
        rows = {"greedy": run_rule(srv.url, ids, greedy_refs, args.tokens, 0.0, seeds, args.group),
                f"T={args.temperature:g}": run_rule(srv.url, ids, sampled_refs, args.tokens, args.temperature,
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


if __name__ == "__main__":
    sys.exit(main())
