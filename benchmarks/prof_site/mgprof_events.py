"""Diagnostic for benchmarks only (mg never imports it): a low-cost timeline of SGLang's scheduler
process from CUDA events, loaded by this folder's sitecustomize with MG_PROF=events.

Why not torch's profiler: on the H100 it made SGLang's 1601-kernel decode graph's launch call
take ~2 ms of host time, so the host it measures is not the one that serves.

What it records (each entry: name, "b"/"e", host time, GPU time or None, stream, thread):
- every `CUDAGraph.replay` (SGLang's decode graphs and the verifier's): a CUDA event on the
  current stream before and after the replay. The "b" event completes when the stream reaches
  it, i.e. when the graph can start (its GPU time minus its host time is how long the launch
  waited for earlier work: about 0 means the stream was idle, waiting for this launch); the "e"
  event completes when the graph's work is done.
- host-only intervals of the scheduler loop and mg's calls (`HOST` below).
GPU times are converted to the host clock (time.perf_counter) through one event recorded on an
idle private stream and synchronized, at the first use. Nothing is recorded until the file GO
exists (the caller creates it after its warm-up), and at most MAX entries. A thread resolves
finished events and writes /tmp/mgprof_events/<pid>.json every 2 s; benchmarks/step_timeline.py
--events reads them.
"""

import json
import os
import sys
import threading
import time

from import_hook import after_import

MAX = 60000
GO = "/tmp/mgprof_events_go"  # entries are recorded only once this file exists (after a warm-up)
ON = [False]
LOG: list = []  # [name, phase, host_t, event or gpu_t, stream id, thread id]
LOCK = threading.Lock()
REF: list = []  # [event, host time]
HOST = {  # module -> {"Class.method": name}: host intervals only
    "sglang.srt.managers.scheduler": {"Scheduler.run_batch": "run_batch",
                                      "Scheduler.process_batch_result": "process_result",
                                      "Scheduler.recv_requests": "recv",
                                      "Scheduler.get_next_batch_to_run": "next_batch"},
    "mg_server.sglang_ext.lagged": {"LaggedControl.drain": "drain", "LaggedControl.launch": "mg_launch",
                                     "_wait": "wait_published"},
    "mg_server.runtime.controller.client": {"ControllerClient.report": "step_call"},
    "mg_server.runtime.verifier.graphs": {"RowGraphs.run": "v_run"},
}


def _watch() -> None:
    while not os.path.exists(GO):
        time.sleep(0.2)
    ON[0] = True


def _note(name: str, phase: str, ev=None, stream: int = 0) -> None:
    if not ON[0]:
        return
    with LOCK:
        if len(LOG) < MAX:
            LOG.append([name, phase, time.perf_counter(), ev, stream, threading.get_ident()])


def _gpu_mark(name: str, phase: str) -> None:
    import torch

    if not ON[0] or torch.cuda.is_current_stream_capturing():
        return
    if not REF:
        s = torch.cuda.Stream()
        e = torch.cuda.Event(enable_timing=True)
        e.record(s)
        e.synchronize()
        REF[:] = [e, time.perf_counter()]
        threading.Thread(target=_dumper, name="mgprof-events", daemon=True).start()
    st = torch.cuda.current_stream()
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(st)
    _note(name, phase, ev, st.cuda_stream)


def _dumper() -> None:
    done = 0  # LOG[:done] is resolved (GPU times on the host clock)
    while True:
        time.sleep(2.0)
        ref, h0 = REF
        with LOCK:
            n = len(LOG)
        while done < n:
            ev = LOG[done][3]
            if ev is not None and not isinstance(ev, float):
                if not ev.query():  # (in order: a later event cannot be resolved before it)
                    break
                LOG[done][3] = h0 + ref.elapsed_time(ev) / 1e3
            done += 1
        os.makedirs("/tmp/mgprof_events", exist_ok=True)
        path = f"/tmp/mgprof_events/{os.getpid()}.json"
        with open(path + ".tmp", "w") as f:
            json.dump({"argv": sys.argv[:3], "log": LOG[:done]}, f)
        os.replace(path + ".tmp", path)  # (atomic: the server may be stopped in the middle of a dump)


def _wrap_host(name: str, fn):
    def timed(*a, **k):
        _note(name, "b")
        try:
            return fn(*a, **k)
        finally:
            _note(name, "e")
    return timed


def _patch_graph_replay() -> None:
    import torch.cuda.graphs as g

    replay = g.CUDAGraph.replay

    def marked(self):
        _gpu_mark("graph", "b")
        replay(self)
        _gpu_mark("graph", "e")
    g.CUDAGraph.replay = marked


def _host_patch(table: dict):
    def patch(m) -> None:
        for path_, short in table.items():
            owner, _, attr = path_.rpartition(".")
            obj = getattr(m, owner) if owner else m
            if hasattr(obj, attr):  # a renamed function is skipped, not fatal
                setattr(obj, attr, _wrap_host(short, getattr(obj, attr)))
    return patch


after_import({"torch.cuda.graphs": lambda m: _patch_graph_replay(),
              **{mod: _host_patch(table) for mod, table in HOST.items()}})
threading.Thread(target=_watch, name="mgprof-go", daemon=True).start()
