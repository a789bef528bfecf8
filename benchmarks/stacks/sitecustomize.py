"""Where each process's main thread spends its time: a stack sampler for benchmark runs.

On only where STACK_SAMPLES_DIR is set and this folder is on PYTHONPATH (`offline_throughput.py
--stacks DIR` does both for the servers it starts; every process they spawn inherits it). A
daemon thread reads the main thread's Python stack every 2 ms and adds the time since its last
read to that stack, so a stack's total is wall time whether the thread ran Python, waited on the
GPU or held no GIL. Collapsed stacks ("file:function;..." seconds) go to DIR/<pid>-<phase>.txt:
the phase is the text of DIR/phase, which the benchmark sets around each timed run; each phase
change writes the last phase's file and starts counting afresh.

Run as a script, this file summarizes one phase's files, per process: its sampled seconds, the
functions with the most inclusive time (leaving out those under every sample), and for each
--under function (e.g. scheduler.py:event_loop_overlap) the split of its time by the calls below
it, N levels deep:

    python benchmarks/stacks/sitecustomize.py DIR PHASE [--under FUNC ...] [--depth N]
"""

import os

_DIR = os.environ.get("STACK_SAMPLES_DIR")
PERIOD_S = 0.002  # sampling period; the sampler's own GIL time stays well under 1 %
PHASE_CHECK_S = 0.05  # how often the phase file is read (not at every sample: a file open each 2 ms)
KEEP = 4000  # stacks written per file (the heaviest)


def _sampler(out: str) -> None:
    import collections
    import sys
    import threading
    import time

    main = threading.main_thread().ident
    seconds: collections.Counter = collections.Counter()  # collapsed stack -> seconds
    names: dict = {}  # code object -> "file:function"
    phase_file = os.path.join(out, "phase")
    t0 = last = written = checked = time.perf_counter()
    phase = ph = "start"

    def write(tag: str) -> None:
        import multiprocessing

        path = os.path.join(out, f"{os.getpid()}-{tag}.txt")
        with open(path + ".tmp", "w") as f:
            f.write(f"# {multiprocessing.current_process().name} {' '.join(sys.argv)[:300]} "
                    f"wall={time.perf_counter() - t0:.3f}\n")
            for stack, s in seconds.most_common(KEEP):
                f.write(f"{stack} {s:.6f}\n")
        os.replace(path + ".tmp", path)

    def current_phase() -> str:
        try:
            with open(phase_file) as f:
                return f.read().strip() or "idle"
        except OSError:
            return "start"

    while True:
        time.sleep(PERIOD_S)
        now = time.perf_counter()
        dt, last = now - last, now
        frame = sys._current_frames().get(main)
        stack = []
        while frame is not None and len(stack) < 60:
            code = frame.f_code
            name = names.get(code)
            if name is None:
                name = names[code] = f"{os.path.basename(code.co_filename)}:{code.co_name}"
            stack.append(name)
            frame = frame.f_back
        if stack:
            seconds[";".join(reversed(stack))] += dt
        if now - checked >= PHASE_CHECK_S:
            ph, checked = current_phase(), now
        if ph != phase or now - written > 15.0:  # a killed server keeps all but its last 15 s
            try:
                write(phase)
            except OSError:
                pass
            written = now
            if ph != phase:
                seconds.clear()
                phase = ph


if _DIR:
    import threading as _threading

    os.makedirs(_DIR, exist_ok=True)
    _threading.Thread(target=_sampler, args=(_DIR,), name="stack-sampler", daemon=True).start()


def _load(path) -> tuple[str, list[tuple[list[str], float]]]:
    lines = path.read_text().splitlines()
    rows = []
    for line in lines[1:]:
        stack, _, s = line.rpartition(" ")
        rows.append((stack.split(";"), float(s)))
    return lines[0], rows


def _summarize() -> None:
    import argparse
    import collections
    from pathlib import Path

    ap = argparse.ArgumentParser(prog="sitecustomize.py", description="a phase's stack samples, per process")
    ap.add_argument("dir", type=Path)
    ap.add_argument("phase")
    ap.add_argument("--under", action="append", default=[])
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    for path in sorted(args.dir.glob(f"*-{args.phase}.txt")):
        head, rows = _load(path)
        total = sum(s for _, s in rows)
        incl = collections.Counter()
        for stack, s in rows:
            for f in set(stack):
                incl[f] += s
        print(f"\n{path.name}: {head[2:80]} ... sampled {total:.2f} s")
        # (frames under every sample, the process's entry points, say nothing)
        for f, s in [(f, s) for f, s in incl.most_common() if s < 0.99 * total][:args.top]:
            print(f"  {s:8.3f} s  {f}")
        for func in args.under:
            split = collections.Counter()
            for stack, s in rows:
                if func in stack:
                    k = stack.index(func)
                    split[";".join(stack[k + 1:k + 1 + args.depth]) or "(itself)"] += s
            if split:
                print(f"  under {func} ({sum(split.values()):.3f} s):")
                for f, s in split.most_common(args.top):
                    print(f"    {s:8.3f} s  {f}")


if __name__ == "__main__":
    _summarize()
