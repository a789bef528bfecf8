"""Where each process's main thread spends its time: a stack sampler for benchmark runs.

On only where STACK_SAMPLES_DIR is set and this folder is on PYTHONPATH (`offline_throughput.py
--stacks DIR` does both for the servers it starts; every process they spawn inherits it). A
daemon thread reads the main thread's Python stack every 2 ms and adds the time since its last
read to that stack, so a stack's total is wall time whether the thread ran Python, waited on the
GPU or held no GIL. Collapsed stacks ("file:function;..." seconds) go to DIR/<pid>-<phase>.txt:
the phase is the text of DIR/phase, which the benchmark sets around each timed run; each phase
change writes the last phase's file and starts counting afresh. `summarize.py` reads them.
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
