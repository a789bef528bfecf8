"""Diagnostic for benchmarks only (mg never imports it).

With MG_PROF=1 and this folder first on PYTHONPATH, every Python process that loads one of the
modules in TARGETS times the listed functions per call -- wall time and this thread's CPU time (a
gap between them is waiting: the GPU, a socket, a lock, the GIL) -- and writes the sums to
/tmp/mgprof/<pid>.json from a thread, once the process has been idle for 0.5 s (so never inside
a timed call). Calls over 20 ms (first calls,
compiles) are counted apart under "<name>_slow". Covered: the seam's host work in SGLang's
scheduler (LaggedControl), the controller's verify calls, and the verifier worker's serving path
(receive, decode, engine step, graph replay, slot writes, encode).
The functions in TIMELINE also keep each call's (start, end) on CLOCK_MONOTONIC, which every
process on the host shares (the first 20000 calls), under "timeline": benchmarks/verify_timeline.py
lines the three processes' calls up into one verify call's segments.

With MG_PROF=trace the same functions, and SGLang's scheduler loop (receive, next batch, run batch,
process result), are also torch.profiler ranges (record_function), so a trace taken with SGLang's
/start_profile (benchmarks/step_timeline.py) shows them beside both streams' kernels.

With MG_PROF=events, mgprof_events.py instead (a CUDA-event timeline, without the profiler's cost).
"""

import os
import sys

if os.environ.get("MG_PROF") == "events":  # a CUDA-event timeline of the scheduler process instead
    import mgprof_events  # noqa: F401

if os.environ.get("MG_PROF") in ("1", "trace"):
    import json
    import threading
    import time

    # module -> {"Class.method" or "function": short name}
    TARGETS = {
        "mg_server.sglang_ext.lagged": {"LaggedControl.launch": "launch", "LaggedControl._process": "process",
                                         "LaggedControl._settle": "settle",
                                         "LaggedControl.drain": "drain", "_wait": "wait_host", "decide": "decide", "force": "force",
                                         "StepGate.launch": "gate_launch"},
        "mg_server.runtime.controller.server": {"Controller._step": "ctl_step",
                                                "Controller._call_verifier": "ctl_verify_call"},
        "mg_server.runtime.verifier.server": {"VerifierServer._handle_batch": "v_handle_batch",
                                              "VerifierServer._verify": "v_verify", "VerifierServer._send": "v_send"},
        "mg_server.runtime.verifier.engine": {"VerifierEngine.step": "v_engine_step",
                                              "VerifierEngine._check": "v_check",
                                              "VerifierEngine._forward": "v_forward"},
        "mg_server.runtime.verifier.graphs": {"RowGraphs.run": "v_graph_run", "RowGraphs._fill": "v_graph_fill"},
        "mg_server.runtime.shm": {"SlotBuffer.write": "shm_write", "SlotBuffer.read": "shm_read",
                                  "SlotBuffer.write_many": "shm_write_many"},
        "mg_server.runtime.controller.client": {"ControllerClient.report": "client_report"},
        "mg_server.runtime.protocol": {"encode": "encode", "decode": "decode"},
        "sglang.srt.managers.scheduler": {"Scheduler.recv_requests": "s_recv",
                                          "Scheduler.get_next_batch_to_run": "s_next_batch",
                                          "Scheduler.run_batch": "s_run_batch",
                                          "Scheduler.process_batch_result": "s_process_result"},
    }
    TRACE = os.environ["MG_PROF"] == "trace"
    TIMELINE = {"client_step", "process", "settle", "ctl_step", "ctl_verify_call", "v_handle_batch", "v_forward",
                "v_graph_run", "shm_write_many", "v_send"}
    STATS: dict = {}  # name -> [calls, wall seconds, thread CPU seconds]; "timeline": [[name, t0, t1]]
    LOCK = threading.Lock()
    LAST = [0.0, 0, 0]  # last call's end (monotonic), calls recorded, calls at the last dump

    def dumper() -> None:
        """Writes the stats once the process has recorded nothing for 0.5 s (between the timed
        batches, after the run: the server is killed, so no atexit), never inside a timed call."""
        while True:
            time.sleep(0.25)
            with LOCK:
                if LAST[1] == LAST[2] or time.monotonic() - LAST[0] < 0.5:
                    continue
                LAST[2] = LAST[1]
                text = json.dumps({"argv": sys.argv[:3], **STATS})
            os.makedirs("/tmp/mgprof", exist_ok=True)
            with open(f"/tmp/mgprof/{os.getpid()}.json", "w") as f:
                f.write(text)

    def rec(name: str, wall: float, cpu: float, t1: float) -> None:
        with LOCK:
            if not LAST[1]:
                threading.Thread(target=dumper, name="mgprof-dump", daemon=True).start()
            if name != "drain" or wall > 1e-4:  # (the finish watcher drains every 5 ms: not activity)
                LAST[0] = t1
                LAST[1] += 1
            if name in TIMELINE:
                line = STATS.setdefault("timeline", [])
                if len(line) < 20000:
                    line.append([name, t1 - wall, t1])
            s = STATS.setdefault(name + ("_slow" if wall > 0.02 else ""), [0, 0.0, 0.0])
            s[0] += 1
            s[1] += wall
            s[2] += cpu

    def wrap(name: str, fn):
        if TRACE:
            import torch.profiler

            def ranged(*a, **k):
                with torch.profiler.record_function("mg:" + name):
                    return fn(*a, **k)
            inner = ranged
        else:
            inner = fn

        def timed(*a, **k):
            t0, c0 = time.monotonic(), time.thread_time()
            try:
                return inner(*a, **k)
            finally:
                t1 = time.monotonic()
                rec(name, t1 - t0, time.thread_time() - c0, t1)
        return timed

    def patch(mod, table: dict) -> None:
        for path, name in table.items():
            owner, _, attr = path.rpartition(".")
            obj = getattr(mod, owner) if owner else mod
            if hasattr(obj, attr):  # a renamed function is skipped, not fatal
                setattr(obj, attr, wrap(name, getattr(obj, attr)))

    from import_hook import after_import

    after_import({mod: (lambda m, t=table: patch(m, t)) for mod, table in TARGETS.items()})
