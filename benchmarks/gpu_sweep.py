"""Deterministic-request cost on a GPU host across trigger rates, next to plain SGLang and
SGLang's own deterministic mode, in one command per model:

    python benchmarks/gpu_sweep.py --out DIR --wheels .whl --tokenizer DIR --models smol \
        --rates 0.05,0.1,0.2,always [--sglang-det] [--configs 0.1:w8,always]

Uses gpu_e2e.py's models (random weights, fixed seed), prompts and ABBA alternation; ms/step is
(time of N tokens - time of S) / (N - S), S = --short-tokens (2; decode_ms has the trade-off), or
with --stream-interval K from streamed answers' chunk times (the streamed answers' timing below).
tau for a target trigger rate is the quantile of the verifier-alone margins of the benchmark's prompts (steps with margin < tau are verified), and the
rate each server really verified is measured and reported beside it. A server in mode `off`
(plain SGLang) stays up the whole run and is timed alternately with each mg server, so every
overhead is against a baseline of the same minutes. Deterministic rows are sent as clients send
them, through mg's front with `X-Deterministic: 1` (one /generate batch body), so their time
includes everything a client waits for: the verdict (the final audit); plain rows go in a second
/generate body sent at the same moment (they decode in the same forwards). Per tau and window:
ms/step with every row of the batch deterministic, and with 25 % of it deterministic (the plain
neighbours' ms/step and the deterministic rows'), the measured trigger and rollback rates, the
verdicts and the mean verify call. JSON after every server (--out/gpu_sweep-MODEL.json), a summary table,
and a PNG.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import gpu_e2e as E  # the sibling script is the shared harness (its folder is on sys.path when run)

# ---- streamed answers' timing ------------------------------------------------------------------
# Decode ms/step from streamed /generate answers (--stream-interval K, back-to-back, and
# offline_throughput.py's streams).
#
# Why: the difference of two runs' wall times ((time of N tokens - time of S) / (N - S)) carries
# every one-off cost of either run (prefill, the prompts' catch-up, the final audit) and every
# stall of ~1 s that one run hits and the other does not; over 32 rows of 128 tokens those swamp a
# few ms per step (docs/history/gpu-measurements.md, "The benchmark models and measures"). Here each answer streams a chunk every `interval` tokens
# (SGLang's per-request `stream_interval`), the client stamps each chunk as it arrives, and a row's
# ms/step is the time between its first chunk at or past token N/4 and its last chunk (token N),
# over the tokens between: prefill, the first steps and the verdict's wait stay out, every
# decode step in between (held forwards included) stays in. A body's ms/step is the median of its
# rows' (they decode in the same forwards).
#
# That steady measure understates a held row's cost: the output hold sends a deterministic row's
# first timed chunk only after its first check, while decoding goes on during that check, so the
# check's time drops out of the interval (on an H200 the 8B shape's all-deterministic bs 32 rows
# timed -23 % against plain SGLang with a 32-forward check delay, impossible for the same
# forwards). Each row is therefore also timed as a whole answer: from the post to its last chunk,
# per answer token (`answer_ms`; prefill and every wait included, the same rule for both servers).
# A deterministic response ends with its verdict event, after the last chunk: `verdict_wait_ms`
# times that wait per body.


def read_stream(resp, clock=time.perf_counter, marks: dict | None = None) -> tuple[dict[int, list[tuple[int, float]]], list]:
    """SSE lines of a /generate stream -> ({index: [(completion tokens, arrival time)]}, the
    states of mg's verdict event, `data: {"mg_verdict": {...}}`, if one came); `marks["verdict"]`:
    that event's arrival time. Raises on an error event."""
    points: dict[int, list[tuple[int, float]]] = {}
    states: list = []
    buf = b""
    for chunk in resp.iter_content(chunk_size=None):  # as the bytes arrive, not in 512-byte reads
        now = clock()
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                ev = json.loads(line[len(b"data: "):])
                if "error" in ev:
                    raise RuntimeError(f"stream error: {ev['error']}")
                if "mg_verdict" in ev:
                    states = ev["mg_verdict"]["states"]
                    if marks is not None:
                        marks["verdict"] = now
                    continue
                points.setdefault(ev.get("index", 0), []).append((ev["meta_info"]["completion_tokens"], now))
    return points, states


def _last(points: list[tuple[int, float]], new: int) -> tuple[int, float]:
    """A row's last chunk, which must complete its `new` tokens."""
    if not points or points[-1][0] != new:
        raise RuntimeError(f"a row streamed {points[-1][0] if points else 0} of {new} tokens")
    return points[-1]


def steady_ms(points: list[tuple[int, float]], new: int) -> float:
    """ms/step of one row from its (tokens, time) chunks: first chunk at or past new/4 to the last."""
    last = _last(points, new)
    first = next(p for p in points if p[0] >= new // 4)
    if last[0] <= first[0]:
        raise RuntimeError(f"too few chunks to time ({len(points)}); lower --stream-interval")
    return (last[1] - first[1]) / (last[0] - first[0]) * 1e3


def answer_ms(points: list[tuple[int, float]], new: int, posted: float) -> float:
    """ms per answer token of one row as its client sees the whole answer: post to last chunk."""
    return (_last(points, new)[1] - posted) / new * 1e3


def verdict_wait_ms(points: dict[int, list[tuple[int, float]]], marks: dict) -> float:
    """ms from a body's last chunk (of any row) to its verdict event, which ends a deterministic
    response (the whole answers stop at the last chunk)."""
    if "verdict" not in marks:
        raise RuntimeError("a deterministic stream ended without its verdict event")
    return (marks["verdict"] - max(p[-1][1] for p in points.values())) * 1e3


def stream_batch(url: str, rows: list[list[int]], new: int, n_det: int, singles: bool = False,
                 interval: int = 8) -> dict:
    """gpu_sweep.front_batch with streamed answers: the first n_det rows deterministic (one body,
    or one request each with singles), the rest one plain body, all posted at the same moment.
    -> {"det"/"plain": ms/step (median over the rows), "det_answer"/"plain_answer": ms per token
    of the whole answers (median over the rows), "det_verdict": the verdict states,
    "det_verdict_wait": ms from a deterministic body's last chunk to its verdict (median over the
    bodies)}."""
    import requests

    params = {"max_new_tokens": new, "ignore_eos": True, "temperature": 0, "stream_interval": interval}
    out: dict = {}

    def post(key: str, part: list[list[int]], headers: dict) -> None:
        try:
            posted, marks = time.perf_counter(), {}
            with requests.post(url + "/generate", json={"input_ids": part, "sampling_params": params,
                                                        "stream": True},
                               headers=headers, timeout=600, stream=True) as r:
                r.raise_for_status()
                points, states = read_stream(r, marks=marks)
            if len(points) != len(part):
                raise RuntimeError(f"{len(points)} of {len(part)} rows streamed")
            out[key] = [steady_ms(p, new) for p in points.values()]
            out[key + "_answer"] = [answer_ms(p, new, posted) for p in points.values()]
            out[key + "_verdict"] = ",".join(sorted(set(states))) if headers else ""
            if headers:  # every deterministic body ends with its verdict event (mode off: unverified)
                out[key + "_verdict_wait"] = verdict_wait_ms(points, marks)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            out[key + "_error"] = repr(e)

    n_parts = post_all(rows, n_det, singles, post, out)
    res: dict = {}
    if n_parts:
        res["det"] = statistics.median([x for k in range(n_parts) for x in out[f"det{k}"]])
        res["det_answer"] = statistics.median([x for k in range(n_parts) for x in out[f"det{k}_answer"]])
        waits = [out[f"det{k}_verdict_wait"] for k in range(n_parts) if f"det{k}_verdict_wait" in out]
        if waits:
            res["det_verdict_wait"] = statistics.median(waits)
        verdicts = {out[f"det{k}_verdict"] for k in range(n_parts)}
        res["det_verdict"] = verdicts.pop() if len(verdicts) == 1 else "mixed: " + ";".join(sorted(verdicts))
    if "plain" in out:
        res["plain"] = statistics.median(out["plain"])
        res["plain_answer"] = statistics.median(out["plain_answer"])
    return res


def post_all(rows: list[list[int]], n_det: int, singles: bool, post, out: dict) -> int:
    """Send the rows as clients send them, all at the same moment, one thread each: the first
    n_det deterministic as one body (singles: one request each), the rest as one plain body. post(key, part, headers) records
    into `out` ("<key>_error" on failure). -> the number of deterministic parts (keys det0..)."""
    parts = [[row] for row in rows[:n_det]] if singles else [rows[:n_det]] if n_det else []
    jobs = [threading.Thread(target=post, args=(f"det{k}", part, {"X-Deterministic": "1"}))
            for k, part in enumerate(parts)]
    if n_det < len(rows):
        jobs.append(threading.Thread(target=post, args=("plain", rows[n_det:], {})))
    for j in jobs:
        j.start()
    for j in jobs:
        j.join()
    if errors := [v for k, v in out.items() if k.endswith("_error")]:
        raise RuntimeError(f"a timed request failed: {errors[0]}")
    return len(parts)


MIXED = 0.25  # share of deterministic rows in mixed batches


def tau_for_rate(margins: list[float], rate: float) -> float:
    """The smallest tau with a fraction >= rate of the margins strictly below it."""
    xs = sorted(margins)
    k = min(len(xs) - 1, max(0, round(rate * len(xs))))
    return xs[k] if xs[k] > 0 else 1e-6


def tau_for_rate_quantized(margins: list[float], rate: float) -> tuple[float, float]:
    """For margins that take few distinct values (bf16 steps): the tau halfway between two
    neighbouring values whose share of margins below it is closest to rate -> (tau, that share).
    A quantile would land on a value many margins equal, so the rate it gives could be far off."""
    xs = sorted(margins)
    values = sorted(set(xs))
    best = None
    for lo, hi in zip(values, values[1:]):
        share = sum(1 for x in xs if x <= lo) / len(xs)
        if best is None or abs(share - rate) < abs(best[1] - rate):
            best = ((lo + hi) / 2, share)
    return best if best is not None else (tau_for_rate(margins, rate), 0.0)


# the margins of every deterministic step and of the steps the verifier overturned (cumulative
# buckets): how a flip's odds fall with its margin
HISTOGRAMS = {"margins": "mg_margin", "flip_margins": "mg_flip_margin"}


def metrics(url: str) -> dict:
    """mg's step counters and the verify/control histograms' sums, from one /metrics read
    (evaluation.determinism.scrape)."""
    from mg_server.evaluation.determinism import MG_COUNTERS, scrape

    sums = {"vsum": "mg_verify_seconds_sum", "vcount": "mg_verify_seconds_count",
            "fsum": "mg_verifier_forward_seconds_sum", "rsum": "mg_verify_rows_sum",
            "csum": "mg_control_seconds_sum", "ccount": "mg_control_seconds_count",
            "rollbacks": "mg_rollbacks_total", "stale": "mg_stale_steps_total",
            "dropped": "mg_rollback_dropped_steps_total", "lookahead": "mg_lookahead_steps_total"}
    c = scrape(url, (*MG_COUNTERS, *sums.values()))
    return {"fast": c["steps_fast"], "verify": c["steps_verify"], "repair": c["mg_repair_total"],
            **{k: c[name] for k, name in sums.items()}, **{k: E.histogram(url, name) for k, name in HISTOGRAMS.items()}}


def in_flight(url: str, timeout_s: float = 2.0) -> dict:
    """The deterministic requests mg still holds after a batch size's runs, the seam's and the
    controller's (mg_tracked_requests, mg_live_requests), read until both are 0 or timeout_s has
    passed (an end reported from the scheduler thread is untracked at the watcher's next look):
    0, else requests left behind; None where the server publishes no such gauge."""
    from mg_server.evaluation.determinism import scrape

    deadline = time.monotonic() + timeout_s
    while True:
        c = scrape(url, ("mg_tracked_requests", "mg_live_requests"), absent=None)
        got = {"tracked_after": c["mg_tracked_requests"], "live_after": c["mg_live_requests"]}
        if not any(got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def rates(before: dict, after: dict) -> dict:
    d = {k: after[k] - before[k] for k in after if k not in HISTOGRAMS}
    hist = {k: {str(le): n - before[k].get(le, 0.0) for le, n in after[k].items()} for k in HISTOGRAMS}
    steps = max(1.0, d["fast"] + d["verify"])
    # trigger: the margin gate's share (low-margin steps, checked within a few forwards)
    return {"trigger": d["verify"] / steps, "repair": d["repair"] / steps,
            "steps": d["fast"] + d["verify"],
            # in-place rollbacks and the fast steps they threw away (dropped: decided after the
            # flip, a moot rollback's surplus included; stale: still in flight), and the steps
            # decided past the answers (the look-ahead forward, held ends' surplus)
            "rollbacks": d["rollbacks"], "stale_steps": d["stale"], "dropped_steps": d["dropped"],
            "lookahead_steps": d["lookahead"],
            # the verify call's profile: the verifier's forward inside it, its rows (checked +
            # catch-up), and verify calls per deterministic forward
            "verifier_forward_ms": 1e3 * d["fsum"] / d["vcount"] if d["vcount"] else None,
            "rows_per_call": d["rsum"] / d["vcount"] if d["vcount"] else None,
            "calls_per_forward": d["vcount"] / d["ccount"] if d["ccount"] else None,
            "verify_call_ms": 1e3 * d["vsum"] / d["vcount"] if d["vcount"] else None,
            # the seam's time per forward whose rows were all fast-committed (mg_control_seconds)
            "fast_control_ms": 1e3 * d["csum"] / d["ccount"] if d["ccount"] else None, "verify_calls": d["vcount"],
            **hist}


def front_batch(url: str, rows: list[list[int]], max_new: int, n_det: int, singles: bool = False) -> dict:
    """Decode `rows` as clients send them (module doc): the first n_det as one deterministic
    /generate body (singles: one request each, all at once), the rest as a plain body, posted at
    the same moment. -> {"det"/"plain": seconds until that answer (the last one), "det_verdict"}."""
    import requests

    params = {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}
    out: dict = {}

    def post(key: str, part: list[list[int]], headers: dict) -> None:
        t0 = time.perf_counter()
        try:
            r = requests.post(url + "/generate", json={"input_ids": part, "sampling_params": params},
                              headers=headers, timeout=600)
            r.raise_for_status()
            out[key], out[key + "_verdict"] = time.perf_counter() - t0, r.headers.get("x-mg-verdict", "")
        except Exception as e:  # noqa: BLE001 - reported by the caller
            out[key + "_error"] = repr(e)

    # singles: "det" is then the time until the last one answered
    if n_parts := post_all(rows, n_det, singles, post, out):
        out["det"] = max(out.pop(f"det{k}") for k in range(n_parts))
        verdicts = {out.pop(f"det{k}_verdict") for k in range(n_parts)}
        out["det_verdict"] = verdicts.pop() if len(verdicts) == 1 else "mixed: " + ",".join(sorted(verdicts))
    return out


def keep_bodies(url: str, prompts: list[list[int]], n_det: int, stop, times: list, size: int = 8,
                tokens: int = 128) -> None:
    """Bodies of `size` requests of `tokens` tokens (prompts in turn), one after another until
    `stop` (an Event) is set, the first n_det deterministic; each body's seconds (front_batch's
    "det", or "plain" without deterministic rows) appended to `times`. For profilers' load."""
    k = 0
    while not stop.is_set():
        body = [prompts[(i + k) % len(prompts)] for i in range(size)]
        r = front_batch(url, body, tokens, n_det, False)
        times.append(r.get("det" if n_det else "plain"))
        k += 1


def decode_ms(servers, prompts: list[list[int]], batches: list[int], new: int, reps: int, frac: dict,
              singles: bool = False, short: int = 2, stream: int = 0) -> dict:
    """gpu_e2e.decode_ms through front_batch: ms/step of the deterministic and of the plain rows
    of each server's batches ((time of `new` tokens - time of `short`) / (new - short), servers
    in A B B A order), and the deterministic answers' verdicts.
    short=2 (gpu_e2e's baseline): the 2-token run pays the prompts' catch-up in its tail audits,
    which the long run batches into its verify calls, so mg's ms/step can come out too small
    (bs 32 all-deterministic 18-33 % below plain SGLang on the H100). short=new/2 was meant to
    cancel that (greedy answers are deterministic: both runs make the same first decisions) but
    measured noisier (H100, docs/history/gpu-measurements.md: per-run stalls of ~1 s over half
    the steps), so it is an option.
    stream > 0: one streamed run per rep instead, a chunk every `stream` tokens, ms/step from the
    chunks' arrival times (steady_ms: prefill, first steps and the verdict's wait left out),
    and ms per token of the whole answers (post to last chunk), which a held row's checks cannot
    drop out of, and the ms from a deterministic body's last chunk to its verdict event."""
    kinds = ("det", "plain", "det_answer", "plain_answer", "det_verdict_wait") if stream else ("det", "plain")
    res = {s.name: {**{k: {} for k in kinds}, "verdicts": {}, "by_batch": {}} for s in servers}
    for bs in batches:
        rows = [prompts[i % len(prompts)] for i in range(bs)]
        n_det = {s.name: round(frac.get(s.name, 0.0) * bs) for s in servers}
        samples = {s.name: {k: [] for k in kinds} for s in servers}
        # mg's counters around this batch size (warm-up included): its own trigger rate, verify
        # calls and share of forwards that held, which the whole config's totals blur
        before = {s.name: metrics(s.url) for s in servers if n_det[s.name]}
        for s in servers:
            front_batch(s.url, rows, 4, n_det[s.name], singles)  # warm this batch size
        for rep in range(reps):
            for s in (servers if rep % 2 == 0 else servers[::-1]):
                if stream:
                    full = stream_batch(s.url, rows, new, n_det[s.name], singles, stream)
                    for kind in kinds:
                        if kind in full:
                            samples[s.name][kind].append(full[kind])
                    short_verdict = None
                else:
                    first = front_batch(s.url, rows, short, n_det[s.name], singles)
                    full = front_batch(s.url, rows, new, n_det[s.name], singles)
                    for kind in ("det", "plain"):
                        if kind in full:
                            samples[s.name][kind].append((full[kind] - first[kind]) / (new - short) * 1e3)
                    short_verdict = first.get("det_verdict")
                v = res[s.name]["verdicts"]
                for got in (short_verdict, full.get("det_verdict")):
                    if got is not None:
                        v[got] = v.get(got, 0) + 1
        for name, by_kind in samples.items():
            for kind, xs in by_kind.items():
                if xs:
                    res[name][kind][bs] = {"median": statistics.median(xs), "all": xs}
        for s in servers:
            if s.name in before:
                res[s.name]["by_batch"][bs] = {**rates(before[s.name], metrics(s.url)), **in_flight(s.url)}
    return res


def timed(base, srv, prompts, batches, new, reps, frac, singles=False, short=2, stream=0) -> dict:
    """ABBA ms/step of base (plain rows) and srv (frac of each batch deterministic; singles: each
    deterministic row its own request)."""
    before = metrics(srv.url)
    ms = decode_ms([base, srv], prompts, batches, new, reps, {srv.name: frac}, singles, short, stream)
    mg = ms[srv.name]
    return {"base": ms[base.name]["plain"], "mg": mg["det"] or mg["plain"], "mg_plain": mg["plain"],
            "base_answer": ms[base.name].get("plain_answer", {}), "mg_answer": mg.get("det_answer") or mg.get("plain_answer", {}),
            "mg_verdict_wait": mg.get("det_verdict_wait", {}), "verdicts": mg["verdicts"], "by_batch": mg["by_batch"], **rates(before, metrics(srv.url))}


def run_model(name: str, args, prompts: dict, out: Path) -> dict:
    # a real checkpoint of the shape (--checkpoint), else random weights of it (fixed seed)
    mdir = Path(args.checkpoint[name]) if name in args.checkpoint else E.write_model(
        name, Path(args.models_dir) / name, args.tokenizer)
    refs = E.references(mdir, prompts, args.tokens, out / f"refs-{name}.json", args.device)
    kind = "_margins_bf16" if args.tau_margins == "bf16" else "_margins"
    margins = [m for key in ("det", "prefix") for row in refs[key + kind] for m in row]
    mem = E.mem_flags(name)
    res = {"model": name, "shape": E.SHAPES[name], "weights": str(mdir) if name in args.checkpoint else "random",
           "batches": args.batches, "decode_tokens": args.decode_tokens,
           "reps": args.reps, "short_tokens": args.short_tokens, "stream_interval": args.stream_interval, "mixed_share": MIXED,
           "tau_margins": args.tau_margins, "configs": []}
    path = out / f"gpu_sweep-{name}.json"
    base = E.start(mdir, name, "off", out, mem, args.device)
    others = prompts["other"]
    try:
        if args.sglang_det:
            srv = E.start(mdir, name, "off", out, ["--enable-deterministic-inference", *mem], args.device)
            srv.name = f"{name}/sglang-det"
            try:
                res["sglang_det"] = timed(base, srv, others, args.batches, args.decode_tokens, args.reps, 0.0,
                                          short=args.short_tokens, stream=args.stream_interval)
            finally:
                srv.stop()
            path.write_text(json.dumps(res, indent=2))
        for rate, *rest in args.configs:
            always = rate == "always"
            if bad := [x for x in rest if not (x.startswith("w") and x[1:].isdigit())]:
                raise SystemExit(f"unknown config marker(s) {bad} in {rate}:{':'.join(rest)}")
            window = next((int(x[1:]) for x in rest), None)  # serve --mg-window W
            expected = None  # the reference steps' share below tau, when the margins are bf16 steps
            if always:
                tau = None
            elif rate.startswith("t"):  # an explicit tau (e.g. a shipped profile's), not a target rate
                tau = float(rate[1:])
            elif args.tau_margins == "bf16":
                tau, expected = tau_for_rate_quantized(margins, float(rate))
            else:
                tau = tau_for_rate(margins, float(rate))
            flags = (([] if always else ["--mg-tau", f"{tau:.6g}"])
                     + (["--mg-window", str(window)] if window is not None else []))
            srv = E.start(mdir, name, "always" if always else "margin", out, [*flags, *mem], args.device)
            srv.name = f"{name}/{rate}" + (f"/w{window}" if window is not None else "")
            try:
                cfg = {"target": rate, "tau": tau, "commit": "window", "window": window, "expected_trigger": expected,
                       "det_requests": "batch",
                       "det": timed(base, srv, others, args.batches, args.decode_tokens, args.reps, 1.0, False,
                                    args.short_tokens, args.stream_interval),
                       "mixed": timed(base, srv, others, [b for b in args.batches if b >= 4],
                                      args.decode_tokens, args.reps, MIXED, False, args.short_tokens,
                                      args.stream_interval)}
            finally:
                srv.stop()
                srv.log_path.rename(out / f"server-{srv.name.replace('/', '-')}.log")  # one log per server
            res["configs"].append(cfg)
            E.log(f"{name} {rate}: tau {tau}, trigger {cfg['det']['trigger']:.3f}, rollbacks "
                  f"{cfg['det']['rollbacks']:.0f}, verdicts {cfg['det']['verdicts']} {cfg['mixed']['verdicts']}")
            path.write_text(json.dumps(res, indent=2))
    finally:
        base.stop()
    return res


def pct(v: float, b: float) -> str:
    return f"{v:.2f} ({100 * (v - b) / b:+.0f} %)"


def pct_reps(mg: dict, base: dict) -> str:
    """pct of the medians, then the reps' range: each rep's mg time against the plain median
    (the spread of mg's own reps, which sets how small a difference a run can resolve)."""
    xs = mg.get("all", [])
    if len(xs) < 2:
        return pct(mg["median"], base["median"])
    lo, hi = (100 * (x - base["median"]) / base["median"] for x in (min(xs), max(xs)))
    return f"{pct(mg['median'], base['median'])} [{lo:+.0f}..{hi:+.0f}]"


def load(path: Path) -> dict:
    """A results JSON as run_model returned it (JSON made its batch-size keys strings)."""
    def ints(o):
        if isinstance(o, dict):
            return {(int(k) if isinstance(k, str) and k.isdigit() else k): ints(v) for k, v in o.items()}
        return [ints(x) for x in o] if isinstance(o, list) else o

    return ints(json.loads(path.read_text()))


def _variant(c: dict) -> str:
    """A configuration's serve flags beyond rate and commit, for the tables."""
    return ((f", window {c['window']}" if c.get("window") else "")
            + (f", tau from bf16 margins (reference share {100 * c['expected_trigger']:.1f} %)"
               if c.get("expected_trigger") is not None else ""))


def summarize(r: dict) -> str:
    """The README table: ms/step (overhead vs plain SGLang) per configuration and batch size;
    in mixed batches, the plain neighbours' ms/step, then the deterministic rows'."""
    big = [b for b in r["batches"] if b >= 4]
    how = (f"streamed answers, a chunk every {r['stream_interval']} tokens" if r.get("stream_interval")
           else f"time of {r['decode_tokens']} tokens - time of {r.get('short_tokens', 2)}")
    weights = "" if r.get("weights", "random") == "random" else ", real weights"
    lines = [f"## {r['model']}{weights}: ms per decode step (overhead vs plain SGLang "
             f"timed alternately in the same minutes; {how}; [min..max] over the reps)", "",
             "| config | tau | trigger (measured) | repair | rollbacks | verdicts | verify call ms | "
             + " | ".join(f"bs {b} all det." for b in r["batches"]) + " | "
             + " | ".join(f"bs {b} 25 % det.: plain / det." for b in big) + " |",
             "|---" * (7 + len(r["batches"]) + len(big)) + "|"]
    first = r["configs"][0]["det"]["base"] if r["configs"] else r["sglang_det"]["base"]
    lines.append("| plain SGLang (mg off) | | | | | | | " + " | ".join(f"{first[b]['median']:.2f}" for b in r["batches"])
                 + " | " + " | ".join("" for _ in big) + " |")
    if "sglang_det" in r:
        s = r["sglang_det"]
        lines.append("| SGLang --enable-deterministic-inference | | 100 % | | | | | "
                     + " | ".join(pct(s["mg"][b]["median"], s["base"][b]["median"]) for b in s["mg"]) + " | "
                     + " | ".join("" for _ in big) + " |")
    for c in r["configs"]:
        d, m = c["det"], c["mixed"]
        vc = d["verify_call_ms"]
        verdicts = {k: d["verdicts"].get(k, 0) + m["verdicts"].get(k, 0)
                    for k in {*d.get("verdicts", {}), *m.get("verdicts", {})}}
        label = ("always" if c["target"] == "always" else f"margin ~{c['target']}") + _variant(c)
        mixed = [f"{pct(m['mg_plain'][b]['median'], m['base'][b]['median'])} / "
                 f"{pct(m['mg'][b]['median'], m['base'][b]['median'])}" if b in m.get("mg_plain", {}) else ""
                 for b in big]
        lines.append(f"| mg {label}, {c.get('commit', 'hold')} | {'' if c['tau'] is None else format(c['tau'], '.4g')} | "
                     f"{100 * d['trigger']:.1f} % | {100 * d['repair']:.2f} % | {d.get('rollbacks', 0):.0f} | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(verdicts.items()))} | "
                     f"{'' if vc is None else format(vc, '.2f')} | "
                     + " | ".join(pct_reps(d["mg"][b], d["base"][b]) for b in d["mg"]) + " | "
                     + " | ".join(mixed) + " |")
    answers = [c for c in r["configs"] if c["det"].get("mg_answer")]
    if answers:
        lines += ["", "Whole answers, all rows deterministic (post to last chunk, ms per answer token: the "
                  "output hold's waits included, which the steady measure above leaves out):", "",
                  "| config | " + " | ".join(f"bs {b}" for b in r["batches"]) + " |",
                  "|---" * (1 + len(r["batches"])) + "|",
                  "| plain SGLang (mg off) | " + " | ".join(f"{answers[0]['det']['base_answer'][b]['median']:.2f}"
                                                         for b in r["batches"]) + " |"]
        if r.get("sglang_det", {}).get("mg_answer"):
            s = r["sglang_det"]
            lines.append("| SGLang --enable-deterministic-inference | "
                         + " | ".join(pct_reps(s["mg_answer"][b], s["base_answer"][b]) for b in r["batches"]) + " |")
        for c in answers:
            d = c["det"]
            lines.append(f"| mg margin ~{c['target']}{_variant(c)} | "
                         + " | ".join(pct_reps(d["mg_answer"][b], d["base_answer"][b]) for b in r["batches"]) + " |")
        waits = [c for c in answers if c["det"].get("mg_verdict_wait")]
        if waits:  # a deterministic response ends with its verdict event, after the last chunk
            lines += ["", "The verdict event after the body's last chunk, all rows deterministic (ms, median over "
                      "the reps) [min..max]:", "", "| config | " + " | ".join(f"bs {b}" for b in r["batches"]) + " |",
                      "|---" * (1 + len(r["batches"])) + "|"]
            for c in waits:
                w = c["det"]["mg_verdict_wait"]
                lines.append(f"| mg margin ~{c['target']}{_variant(c)} | " + " | ".join(
                    f"{w[b]['median']:.0f} [{min(w[b]['all']):.0f}..{max(w[b]['all']):.0f}]" if b in w else ""
                    for b in r["batches"]) + " |")
    held = [(c, part, bs, x) for c in r["configs"] for part in ("det", "mixed")
            for bs, x in sorted(c[part].get("by_batch", {}).items())]
    if held:
        lines += ["", "Per batch size (mg's counters around each batch size's runs):", "",
                  "| config | traffic | bs | trigger | verify calls per deterministic forward | verify call ms | rows per call "
                  "| deterministic steps | rollbacks | steps dropped + stale | steps past the answers "
                  "| the seam's ms a forward without a check | requests still tracked after (seam / controller) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for c, part, bs, x in held:
            lines.append(f"| margin ~{c['target']}{_variant(c)}, {c.get('commit', 'hold')} | "
                         f"{'all det.' if part == 'det' else '25 % det.'} | {bs} | {100 * x['trigger']:.1f} % | "
                         + " | ".join("" if x[k] is None else format(x[k], ".2f")
                                      for k in ("calls_per_forward", "verify_call_ms", "rows_per_call")) + " | "
                         + f"{x['steps']:.0f} | {x['rollbacks']:.0f} | "
                         # (blank in a file recorded before these counters)
                         + ("| |" if "dropped_steps" not in x else
                            f"{x['dropped_steps'] + x['stale_steps']:.0f} | {x['lookahead_steps']:.0f} |")
                         + ("" if x.get("fast_control_ms") is None else f" {x['fast_control_ms']:.2f}") + " |"
                         + ("" if "tracked_after" not in x else " " + " / ".join(
                             "-" if x[k] is None else f"{x[k]:.0f}" for k in ("tracked_after", "live_after")))
                         + " |")
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
        commits = sorted({c.get("commit", "hold") for c in r["configs"]}, reverse=True)
        for b in r["batches"]:
            for commit, style in zip(commits, ("o-", "x--")):
                pts = sorted((100 * c["det"]["trigger"], 100 * (c["det"]["mg"][b]["median"] - c["det"]["base"][b]["median"])
                              / c["det"]["base"][b]["median"]) for c in r["configs"]
                             if c.get("commit", "hold") == commit and b in c["det"]["mg"])
                ax.plot([x for x, _ in pts], [y for _, y in pts], style, label=f"mg {commit}, batch {b}, all det.")
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


# ---- back-to-back batches ----------------------------------------------------------------------
B2B_DOC = """Deterministic batches posted back to back, against the same batches after a pause.

    python3 benchmarks/gpu_sweep.py back-to-back --out OUT.json (--url http://HOST:PORT | --checkpoint DIR --tau T)
        [--prompts PROMPTS.json] [--tokens 64] [--reps 2]

Each batch is one streamed /generate body of 32 rows (X-Deterministic: 1), read to its end (the
verdict event included) before the next is posted. Per batch: the rows' first chunk, the chunk
at token 16 and the last chunk (seconds from the post; median and max over the rows), how long
after the last row's last chunk the verdict event came, and the differences of mg's counters
around it, so a slow batch shows whether it did more checks or waited. Patterns, in order: a warm-up batch; `--reps` batches back to back (8 prompts, each 4
times); `--reps` after a 2 s pause each; `--reps` of 32 distinct prompts back to back, then after a
pause each (a quarter of them ~1,250 tokens long); two plain batches back to back, then two of the
distinct prompts. PROMPTS.json: token ids under "det", "other" and "prefix" (default
benchmarks/data/gpu_prompts.json, the sweep's). --checkpoint starts a margin server of the smol shape on CUDA at --tau
(gpu_e2e.start, lagged seam) and stops it after; on the device machine after
`benchmarks/device.sh smol build`, e.g. --checkpoint /tmp/mg-models/smol-real --tau 0.578125.
"""

B2B_COUNTERS = ("mg_rollbacks_total", "mg_verify_seconds_count", "mg_verify_seconds_sum", "mg_lookahead_steps_total",
                "mg_rollback_dropped_steps_total", "mg_stale_steps_total", "steps_fast", "steps_verify")
B2B_ROWS = 32
B2B_PAUSE_S = 2.0
B2B_MIN_TOKENS = 16  # each row's chunk at token 16 is timed


def b2b_batch(url: str, rows: list[list[int]], tokens: int, det: bool) -> dict:
    """One streamed body, read to its end -> its rows' chunk times and mg's counter differences."""
    import requests

    from mg_server.evaluation.determinism import scrape

    params = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0, "stream_interval": 8}
    before = scrape(url, B2B_COUNTERS)
    posted, marks = time.perf_counter(), {}
    with requests.post(url + "/generate", json={"input_ids": rows, "sampling_params": params, "stream": True},
                       headers={"X-Deterministic": "1"} if det else {}, timeout=600, stream=True) as r:
        r.raise_for_status()
        points, states = read_stream(r, marks=marks)
    done = time.perf_counter() - posted
    after = scrape(url, B2B_COUNTERS)
    if len(points) != len(rows):
        raise RuntimeError(f"{len(points)} of {len(rows)} rows streamed")
    first = [p[0][1] - posted for p in points.values()]
    t16 = [next(t for n, t in p if n >= B2B_MIN_TOKENS) - posted for p in points.values()]
    last = [p[-1][1] - posted for p in points.values()]
    return {"first_med": statistics.median(first), "first_max": max(first), "t16_med": statistics.median(t16),
            "last_med": statistics.median(last), "last_max": max(last), "done": done, "states": sorted(set(states)),
            "verdict_wait_ms": verdict_wait_ms(points, marks) if det else None,
            "counters": {k: after[k] - before[k] for k in B2B_COUNTERS}}


def b2b_run(url: str, prompts: dict, tokens: int, reps: int) -> list[dict]:
    other = prompts["other"]
    repeated = [other[i % len(other)] for i in range(B2B_ROWS)]
    distinct = (prompts["det"] + prompts["other"] + prompts["prefix"])[:B2B_ROWS]
    plan = [("warm-up", repeated, 1, 0.0, True), ("back to back", repeated, reps, 0.0, True),
            ("after a pause", repeated, reps, B2B_PAUSE_S, True), ("distinct, back to back", distinct, reps, 0.0, True),
            ("distinct, after a pause", distinct, reps, B2B_PAUSE_S, True),
            ("plain, back to back", repeated, 2, 0.0, False), ("plain, distinct", distinct, 2, 0.0, False)]
    out = []
    for name, rows, n, pause, det in plan:
        for i in range(n):
            time.sleep(pause)
            b = {"pattern": name, "i": i, **b2b_batch(url, rows, tokens, det)}
            out.append(b)
            wait = f"verdict {b['verdict_wait_ms']:.0f} ms after the last chunk, " if det else ""
            print(f"{name} #{i}: first chunk {b['first_med']:.3f} s (max {b['first_max']:.3f}), last "
                  f"{b['last_med']:.3f} s, {wait}{b['counters']['mg_verify_seconds_count']:.0f} verify calls, "
                  f"{b['counters']['mg_rollbacks_total']:.0f} rollbacks", flush=True)
    return out


def back_to_back_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="gpu_sweep.py back-to-back", description=B2B_DOC)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=Path, default=Path(__file__).resolve().parent / "data" / "gpu_prompts.json")
    ap.add_argument("--url")
    ap.add_argument("--checkpoint", type=Path)
    ap.add_argument("--tau", type=float)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args(argv)
    if (args.url is None) == (args.checkpoint is None) or (args.checkpoint is None) != (args.tau is None):
        ap.error("give --url (a running server), or --checkpoint with --tau")
    if args.tokens < B2B_MIN_TOKENS:
        ap.error(f"--tokens must be at least {B2B_MIN_TOKENS}")
    prompts = json.loads(args.prompts.read_text())
    srv = None
    if args.checkpoint is not None:
        srv = E.start(args.checkpoint, "smol", "margin", args.out.parent,
                      ["--mg-tau", str(args.tau), *E.mem_flags("smol")], "cuda")
    try:
        res = b2b_run(srv.url if srv else args.url, prompts, args.tokens, args.reps)
    finally:
        if srv is not None:
            srv.stop()
    server = {"url": args.url} if args.url else {"checkpoint": str(args.checkpoint), "tau": args.tau}
    args.out.write_text(json.dumps({"tokens": args.tokens, "rows": B2B_ROWS, "pause_s": B2B_PAUSE_S, "server": server,
                                    "batches": res}, indent=1))
    return 0


def main() -> int:
    if sys.argv[1:2] == ["back-to-back"]:
        return back_to_back_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out/gpu-sweep"))
    ap.add_argument("--wheels", type=Path)
    ap.add_argument("--tokenizer", type=Path)
    ap.add_argument("--models", default="smol")
    ap.add_argument("--models-dir", default="/tmp/mg-models")
    ap.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                    help="time this Hugging Face checkpoint (e.g. smol=DIR: the real SmolLM2, "
                         "benchmarks/device.sh smol) instead of random weights of NAME's shape")
    ap.add_argument("--tokens", type=int, default=64, help="reference tokens per prompt (the margins tau comes from)")
    ap.add_argument("--decode-tokens", type=int, default=130)
    ap.add_argument("--short-tokens", type=int, default=2,
                    help="the shorter run of each ms/step difference (decode_ms says why 2)")
    ap.add_argument("--stream-interval", type=int, default=0,
                    help="> 0: time streamed answers instead, a chunk every this many tokens (steady_ms, answer_ms)")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--rates", default="0.05,0.1,0.2,always", help="target trigger rates; 'always' = mode always")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--sglang-det", action="store_true", help="also time SGLang's --enable-deterministic-inference")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--configs", default="",
                    help="RATE[:wW],... to time instead of every --rates value (e.g. 0.1,0.1:w8,t0.5,always; "
                         "tX: tau X itself, e.g. a shipped profile's; wW: serve --mg-window W)")
    ap.add_argument("--tau-margins", choices=["fp32", "bf16"], default="fp32",
                    help="which reference margins tau comes from: the verifier's fp32 ones (default), or those "
                         "of its logits rounded to bf16, as SGLang's bf16 lm_head shows them to the seam (the "
                         "8B shape: its fp32-derived tau caught every bf16 tie, 17 %% of steps for a 10 %% target)")
    ap.add_argument("--prompt-tokens", type=int, default=0,
                    help="> 0: lengthen every timed prompt to this many tokens (its own tokens repeated): the "
                         "cost of long prompts' first checks")
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--summarize", type=Path, nargs="+", metavar="JSON",
                    help="only print the tables of earlier results files (no GPU needed)")
    args = ap.parse_args()
    if args.summarize:
        print("\n".join(summarize(load(p)) for p in args.summarize))
        return 0
    args.batches = [int(b) for b in args.batches.split(",")]
    if bad := [c for c in args.checkpoint if "=" not in c or c.split("=", 1)[0] not in E.SHAPES]:
        ap.error(f"--checkpoint takes NAME=DIR with NAME one of {sorted(E.SHAPES)}: {bad}")
    args.checkpoint = dict(c.split("=", 1) for c in args.checkpoint)
    args.rates = args.rates.split(",")
    args.configs = ([tuple(c.split(":")) for c in args.configs.split(",")] if args.configs
                    else [(r,) for r in args.rates])
    E.setup_python(args.wheels)
    args.tokenizer = args.tokenizer or E._default_tokenizer()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(E.PROMPTS_FILE.read_text())
    if args.limit:
        prompts = {k: v[: args.limit] for k, v in prompts.items()}
    if args.prompt_tokens:  # the timed prompts only (tau still comes from the reference prompts' margins)
        prompts["other"] = [(p * (args.prompt_tokens // len(p) + 1))[: args.prompt_tokens] for p in prompts["other"]]
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
