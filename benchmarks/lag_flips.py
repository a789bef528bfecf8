"""Missed flips under `--mg-commit lag` with and without SGLang's radix cache (a GPU repro).

    python benchmarks/lag_flips.py --out DIR --checkpoint /tmp/mg-models/smol-real \
        [--configs hold,lag,lag-nocache,lag-alone] [--repeats 3]

Each configuration is one server at tau 0.245557 (9.8 % of steps at bs 8, real SmolLM2), sent
the same non-streamed deterministic body `--repeats` times: the 8 `other` prompts of
benchmarks/data/gpu_prompts.json (`lag-alone`: prompt 2 only). It prints each answer's verdict
and the tail of prompt 2's answer, and the server's `missed flip` lines (position, answer token,
the verifier's margin there, the request's last verified step and last repair:
runtime/controller/audit.py). A missed flip in a non-streamed answer is corrected by the verifier
(the verdict then reads `verified`), so the lines and `mg_corrections_total` are what show it.
JSON in --out.

Measured on the H100 (benchmarks/results/gpu/HISTORY.md, "Lag's missed flips, explained"): with
the radix cache, a repeated prompt's prefill takes its prefix from the cache, so its fast path's
bits differ from the first request's; under lag that trajectory meets a near-tie (verifier margin
0.0013 and 0.039) whose fast-path margin was above tau: a flip above tau, not a wrong K/V column.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TAU = ["--mg-tau", "0.245557"]
LAG = [*TAU, "--mg-commit", "lag", "--mg-verifier-in", "scheduler", "--mg-lag-chain", "off",
       "--mg-controller-in", "process"]  # (as measured: before the hosted controller became the default)
CONFIGS = {"hold": [*TAU, "--mg-commit", "hold"], "lag": LAG, "lag-nocache": [*LAG, "--disable-radix-cache"],
           "lag-alone": LAG}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--checkpoint", default="/tmp/mg-models/smol-real")
    ap.add_argument("--configs", default="hold,lag,lag-nocache,lag-alone")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]  # gpu_e2e, and its server_util
    import gpu_e2e as E
    import gpu_sweep as S
    import requests

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(E.PROMPTS_FILE.read_text())["other"]
    res = {}
    for name in args.configs.split(","):
        d = out / name
        d.mkdir(exist_ok=True)
        srv = E.start(Path(args.checkpoint), "smol", "margin", d, CONFIGS[name] + E.mem_flags("smol"), "cuda")
        alone = name == "lag-alone"
        runs = []
        try:
            for k in range(args.repeats):
                r = requests.post(srv.url + "/generate", headers={"X-Deterministic": "1"}, timeout=300, json={
                    "input_ids": [prompts[2]] if alone else prompts,
                    "sampling_params": {"max_new_tokens": 128, "ignore_eos": True, "temperature": 0}})
                r.raise_for_status()
                ans = r.json()[0 if alone else 2]["output_ids"]
                runs.append({"verdict": r.headers.get("x-mg-verdict"), "tail": ans[110:]})
                print(name, k, runs[-1]["verdict"], runs[-1]["tail"], flush=True)
            corrections = S.metrics(srv.url).get("resumes")  # mg_corrections_total
        finally:
            srv.stop()
        text = "\n".join(p.read_text(errors="replace") for p in d.glob("server-*.log"))
        lines = [x[-300:] for x in text.splitlines() if "missed flip" in x]
        res[name] = {"runs": runs, "corrections": corrections, "missed_flip_lines": lines}
        print(f"{name}: {corrections:.0f} corrections", *lines[:6], sep="\n  ", flush=True)
        subprocess.run("nvidia-smi --query-compute-apps=pid --format=csv,noheader | xargs -r kill -9", shell=True,
                       check=False)
    (out / "lag_flips.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
