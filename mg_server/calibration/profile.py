"""The tau profile document: what a calibration measured and the tau it chose.

`mg_server.policy` reads `tau` and finds a shipped profile by `model_id` and `device`; everything
else is the evidence. JSON has no infinity, so the sweep's tau = inf row carries the string "inf".
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np

from mg_server.calibration import sweep
from mg_server.calibration.sweep import SetData

SCHEMA = "mg-tau-profile/1"
HIST_EDGES = [i / 8 for i in range(0, 4 * 8 + 1)]  # margin bins of 1/8 logit up to 4, then >= 4


def build(cfg, serving: dict, kernel_config_id: str, sets: list[SetData], model_id: str = "") -> dict:
    steps = {d.name: sweep.flatten(d.traces, d.ref_margins) for d in sets}
    per_set = {d.name: _set_summary(d, steps[d.name]) for d in sets}
    calib = sets[0].name
    raw = sweep.choose_tau(steps[calib], cfg.safety_factor)
    choice = {k: _num(v) if isinstance(v, float) else v for k, v in raw.items()}  # no flips: inf safety
    taus = {name: sweep.choose_tau(st, cfg.safety_factor)["tau"] for name, st in steps.items()}
    grid = set(sweep.BASE_GRID) | set(taus.values()) | {sweep.tau100(st) for st in steps.values()} | {math.inf}
    for name, st in steps.items():
        per_set[name]["sweep"] = [_row(r) for r in sweep.sweep(st, grid)]
        per_set[name]["max_flip_margin"] = _num(sweep.max_flip_margin(st))
        per_set[name]["tau100"] = sweep.tau100(st)
        per_set[name]["own_tau"] = taus[name]
        per_set[name]["margin_shift"] = sweep.quantiles(sweep.margin_shift(st))
    transfer = [{"from": a, "to": b, **_row(sweep.at_tau(steps[b], taus[a]))}
                for a in steps for b in steps if a != b]
    return {
        "schema": SCHEMA,
        "model": Path(cfg.model_path).name,  # for people: a shipped profile is found by model_id
        "model_id": model_id,  # mg_server.checkpoint.model_identity of the calibrated checkpoint
        "tau": choice["tau"],
        "source": f"mg-server calibrate on {calib} ({time.strftime('%Y-%m-%d')}): tau100 {raw['tau100']:g} "
                  f"x safety {raw['safety_factor']:.3g}",
        "serving": f"sglang-{serving['sglang_version']} {serving['device']} {serving['attention_backend']} "
                   f"{serving['dtype']}",
        "dtype": serving["dtype"],
        "sglang": {"version": serving["sglang_version"], **{k: v for k, v in serving.items() if k != "sglang_version"}},
        "device": cfg.device,
        "kernel_config_id": kernel_config_id,
        "command": cfg.command,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "max_tokens": cfg.max_tokens,
        "limit": cfg.limit,
        "batch_sizes": list(cfg.batch_sizes),
        "calibration_set": calib,
        "tau_choice": choice,
        "sets": per_set,
        "transfer": transfer,
    }


def _set_summary(d: SetData, st: sweep.Steps) -> dict:
    flips = []
    for bs in sorted(d.traces):
        for tr in d.traces[bs]:
            for pos, f in enumerate(tr.flips):
                if f:
                    ref = d.refs[tr.prompt][pos]
                    flips.append({"batch_size": bs, "prompt": tr.prompt, "pos": pos, "margin": _num(tr.margins[pos]),
                                  "ref_margin": d.ref_margins[tr.prompt][pos], "fast_token": tr.fast_tokens[pos],
                                  "ref_token": ref, "ref_is_runner_up": tr.second_tokens[pos] == ref})
    stable = st.margin[~st.flip]
    flipped = st.margin[st.flip]
    return {
        "source": d.source,
        "prompts": len(d.prompts),
        "steps": int(len(st.margin)),
        "flips": int(st.flip.sum()),
        "flip_rate": float(st.flip.mean()) if len(st.flip) else 0.0,
        "by_batch_size": sweep.by_batch_size(st),
        "rounds": sum(tr.rounds for trs in d.traces.values() for tr in trs),
        "margin_histogram": {"edges": HIST_EDGES + [HIST_EDGES[-1] + 1 / 8],  # last bin: >= 4
                             "stable": _hist(stable), "flipped": _hist(flipped)},
        "flip_list": flips,
    }


def _hist(x: np.ndarray) -> list[int]:
    x = np.minimum(x[~np.isnan(x)], HIST_EDGES[-1])  # overflow into the last bin
    counts, _ = np.histogram(x, bins=HIST_EDGES + [HIST_EDGES[-1] + 1 / 8])
    return [int(c) for c in counts]


def _row(r: dict) -> dict:
    return {**r, "tau": _num(r["tau"])}


def _num(x: float):
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf" if x < 0 else "nan")


def tau_value(x) -> float:
    return float(x)  # float("inf") reads the "inf" rows


def check(prof: dict) -> list[str]:
    """Schema and internal consistency; returns the problems (empty: consistent)."""
    p: list[str] = []
    for k, t in (("model", str), ("model_id", str), ("tau", (int, float)), ("sets", dict), ("calibration_set", str),
                 ("batch_sizes", list), ("transfer", list), ("tau_choice", dict), ("kernel_config_id", str)):
        if not isinstance(prof.get(k), t):
            p.append(f"{k}: missing or not {t}")
    if p:
        return p
    if not prof["tau"] >= 0:
        p.append("tau < 0")
    if prof["calibration_set"] not in prof["sets"]:
        p.append("the calibration set has no data")
    for name, s in prof["sets"].items():
        rows = s.get("sweep") or []
        taus = [tau_value(r["tau"]) for r in rows]
        if not rows or taus != sorted(taus) or len(set(taus)) != len(taus) or taus[-1] != math.inf:
            p.append(f"{name}: sweep taus not strictly ascending up to inf")
            continue
        for key in ("trigger", "recall", "determinism"):
            vals = [r[key] for r in rows]
            if any(b < a for a, b in zip(vals, vals[1:])):
                p.append(f"{name}: {key} not monotone in tau")
            if not all(0 <= v <= 1 for v in vals):
                p.append(f"{name}: {key} outside [0, 1]")
        if rows[-1]["determinism"] != 1.0 or rows[-1]["recall"] != 1.0:
            p.append(f"{name}: determinism/recall at tau = inf is not 100 %")
        bbs = s["by_batch_size"]
        if sum(b["steps"] for b in bbs.values()) != s["steps"] or sum(b["flips"] for b in bbs.values()) != s["flips"]:
            p.append(f"{name}: per-batch-size steps/flips do not add up")
        if len(s["flip_list"]) != s["flips"] or sum(s["margin_histogram"]["flipped"]) != s["flips"]:
            p.append(f"{name}: flip list / histogram disagree with the flip count")
        if sum(s["margin_histogram"]["stable"]) + s["flips"] != s["steps"]:
            p.append(f"{name}: histogram does not count every step")
        for r in rows:
            below = sum(1 for f in s["flip_list"]
                        if f["margin"] == "nan" or tau_value(f["margin"]) < tau_value(r["tau"]))
            if s["flips"] and abs(r["recall"] - below / s["flips"]) > 1e-12:
                p.append(f"{name}: recall at tau {r['tau']} disagrees with the flip margins")
                break
            if r["missed_flips"] != s["flips"] - below:
                p.append(f"{name}: missed flips at tau {r['tau']} disagree with the flip margins")
                break
    calib = prof["sets"].get(prof["calibration_set"])
    if calib:
        at = [r for r in calib["sweep"] if tau_value(r["tau"]) == prof["tau"]]
        if not at or at[0]["recall"] != 1.0:
            p.append("the chosen tau does not catch every flip of the calibration set")
    if prof["tau_choice"].get("tau") != prof["tau"]:
        p.append("tau_choice.tau != tau")
    for t in prof["transfer"]:
        rows = [r for r in prof["sets"].get(t["to"], {}).get("sweep", []) if r["tau"] == t["tau"]]
        if not rows or any(rows[0][k] != t[k] for k in ("trigger", "recall", "determinism")):
            p.append(f"transfer {t['from']}->{t['to']}: not the target's sweep row at tau {t['tau']}")
    return p
