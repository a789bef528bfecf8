"""Is SGLang's decode step GPU-bound or host-bound on this machine? GPU utilization (nvidia-smi:
the share of time some kernel was running) while plain SGLang, and mg's deterministic traffic
(early verify on and off), decode long streamed answers, per batch size.

    python benchmarks/gpu_busy.py --out DIR --tokenizer DIR [--models smol] [--batches 1,8,32]

Why it matters: mg's held gate stops the main process's stream until the verifier answers. If the
step is host-bound, starting the verify call earlier (serve --mg-early-verify) hides it behind
the scheduler's host work; if the GPU is busy the whole step, the stall adds to it whatever the
host does. Same models and prompts as gpu_sweep.py. JSON and a table in --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_e2e as E  # noqa: E402 - the sibling script is the shared harness
from gpu_sweep import tau_for_rate  # noqa: E402
from stream_timing import stream_batch  # noqa: E402


class Utilization:
    """nvidia-smi sampling utilization.gpu every 100 ms in the background; mean(t0, t1) averages
    the samples that arrived in a window."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []  # (arrival time.monotonic, util %)
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                      "-lms", "100"], stdout=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            try:
                self.samples.append((time.monotonic(), float(line.split()[0])))
            except (ValueError, IndexError):
                pass

    def mean(self, t0: float, t1: float) -> float | None:
        xs = [u for t, u in self.samples if t0 <= t <= t1]
        return statistics.mean(xs) if xs else None

    def stop(self) -> None:
        self.proc.terminate()


def measure(srv, util: Utilization, prompts, batches, new: int, det: bool) -> dict:
    out = {}
    for bs in batches:
        rows = [prompts[i % len(prompts)] for i in range(bs)]
        n_det = bs if det else 0
        stream_batch(srv.url, rows, 32, n_det, interval=8)  # warm this batch size
        t0 = time.monotonic()
        r = stream_batch(srv.url, rows, new, n_det, interval=8)
        t1 = time.monotonic()
        # the first 0.5 s hold the prefill and nvidia-smi's first window; the last answer ends the run
        out[bs] = {"ms_per_step": r["det" if det else "plain"], "gpu_util": util.mean(t0 + 0.5, t1),
                   "seconds": t1 - t0, "verdict": r.get("det_verdict", "")}
        E.log(f"{srv.name} bs {bs}: {out[bs]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, default=None)
    ap.add_argument("--models", default="smol")
    ap.add_argument("--models-dir", default="/tmp/mg-models")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--decode-tokens", type=int, default=1024)
    ap.add_argument("--rate", type=float, default=0.1, help="target trigger rate of the mg servers")
    args = ap.parse_args()
    sys.path.insert(0, str(E.REPO / "tests"))
    args.tokenizer = args.tokenizer or E._default_tokenizer()
    args.out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    prompts = json.loads(E.PROMPTS_FILE.read_text())
    util = Utilization()
    res: dict = {"decode_tokens": args.decode_tokens, "rate": args.rate, "models": {}}
    lines = ["| model | server | " + " | ".join(f"bs {b}: ms/step, GPU busy" for b in batches) + " |",
             "|---|---|" + "---|" * len(batches)]
    try:
        for name in args.models.split(","):
            mdir = E.write_model(name, Path(args.models_dir) / name, args.tokenizer)
            refs = E.references(mdir, prompts, 64, args.out / f"refs-{name}.json", "cuda")
            tau = tau_for_rate([m for k in ("det_margins", "prefix_margins") for row in refs[k] for m in row],
                               args.rate)
            mem = E.mem_flags(name)
            runs = {"plain SGLang": ("off", [], False),
                    f"mg ~{args.rate}, early verify on": ("margin", ["--mg-tau", f"{tau:.6g}", "--mg-early-verify",
                                                                     "on"], True),
                    f"mg ~{args.rate}, early verify off": ("margin", ["--mg-tau", f"{tau:.6g}", "--mg-early-verify",
                                                                      "off"], True)}
            res["models"][name] = {"tau": tau}
            for label, (mode, flags, det) in runs.items():
                srv = E.start(mdir, name, mode, args.out, [*flags, *mem], "cuda")
                srv.name = f"{name}/{label}"
                try:
                    r = res["models"][name][label] = measure(srv, util, prompts["other"], batches,
                                                             args.decode_tokens, det)
                finally:
                    srv.stop()
                cells = [f"{x['ms_per_step']:.2f}, {x['gpu_util']:.0f} %" if x["gpu_util"] is not None
                         else f"{x['ms_per_step']:.2f}, –" for x in r.values()]
                lines.append(f"| {name} | {label} | " + " | ".join(cells) + " |")
                (args.out / "gpu_busy.json").write_text(json.dumps(res, indent=1))
    finally:
        util.stop()
    text = "\n".join(lines) + "\n"
    (args.out / "gpu_busy.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
