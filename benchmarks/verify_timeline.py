"""Where one verify call's time goes, across mg's three processes, from the timelines that
benchmarks/prof_site records (MG_PROF=1; every process stamps calls on the same monotonic clock).

    python benchmarks/verify_timeline.py /tmp/mgprof [--out timeline.json]

A held check is the seam's ControllerClient.step that contains a controller step with a verifier
call. Its segments, in order (median and p90 ms over all such checks):
  seam -> controller    the request's trip and the controller's receive loop
  controller before     the controller's work before it calls the verifier (policy, catch-up items)
  controller -> verifier, verifier before forward, forward (the engine's, graph replay and output
  copy), verifier after forward (slot writes, reply encode), verifier -> controller,
  controller after, controller -> seam
and, on the lagged seam, "seam after": from the reply to the end of LaggedControl._process (the
gate's answer and its acknowledgement). The main stream is held through all of it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

SEGMENTS = ["seam -> controller", "controller before", "controller -> verifier", "verifier before forward",
            "forward", "verifier after forward", "verifier -> controller", "controller after",
            "controller -> seam", "seam after", "total (seam's call)"]


def load(folder: Path) -> list[tuple[str, float, float]]:
    """Every process's timeline (a folder of prof_site dumps, or one combined profile.json)."""
    files = sorted(folder.glob("*.json")) if folder.is_dir() else [folder]
    dumps = []
    for f in files:
        d = json.loads(f.read_text())
        dumps += list(d.values()) if "timeline" not in d and all(isinstance(v, dict) for v in d.values()) else [d]
    return sorted((n, t0, t1) for d in dumps for n, t0, t1 in d.get("timeline", []))


def within(calls, name: str, t0: float, t1: float) -> list[tuple[float, float]]:
    return [(a, b) for n, a, b in calls if n == name and t0 <= a and b <= t1]


def checks(calls) -> list[dict]:
    """The segments (seconds) of every held check."""
    out = []
    for n, s0, s1 in calls:
        if n != "client_step":
            continue
        steps = within(calls, "ctl_step", s0, s1)
        if len(steps) != 1:
            continue
        c0, c1 = steps[0]
        vcalls = within(calls, "ctl_verify_call", c0, c1)
        if not vcalls:
            continue  # a fast step: nothing was verified
        v0, v1 = vcalls[0][0], vcalls[-1][1]
        handles = within(calls, "v_handle_batch", v0, v1)
        fwd = within(calls, "v_forward", v0, v1)
        if not handles or not fwd:
            continue
        h0, h1 = handles[0][0], handles[-1][1]
        seg = {"seam -> controller": c0 - s0, "controller before": v0 - c0, "controller -> verifier": h0 - v0,
               "verifier before forward": fwd[0][0] - h0, "forward": sum(b - a for a, b in fwd),
               "verifier after forward": h1 - fwd[-1][1], "verifier -> controller": v1 - h1,
               "controller after": c1 - v1, "controller -> seam": s1 - c1, "total (seam's call)": s1 - s0}
        # several forwards (catch-up chunks): the host time between them counts as the verifier's "after"
        seg["verifier after forward"] += sum(b0 - a1 for (_, a1), (b0, _) in zip(fwd, fwd[1:]))
        proc = [(a, b) for nn, a, b in calls if nn == "process" and a <= s0 and s1 <= b]
        if proc:
            seg["seam after"] = proc[0][1] - s1
        seg["verifier calls"] = len(vcalls)
        out.append(seg)
    return out


def summarize(rows: list[dict]) -> dict:
    res = {}
    for k in SEGMENTS:
        xs = sorted(r[k] * 1e3 for r in rows if k in r)
        if xs:
            res[k] = {"median_ms": statistics.median(xs), "p90_ms": xs[int(0.9 * (len(xs) - 1))], "n": len(xs)}
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", type=Path, help="prof_site's dump folder (/tmp/mgprof) or a combined profile.json")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = checks(load(args.source))
    if not rows:
        print("no held checks in the timelines (was MG_PROF=1 set, and did a check verify anything?)")
        return 1
    res = summarize(rows)
    print(f"{len(rows)} held checks\n\n| segment | median ms | p90 ms |\n|---|---|---|")
    for k, v in res.items():
        print(f"| {k} | {v['median_ms']:.3f} | {v['p90_ms']:.3f} |")
    if args.out:
        args.out.write_text(json.dumps({"checks": len(rows), "segments": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
