"""GPU memory of mg beside plain SGLang, each at its own defaults (no shared token cap).

For each model (random weights written with a real config: evaluation.random_models.REAL) and
each GPU budget (the whole card, and optionally `--hold-gb G` held first by another process, e.g.
59 GB of an H200 leaves an 80 GB card's memory), it starts plain SGLang (`--mg-mode off`) and mg
(every default), and records:
- SGLang's K/V tokens (`max_total_num_tokens` from its log) and mg's over plain's;
- each process's GPU memory (nvidia-smi), mg's processes and the verifier's K/V pool;
- mg only: a few deterministic /generate answers, compared token for token with the verifier
  alone computed from the checkpoint (verifier.reference: the verifier as it loaded before it
  shared SGLang's weights), alone and beside plain requests.
Writes OUT/memory.json and OUT/memory.md.

    python benchmarks/memory.py --out DIR --models llama31-8b,qwen3-8b [--hold-gb 59] [--budgets full,held]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mg_server.evaluation.random_models import write_model  # noqa: E402
from mg_server.evaluation.server_process import ServerProcess  # noqa: E402

PROMPTS = [[1, 450 + k, 3 * k + 7, 901, 22 + k, 5000 + 13 * k, 77] for k in range(6)]
MAX_NEW = 24


def gpu_processes() -> dict[int, int]:
    """pid -> MiB of every process on the GPU."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return {int(p): int(m) for p, m in (line.split(", ") for line in out.strip().splitlines() if ", " in line)}


def tree(pid: int) -> dict[int, str]:
    """pid -> process title of a server's process tree."""
    import psutil

    procs = [psutil.Process(pid)] + psutil.Process(pid).children(recursive=True)
    out = {}
    for p in procs:
        try:
            out[p.pid] = " ".join(p.cmdline())[:60]
        except psutil.Error:
            pass
    return out


def generate(url: str, ids: list[int], det: bool) -> tuple[list[int], str]:
    r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
        "max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}},
        headers={"X-Deterministic": "1"} if det else {}, timeout=600)
    r.raise_for_status()
    return r.json()["output_ids"], r.headers.get("x-mg-verdict", "")


def serve(model: Path, mode: str, log: Path) -> dict:
    srv = ServerProcess(["--model", str(model), "--device", "cuda", "--skip-tokenizer-init", "--mg-mode", mode], log)
    out: dict = {"mode": mode}
    try:
        out["ready_s"] = round(srv.wait_ready(timeout=900), 1)
        time.sleep(2)
        text = log.read_text(errors="replace")
        m = re.search(r"max_total_num_tokens=(\d+)", text)
        out["kv_tokens"] = int(m.group(1)) if m else None
        m = re.search(r"K/V pool (\d+) tokens", text)
        out["verifier_pool_tokens"] = int(m.group(1)) if m else None
        gpu, titles = gpu_processes(), tree(srv.proc.pid)
        out["processes"] = {titles[p]: gpu[p] for p in titles if p in gpu}
        if mode != "off":
            alone = [generate(srv.url, p, True) for p in PROMPTS]
            with ThreadPoolExecutor(12) as pool:  # beside plain requests
                mixed = list(pool.map(lambda a: generate(srv.url, a[0], a[1]),
                                      [(p, True) for p in PROMPTS] + [(p[::-1], False) for p in PROMPTS]))
            out["alone"] = alone
            out["mixed"] = mixed[: len(PROMPTS)]
    finally:
        srv.stop()
    return out


def reference(model: Path) -> list[list[int]]:
    import torch

    from mg_server.verifier.reference import greedy_reference, load_engine

    engine = load_engine(str(model), device="cuda", max_seq_len=1024, pool_tokens=4096)
    refs = [r.tokens for r in greedy_reference(engine, PROMPTS, MAX_NEW)]
    del engine
    torch.cuda.empty_cache()
    return refs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="llama31-8b,qwen3-8b")
    ap.add_argument("--models-dir", type=Path, default=Path("/tmp/mg-models"))
    ap.add_argument("--tokenizer", type=Path, default=Path(".cache/gpu-tokenizer"))
    ap.add_argument("--hold-gb", type=float, default=0.0, help="GPU memory another process holds for the 'held' runs")
    ap.add_argument("--budgets", default="full", help="comma-separated: full, held")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"gpu": subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout.strip(), "runs": []}
    for name in args.models.split(","):
        model = write_model(name, args.models_dir / name, args.tokenizer)
        refs = reference(model)
        for budget in args.budgets.split(","):
            holder = None
            if budget == "held":
                holder = subprocess.Popen([sys.executable, "-c", "import torch, time; x = torch.empty(int("
                                           f"{args.hold_gb} * 2**30), dtype=torch.uint8, device='cuda'); "
                                           "print('held', flush=True); time.sleep(1e9)"], stdout=subprocess.PIPE)
                holder.stdout.readline()
            try:
                for mode in ("off", "margin"):
                    r = serve(model, mode, args.out / f"{name}-{budget}-{mode}.log")
                    r.update(model=name, budget=budget)
                    if mode != "off":
                        r["alone_equal_reference"] = sum(a == ref for (a, _), ref in zip(r["alone"], refs))
                        r["mixed_equal_reference"] = sum(a == ref for (a, _), ref in zip(r["mixed"], refs))
                        r["verdicts"] = sorted({v for _, v in r["alone"] + r["mixed"]})
                        del r["alone"], r["mixed"]
                    results["runs"].append(r)
                    (args.out / "memory.json").write_text(json.dumps(results, indent=1))
            finally:
                if holder is not None:
                    holder.kill()
    lines = ["| model | GPU budget | plain K/V tokens | mg K/V tokens | ratio | verifier pool | mg processes' extra MiB "
             "(verifier, controller, main's) | det. = reference |", "|---|---|---|---|---|---|---|---|"]
    runs = results["runs"]
    for r in runs:
        if r["mode"] == "off":
            continue
        plain = next(p for p in runs if p["mode"] == "off" and p["model"] == r["model"] and p["budget"] == r["budget"])
        mg_extra = {k: v for k, v in r["processes"].items() if "sglang" not in k.lower() or "mg_server" in k}
        ratio = r["kv_tokens"] / plain["kv_tokens"] if r.get("kv_tokens") and plain.get("kv_tokens") else float("nan")
        lines.append(f"| {r['model']} | {r['budget']} | {plain['kv_tokens']} | {r['kv_tokens']} | {ratio:.3f} | "
                     f"{r['verifier_pool_tokens']} | {json.dumps(mg_extra)} | {r['alone_equal_reference']} + "
                     f"{r['mixed_equal_reference']} of {2 * len(PROMPTS)} ({', '.join(r['verdicts'])}) |")
    (args.out / "memory.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
