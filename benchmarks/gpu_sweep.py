"""Deterministic-request cost on a GPU host across trigger rates, next to plain SGLang and
SGLang's own deterministic mode (issue 10's benchmark), in one command per model:

    python benchmarks/gpu_sweep.py --out DIR --wheels .whl --tokenizer DIR --models smol \
        --rates 0.05,0.1,0.2,always [--sglang-det]

Uses gpu_e2e.py's models (random weights, fixed seed), prompts and timing (ABBA alternation,
(time of N tokens - time of 2) / (N - 2)). tau for a target trigger rate is the quantile of the
verifier-alone margins of the benchmark's prompts (steps with margin < tau are verified), and the
rate each server really verified is measured and reported beside it. A server in mode `off`
(plain SGLang) stays up the whole run and is timed alternately with each mg server, so every
overhead is against a baseline of the same minutes. Per tau: ms/step with every row of the batch
deterministic, with 25 % of it deterministic (the plain neighbours decode in the same forwards,
so their ms/step is the same number), the measured trigger and repair rates and the mean verify
call. JSON after every server (--out/gpu_sweep-MODEL.json), a summary table, and a PNG.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_e2e as E  # noqa: E402 - the sibling script is the shared harness

MIXED = 0.25  # share of deterministic rows in mixed batches


def tau_for_rate(margins: list[float], rate: float) -> float:
    """The smallest tau with a fraction >= rate of the margins strictly below it."""
    xs = sorted(margins)
    k = min(len(xs) - 1, max(0, round(rate * len(xs))))
    return xs[k] if xs[k] > 0 else 1e-6


def metrics(url: str) -> dict:
    """mg's step counters (evaluation.determinism.scrape) and the verify/control histograms' sums."""
    import requests

    from mg_server.evaluation.determinism import scrape

    c = scrape(url)
    text = requests.get(url + "/metrics", timeout=30).text

    def val(name: str) -> float:
        m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    return {"fast": c["steps_fast"], "verify": c["steps_verify"], "repair": c["mg_repair_total"],
            "vsum": val("mg_verify_seconds_sum"), "vcount": val("mg_verify_seconds_count"),
            "csum": val("mg_control_seconds_sum"), "ccount": val("mg_control_seconds_count")}


def rates(before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in after}
    steps = max(1.0, d["fast"] + d["verify"])
    return {"trigger": d["verify"] / steps, "repair": d["repair"] / steps, "steps": d["fast"] + d["verify"],
            "verify_call_ms": 1e3 * d["vsum"] / d["vcount"] if d["vcount"] else None,
            # the seam's time per forward whose rows were all fast-committed (mg_control_seconds)
            "fast_control_ms": 1e3 * d["csum"] / d["ccount"] if d["ccount"] else None, "verify_calls": d["vcount"]}


def timed(base, srv, prompts, batches, new, reps, frac) -> dict:
    """ABBA ms/step of base (plain rows) and srv (frac of each batch deterministic)."""
    before = metrics(srv.url)
    ms = E.decode_ms([base, srv], prompts, batches, new, reps, det_frac={srv.name: frac})
    return {"base": ms[base.name], "mg": ms[srv.name], **rates(before, metrics(srv.url))}


def run_model(name: str, args, prompts: dict, out: Path) -> dict:
    mdir = E.write_model(name, Path(args.models_dir) / name, args.tokenizer)
    refs = E.references(mdir, prompts, args.tokens, out / f"refs-{name}.json", args.device)
    margins = [m for key in ("det_margins", "prefix_margins") for row in refs[key] for m in row]
    mem = ["--mem-fraction-static", "0.85", "--max-total-tokens", str(E.POOL_TOKENS[name])]
    res = {"model": name, "shape": E.SHAPES[name], "batches": args.batches, "decode_tokens": args.decode_tokens,
           "reps": args.reps, "mixed_share": MIXED, "seam": args.seam, "configs": []}
    seam = ["--mg-seam", args.seam]
    path = out / f"gpu_sweep-{name}.json"
    base = E.start(mdir, name, "off", out, mem, args.device)
    others = prompts["other"]
    try:
        if args.sglang_det:
            srv = E.start(mdir, name, "off", out, ["--enable-deterministic-inference", *mem], args.device)
            srv.name = f"{name}/sglang-det"
            try:
                res["sglang_det"] = timed(base, srv, others, args.batches, args.decode_tokens, args.reps, 0.0)
            finally:
                srv.stop()
            path.write_text(json.dumps(res, indent=2))
        for rate in args.rates:
            always = rate == "always"
            tau = None if always else tau_for_rate(margins, float(rate))
            flags = [] if always else ["--mg-tau", f"{tau:.6g}"]
            srv = E.start(mdir, name, "always" if always else "margin", out, [*flags, *seam, *mem], args.device)
            try:
                cfg = {"target": rate, "tau": tau,
                       "det": timed(base, srv, others, args.batches, args.decode_tokens, args.reps, 1.0),
                       "mixed": timed(base, srv, others, [b for b in args.batches if b >= 4],
                                      args.decode_tokens, args.reps, MIXED)}
            finally:
                srv.stop()
            res["configs"].append(cfg)
            E.log(f"{name} {rate}: tau {tau}, trigger {cfg['det']['trigger']:.3f}")
            path.write_text(json.dumps(res, indent=2))
    finally:
        base.stop()
    return res


def pct(v: float, b: float) -> str:
    return f"{v:.2f} ({100 * (v - b) / b:+.0f} %)"


def summarize(r: dict) -> str:
    lines = [f"## {r['model']} (mg seam: {r.get('seam', 'sync')}): ms per decode step (overhead vs plain SGLang timed alternately in the same minutes)",
             "", "| config | tau | trigger (measured) | repair | verify call ms | fast-commit ms | "
             + " | ".join(f"bs {b} all det." for b in r["batches"]) + " | "
             + " | ".join(f"bs {b} 25 % det." for b in r["batches"] if b >= 4) + " |",
             "|---" * (6 + len(r["batches"]) + len([b for b in r["batches"] if b >= 4])) + "|"]
    base_row = ["plain SGLang (mg off)", "", "", "", "", ""]
    first = r["configs"][0]["det"]["base"] if r["configs"] else r["sglang_det"]["base"]
    base_row += [f"{first[b]['median']:.2f}" for b in r["batches"]] + ["" for b in r["batches"] if b >= 4]
    lines.append("| " + " | ".join(base_row) + " |")
    if "sglang_det" in r:
        s = r["sglang_det"]
        lines.append("| SGLang --enable-deterministic-inference | | 100 % | | | | "
                     + " | ".join(pct(s["mg"][b]["median"], s["base"][b]["median"]) for b in s["mg"]) + " | "
                     + " | ".join("" for b in r["batches"] if b >= 4) + " |")
    for c in r["configs"]:
        d, m = c["det"], c["mixed"]
        vc, fc = d["verify_call_ms"], d["fast_control_ms"]
        lines.append(f"| mg {c['target'] if c['target'] == 'always' else 'margin ~' + str(c['target'])} | "
                     f"{'' if c['tau'] is None else format(c['tau'], '.4g')} | {100 * d['trigger']:.1f} % | "
                     f"{100 * d['repair']:.2f} % | {'' if vc is None else format(vc, '.2f')} | "
                     f"{'' if fc is None else format(fc, '.2f')} | "
                     + " | ".join(pct(d["mg"][b]["median"], d["base"][b]["median"]) for b in d["mg"]) + " | "
                     + " | ".join(pct(m["mg"][b]["median"], m["base"][b]["median"]) for b in m["mg"]) + " |")
    return "\n".join(lines) + "\n"


def plot(results: list[dict], out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        E.log("matplotlib missing: no PNG")
        return
    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for ax, r in zip(axes[0], results):
        for b in r["batches"]:
            xs, ys = [], []
            for c in r["configs"]:
                d = c["det"]
                if b in d["mg"]:
                    xs.append(100 * d["trigger"])
                    ys.append(100 * (d["mg"][b]["median"] - d["base"][b]["median"]) / d["base"][b]["median"])
            ax.plot(xs, ys, "o-", label=f"mg, batch {b}, all det.")
            if "sglang_det" in r and b in r["sglang_det"]["mg"]:
                s = r["sglang_det"]
                ax.axhline(100 * (s["mg"][b]["median"] - s["base"][b]["median"]) / s["base"][b]["median"],
                           ls="--", lw=1, color=ax.lines[-1].get_color(), label=f"SGLang det. mode, batch {b}")
        ax.axhline(10, color="grey", lw=0.8)
        ax.set(title=r["model"], xlabel="steps verified (measured trigger rate, %)",
               ylabel="ms/step overhead vs plain SGLang (%)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "gpu_sweep.png", dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out/gpu-sweep"))
    ap.add_argument("--wheels", type=Path)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--models", default="smol")
    ap.add_argument("--models-dir", default="/tmp/mg-models")
    ap.add_argument("--tokens", type=int, default=64, help="reference tokens per prompt (the margins tau comes from)")
    ap.add_argument("--decode-tokens", type=int, default=130)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--rates", default="0.05,0.1,0.2,always", help="target trigger rates; 'always' = mode always")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--sglang-det", action="store_true", help="also time SGLang's --enable-deterministic-inference")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--seam", choices=["sync", "lagged"], default="lagged",
                    help="mg's control path (serve --mg-seam): lagged (default) or sync (margins read before sampling)")
    ap.add_argument("--limit", type=int, default=0)
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    args.rates = args.rates.split(",")
    sys.path.insert(0, str(E.REPO / "tests"))
    E.setup_python(args.wheels)
    args.tokenizer = args.tokenizer or E._default_tokenizer()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(E.PROMPTS_FILE.read_text())
    if args.limit:
        prompts = {k: v[: args.limit] for k, v in prompts.items()}
    results = []
    for name in args.models.split(","):
        t0 = time.monotonic()
        results.append(run_model(name, args, prompts, args.out))
        E.log(f"{name}: {time.monotonic() - t0:.0f}s")
    text = "# Deterministic traffic vs trigger rate (benchmarks/gpu_sweep.py)\n\n" + "\n".join(map(summarize, results))
    (args.out / "gpu_sweep.md").write_text(text)
    plot(results, args.out)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
