"""Diagnostic for benchmarks only (mg never imports it).

With MG_PROF=1 and this folder first on PYTHONPATH, every Python process that loads
`mg_server.sglang_ext.lagged` times LaggedControl's host work per call -- wall time and this
thread's CPU time (a gap between them is waiting: the GPU, a lock, the GIL) -- and writes the sums
to /tmp/mgprof/<pid>.json every 100 launches. Calls over 20 ms (first calls, compiles) are
counted apart under "<name>_slow".
"""

import os
import sys

if os.environ.get("MG_PROF") == "1":
    import importlib.abc
    import importlib.util
    import json
    import threading
    import time

    STATS: dict = {}  # name -> [calls, wall seconds, thread CPU seconds]
    LOCK = threading.Lock()

    def rec(name: str, wall: float, cpu: float) -> None:
        with LOCK:
            if wall > 0.02:
                name += "_slow"
            s = STATS.setdefault(name, [0, 0.0, 0.0])
            s[0] += 1
            s[1] += wall
            s[2] += cpu
            if name == "launch" and s[0] % 100 == 0:
                os.makedirs("/tmp/mgprof", exist_ok=True)
                with open(f"/tmp/mgprof/{os.getpid()}.json", "w") as f:
                    json.dump(STATS, f)

    def wrap(name: str, fn):
        def timed(*a, **k):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*a, **k)
            finally:
                rec(name, time.perf_counter() - t0, time.thread_time() - c0)
        return timed

    def patch(mod) -> None:
        lc = mod.LaggedControl
        lc.launch = wrap("launch", lc.launch)
        lc._process = wrap("process", lc._process)
        lc.drain = wrap("drain", lc.drain)
        mod.top2 = wrap("top2", mod.top2)
        mod.StepGate.launch = wrap("gate_launch", mod.StepGate.launch)

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "mg_server.sglang_ext.lagged":
                return None
            sys.meta_path.remove(self)
            spec = importlib.util.find_spec(name)
            run = spec.loader.exec_module

            def exec_module(m):
                run(m)
                patch(m)
            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())
