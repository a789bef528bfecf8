"""The verifier worker as a thread of SGLang's scheduler process (CUDA): same server, messages,
kernels and bits as the worker process; only where its kernels are launched changes.

Why: two processes' kernels on one GPU take turns (the GPU time-slices between their contexts),
so a window check beside SGLang's forwards adds its whole GPU time to theirs; one process's
streams run their kernels side by side, and SGLang's memory-bound decode leaves room for the
verifier's compute-bound window forward. Measured on an H200 (a CUDA-graph decode of the 8B shape
with a 520-row window call every 12 steps): +26 % per step from a thread against +55 % from a
process (docs/history/window-verification.md, "The verifier in SGLang's process").

Start (controller/worker.py, "handover"): the worker process loads first, so SGLang sizes its K/V
cache around it; the seam's factory then has the controller stop that process and loads the same
worker here, in the scheduler thread, before SGLang serves anything; the worker then serves its
socket from a daemon thread on a CUDA stream of its own.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import replace

import torch

from mg_server.verifier.server import VerifierConfig, VerifierServer
from mg_server.wire.liveness import Lifeline, beat_path

# The host process's GIL switch interval (CPython's default is 5 ms). why: the serving thread wakes
# on a message while SGLang's scheduler thread runs Python; CPython hands a waiting thread the GIL
# only after the holder's switch interval.
SWITCH_INTERVAL_S = 2e-4


class VerifierThread:
    """Load in the caller's thread, then serve from a daemon thread (module doc). A load failure
    is served as the worker process serves it: every message gets the `load_failed` error."""

    def __init__(self, cfg: VerifierConfig):
        self.cfg = replace(cfg, parent_pid=0)  # it lives and dies with its host process
        self.server = VerifierServer(self.cfg)
        # [CUDA stream] its own: SGLang's streams never wait for a verify call, nor its syncs for
        # SGLang's forwards (None on a CPU: tests)
        self.stream = torch.cuda.Stream(torch.device(cfg.device)) if cfg.device.startswith("cuda") else None
        self.lifeline = Lifeline(beat_path(cfg.ipc_path), 0, name="mg-verifier-life")
        self.thread = threading.Thread(target=self._serve, name="mg-verifier", daemon=True)

    def start(self) -> "VerifierThread":
        self.lifeline.status = "loading"
        self.lifeline.start()
        # its warm-up allocates on the stream it serves on
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            self.server.load()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        self.thread.start()
        self.lifeline.set_status("serving")  # the controller connects from here
        return self

    def _serve(self) -> None:
        if self.stream is not None:
            torch.cuda.set_stream(self.stream)
        try:
            self.server.serve_forever()
        finally:
            self.lifeline.stop()
