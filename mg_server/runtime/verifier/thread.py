"""The verifier worker as a thread of the calling process (`serve --mg-verifier-in scheduler`,
experimental; server.py's module doc, "Placement", says why). Same server object, messages,
kernels and bits as the process placement; only where its kernels are launched changes.

With the controller in the same process (`--mg-controller-in scheduler`), no thread serves the
socket: the controller calls the server in its own thread through `DirectVerifierClient`.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path

import torch

from mg_server.runtime import protocol as P
from mg_server.runtime.verifier.client import VerifierError, newest_gen
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
        self.stopped = threading.Event()
        self.gil_watch: threading.Thread | None = None  # cfg.trace_calls: watch_gil

    def start(self, serve_socket: bool = True) -> "VerifierThread":
        """Load, then serve the socket from a thread (serve_socket=False: the caller serves it
        directly, through DirectVerifierClient; the beat still says "serving")."""
        self.lifeline.status = "loading"
        self.lifeline.start()
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            self.server.load()
        # why: the serving thread wakes on a message while the host's threads run Python; CPython
        # hands it the GIL only after the holder's switch interval (5 ms by default).
        # (the config's value as it is: 5 ms with --mg-verify-ahead, or MG_GIL_SWITCH_US's)
        sys.setswitchinterval(self.cfg.switch_interval_s)
        if serve_socket:
            self.thread.start()
        if self.cfg.trace_calls:
            self.gil_watch = threading.Thread(target=watch_gil, args=(self.stopped,), name="mg-gil-watch", daemon=True)
            self.gil_watch.start()
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
        self.stopped.set()
        self.server.running = False
        if self.thread.ident is not None:  # its serving thread closes the server on its way out
            self.thread.join(timeout_s)
        else:  # served directly (start(serve_socket=False))
            self.server.close()
            self.lifeline.stop()


def start_verifier_thread(cfg: VerifierConfig, serve_socket: bool = True) -> VerifierThread:
    return VerifierThread(cfg).start(serve_socket)


class DirectVerifierClient:
    """The controller's verifier client when both live in SGLang's scheduler process
    (`--mg-controller-in scheduler`): each call runs the server's handler in the caller's thread,
    on the verifier's CUDA stream, and returns what the socket would have carried. No socket, no
    thread hand-over: a verify call costs the verifier's forward and its Python. The caller (the
    controller, under its lock) serialises the calls. The part of VerifierClient's interface the
    controller uses."""

    def __init__(self, worker: VerifierThread):
        self.worker = worker
        self.last_gen = 0  # the newest slot generation in a reply (as VerifierClient.last_gen)

    def _call(self, m: P.Message) -> P.Message:
        s = self.worker.stream
        with torch.cuda.stream(s) if s is not None else contextlib.nullcontext():
            reply = self.worker.server.call(m)
        if isinstance(reply, P.Error):
            raise VerifierError.of(reply.error)
        return reply

    def connect(self, timeout_s: float | None = None, expect_model_id: str = "", expect_kernel_config_id: str = "",
                attach_slots: bool = False) -> P.HelloReply:
        return self._call(P.Hello(protocol_version=P.PROTOCOL_VERSION, client="controller",
                                  expect_model_id=expect_model_id, expect_kernel_config_id=expect_kernel_config_id))

    def verify_many(self, items: list[P.VerifyItem], timeout_s: float | None = None
                    ) -> list[P.VerifyResult | P.ErrorReply]:
        reply = self._call(P.Verify(items=list(items)))
        self.last_gen = newest_gen(reply.results, self.last_gen)
        return reply.results

    def release(self, rids: list[str], timeout_s: float | None = None) -> int:
        return self._call(P.Release(rids=list(rids))).n

    def shutdown(self, timeout_s: float | None = None) -> None:
        self._call(P.Shutdown())

    def close(self) -> None:
        pass


def watch_gil(stop: threading.Event, period_s: float = 2e-3, late_s: float = 0.05) -> None:
    """cfg.trace_calls, thread placement: sleep `period_s` in a loop; a wake-up later than `late_s`
    means this thread could not get the GIL (or the process did not run) that long, and where the
    host's other threads stand right then shows which call held it (it just returned)."""
    me = threading.get_ident()
    names = {}
    while not stop.is_set():
        t0 = time.perf_counter()
        time.sleep(period_s)
        late = time.perf_counter() - t0 - period_s
        if late > late_s:
            names.update((t.ident, t.name) for t in threading.enumerate())
            where = []
            for ident, frame in sys._current_frames().items():
                if ident != me:
                    stack = traceback.extract_stack(frame)[-3:]
                    where.append(f"{names.get(ident, ident)}: " + " < ".join(
                        f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack)))
            print(f"[mg-verifier] {time.time():.3f} the GIL watch woke {1e3 * late:.0f} ms late; threads now at: "
                  + " | ".join(where), flush=True)
