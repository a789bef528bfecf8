"""The verifier worker as a thread of the calling process (`serve --mg-verifier-in scheduler`,
experimental; server.py's module doc, "Placement", says why). Same server object, messages,
kernels and bits as the process placement; only where its kernels are launched changes.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import replace

import torch

from mg_server.runtime.verifier.server import VerifierConfig, VerifierServer


class VerifierThread:
    """The worker as a thread of the calling process (module doc, "Placement"). `start` loads
    the model in the caller's thread (SGLang's scheduler thread, from mg's hook, which SGLang
    attaches after capturing its own graphs: nothing else runs on the GPU then), then serves
    from a daemon thread on a CUDA stream of its own. Its beat
    file's status says "serving" once the controller may connect; a load failure is served as
    the same `load_failed` error the process placement answers with."""

    def __init__(self, cfg: VerifierConfig):
        from mg_server.runtime.liveness import Lifeline, beat_path

        self.cfg = replace(cfg, parent_pid=0)  # it lives and dies with its host process
        self.server = VerifierServer(self.cfg)
        # its CUDA stream (None on CPU): made here so that the warm-up allocates on it (see _warm_up)
        self.stream = torch.cuda.Stream(cfg.device) if cfg.device.startswith("cuda") else None
        self.lifeline = Lifeline(beat_path(cfg.ipc_path), 0, name="mg-verifier-life")
        self.thread = threading.Thread(target=self._serve, name="mg-verifier", daemon=True)

    def start(self) -> "VerifierThread":
        self.lifeline.status = "loading"
        self.lifeline.start()
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            self.server.load()
        # why: the serving thread wakes on a message while the host's threads run Python; CPython
        # hands it the GIL only after the holder's switch interval (5 ms by default).
        sys.setswitchinterval(min(sys.getswitchinterval(), self.cfg.switch_interval_s))
        self.thread.start()
        self.lifeline.set_status("serving")  # now: the seam's hello comes next
        return self

    def _serve(self) -> None:
        if self.stream is not None:
            # why: a stream of its own, so the host's streams never wait for a verify call (and
            # stream syncs here never wait for the host's forwards, a held one included)
            torch.cuda.set_stream(self.stream)
        try:
            self.server.serve_forever()
        finally:
            self.lifeline.stop()

    def stop(self, timeout_s: float = 5.0) -> None:
        self.server.running = False
        self.thread.join(timeout_s)


def start_verifier_thread(cfg: VerifierConfig) -> VerifierThread:
    return VerifierThread(cfg).start()
