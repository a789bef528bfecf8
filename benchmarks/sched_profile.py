"""Where SGLang's scheduler process spends a deterministic batch's time: py-spy profiles of its
threads under steady bs-8 traffic, per server configuration.

    python benchmarks/sched_profile.py --out DIR --checkpoint /tmp/mg-models/smol-real \
        --py-spy /tmp/pyspy/bin/py-spy [--configs plain,lag] [--seconds 10]
    python benchmarks/sched_profile.py --analyze DIR      # the tables again, from the saved stacks

Per configuration it starts one server (gpu_e2e.start; plain = `--mg-mode off`), keeps bodies of
8 requests of 128 tokens coming (deterministic ones for mg), and samples SGLang's scheduler
process three ways for `--seconds` each (py-spy record --nonblocking --threads, raw collapsed
stacks): `active` (threads on a CPU), `gil` (the thread holding the GIL) and `idle` (every thread,
blocked or not). The tables: the share of the scheduler thread's wall time per step phase and per
mg frame, the leaves it waits in, and who holds the GIL. Why: to tell a step that waits for the
GPU from one that waits for mg's control path or for the GIL (README, "Where performance stands").
py-spy is not a dependency: bring its wheel (`pip download py-spy`) and install it on the device.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIGS = {  # name -> (mg mode, serve flags); tau 0.245557 gave 9.8 % triggers at bs 8 (real SmolLM2)
    "plain": ("off", []),
    "window": ("margin", ["--mg-tau", "0.245557"]),
}
AHEAD = "mg-verify-ahead"  # a thread of that name (none since the verify-ahead thread was removed), inclusive
MG_FILES = ("lagged.py", "window.py", "rollback.py", "hook.py", "link.py", "processor.py", "gate.py", "decide.py")
CALL = "DirectControllerClient.step"  # a hosted verify call (none since the hosted controller was removed)


def load(path: Path) -> list[tuple[list[str], int]]:
    """py-spy's raw format: `thread (tid): name;frame;frame... count` per line."""
    rows = []
    text = gzip.open(path, "rt").read() if path.suffix == ".gz" else path.read_text()  # (kept gzipped)
    for line in text.splitlines():
        if line.strip():
            stack, n = line.rsplit(" ", 1)
            rows.append((stack.split(";"), int(n)))
    return rows


def _fn(frame: str) -> str:
    return frame.split(" (")[0]


def _file(frame: str) -> str:
    return frame.split(" (")[1].split(":")[0].rsplit("/", 1)[-1] if " (" in frame else ""


def analyze(path: Path, thread: str = "MainThread", top: int = 12) -> dict:
    rows = load(path)
    per_thread = collections.Counter()
    phase, mg, leaf = collections.Counter(), collections.Counter(), collections.Counter()
    call, call_leaf = collections.Counter(), collections.Counter()
    ahead = collections.Counter()
    for st, n in rows:
        per_thread[st[0].split(": ", 1)[-1]] += n
        if st[0].endswith(AHEAD):
            for f in dict.fromkeys(f"{_fn(x)} ({_file(x)})" for x in st[1:]):  # (each function once per sample)
                ahead[f] += n
        if not st[0].endswith(thread):
            continue
        names = [_fn(x) for x in st]
        i = names.index("Scheduler.event_loop_overlap") if "Scheduler.event_loop_overlap" in names else -1
        phase[names[i + 1] if 0 <= i < len(names) - 1 else "(other)"] += n
        if CALL in names:  # where a hosted Step call's time goes: the first frames below it
            j = names.index(CALL)
            call[" > ".join(names[j + 1:j + 4]) or "(the call itself)"] += n
            call_leaf[f"{names[-1]} ({_file(st[-1])})"] += n
        frames = [x for x in st if _file(x) in MG_FILES]
        if frames:
            mg[f"{_fn(frames[0])} > {_fn(st[-1])}"] += n
        leaf[f"{names[-1]} ({_file(st[-1])})"] += n
    tot = sum(phase.values()) or 1
    pick = (lambda c: [(k, v, round(100 * v / tot, 1)) for k, v in c.most_common(top)])
    own = per_thread.get(next((t for t in per_thread if t.endswith(AHEAD)), ""), 0) or 1
    return {"samples": dict(per_thread), "thread_samples": tot, "phases": pick(phase), "mg": pick(mg),
            "leaves": pick(leaf), "hosted_call": pick(call), "hosted_call_leaves": pick(call_leaf),
            # the ahead thread's functions, % of its own samples
            "ahead_thread": [(k, v, round(100 * v / own, 1)) for k, v in ahead.most_common(2 * top)]}


def report(out: Path) -> str:
    lines, res = [], {}
    for f in sorted([*out.glob("*_*.txt"), *out.glob("*_*.txt.gz")]):
        name, kind = f.name.split(".txt")[0].rsplit("_", 1)
        if kind not in ("active", "gil", "idle"):
            continue
        a = res.setdefault(name, {})[kind] = analyze(f)
        lines.append(f"== {name} / {kind}: samples by thread {a['samples']}")
        if kind != "gil":
            for title in ("phases", "mg", "leaves", "hosted_call", "hosted_call_leaves"):
                lines.append(f"  scheduler thread, {title}:")
                lines += [f"    {pct:5.1f}%  {k}" for k, _, pct in a[title]]
        if a["ahead_thread"]:
            lines.append(f"  {AHEAD} thread ({kind}), functions, % of its samples:")
            lines += [f"    {pct:5.1f}%  {k}" for k, _, pct in a["ahead_thread"]]
    (out / "sched_profile.json").write_text(json.dumps(res, indent=1))
    (out / "sched_profile.md").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def run(args) -> None:
    sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]  # gpu_e2e, and its server_util
    import gpu_e2e as E
    import gpu_sweep as S

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prompts = json.loads(E.PROMPTS_FILE.read_text())["other"]
    steps = {}
    for name in args.configs.split(","):
        mode, flags = CONFIGS[name]
        (out / name).mkdir(exist_ok=True)
        srv = E.start(Path(args.checkpoint), "smol", mode, out / name, flags + E.mem_flags("smol"), "cuda")
        n_det, times, stop = (0 if mode == "off" else 8), [], threading.Event()

        t = threading.Thread(target=S.keep_bodies, args=(srv.url, prompts, n_det, stop, times), daemon=True)
        t.start()
        time.sleep(8)  # past the first bodies (compiles, prefix cache)
        pid = subprocess.run(["pgrep", "-f", "sglang::scheduler"], capture_output=True, text=True).stdout.split()[0]
        for kind, extra in (("active", []), ("gil", ["--gil"]), ("idle", ["--idle"])):
            subprocess.run([args.py_spy, "record", "--pid", pid, "--duration", str(args.seconds), "--rate", "250",
                            "--nonblocking", "--threads", "--format", "raw", "-o", str(out / f"{name}_{kind}.txt"),
                            *extra], capture_output=True, text=True, check=False)
        stop.set()
        t.join(120)
        steps[name] = [round(1e3 * x / 128, 3) for x in times if x]
        srv.stop()
    (out / "sched_profile_steps.json").write_text(json.dumps(steps, indent=1))
    print(report(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    ap.add_argument("--analyze", help="a folder of saved stacks: print the tables again")
    ap.add_argument("--checkpoint", default="/tmp/mg-models/smol-real")
    ap.add_argument("--py-spy", default=os.environ.get("PYSPY", "py-spy"))
    ap.add_argument("--configs", default="plain,window")
    ap.add_argument("--seconds", type=int, default=10)
    args = ap.parse_args()
    if args.analyze:
        print(report(Path(args.analyze)))
    elif args.out:
        run(args)
    else:
        ap.error("--out or --analyze")


if __name__ == "__main__":
    main()
