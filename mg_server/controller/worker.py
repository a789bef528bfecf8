"""The controller's side of its verifier: start, connect, liveness, stop (a mixin of Controller).

The controller spawns the worker as its child and waits for its hello before it answers anyone,
so a worker that cannot load fails the launcher's start at once. The worker's beat file
(wire.liveness) says whether it still runs.

On CUDA the worker then moves into SGLang's scheduler process (`handover`, asked by the seam once
SGLang has sized its memory around the worker process): the process stops, the seam starts the
same worker as a thread there (verifier/thread.py says why), and the controller connects to it
once its beat says "serving" (looked at from `verifier_up`); until then the verifier reads as down.
"""

from __future__ import annotations

import logging
import time

from mg_server.wire.liveness import beat_path, read_beat, stale_reason

log = logging.getLogger("mg.controller")

CONNECT_TIMEOUT_S = 2.0  # a worker thread whose beat says it serves: one hello
CONNECT_RETRY_S = 1.0  # and the pause after a failed one


class WorkerMixin:
    # set by Controller.__init__: cfg, lifeline, m (metrics), verifier_proc, vclient, vinfo,
    # down_reason, _beat_checked, _verifier_beat
    _vipc = ""  # the worker's socket path (the thread's after a handover)
    _moving = False  # handed over: the worker thread has not been connected yet
    _retry_at = 0.0
    _expect = ("", "")  # (model id, kernel config id) the worker thread must report: the process's

    def start_verifier(self) -> None:
        if self.cfg.verifier is None:
            return
        vcfg = self.cfg.verifier
        self._vipc = vcfg.ipc_path
        self._verifier_beat = beat_path(vcfg.ipc_path)
        from mg_server.verifier.server import start_verifier

        if self.lifeline is not None:
            self.lifeline.status = "verifier starting"
        self.verifier_proc = start_verifier(vcfg)
        self._connect(self.cfg.start_timeout_s)
        self._publish()

    def _connect(self, timeout_s: float) -> None:
        from mg_server.verifier.client import VerifierClient

        client = VerifierClient(self._vipc, timeout_s=self.cfg.verify_timeout_s, client_name="controller",
                                peer_check=self._verifier_gone)
        self.vclient = client  # kept even if the hello fails: close() still sends it Shutdown
        # attach_slots=False: on CUDA attaching would open a CUDA context here for nothing.
        self.vinfo = client.connect(timeout_s=timeout_s, attach_slots=False, expect_model_id=self._expect[0],
                                    expect_kernel_config_id=self._expect[1])
        log.info("verifier ready: model %s, kernels %s", self.vinfo.model_id, self.vinfo.kernel_config_id)

    def handover(self, ipc_path: str) -> None:
        """The worker moves into SGLang's scheduler process (module doc): stop the process, whose
        memory the thread takes, and expect the thread at ipc_path."""
        if self.vinfo is not None:  # why: the front reports the process's model and kernel ids (the
            # fingerprint); a thread under SGLang's process-wide torch state must compute the same
            self._expect = (self.vinfo.model_id, self.vinfo.kernel_config_id)
        self.stop_verifier()
        self.verifier_proc = self.vclient = self.vinfo = None  # (its slot buffer is gone with it)
        self._vipc, self._verifier_beat, self._moving = ipc_path, beat_path(ipc_path), True
        self.down_reason = "the verifier is starting in SGLang's scheduler process"
        self._publish()
        log.info("verifier: the worker process stopped; its thread in SGLang's scheduler serves at %s", ipc_path)

    def _connect_moved(self) -> str:
        """After a handover: connect once the thread serves; why not ("" once connected). Each try
        is short and a failed one waits CONNECT_RETRY_S: the controller is single-threaded."""
        beat = read_beat(self._verifier_beat)
        now = time.monotonic()
        if beat is None or beat.status != "serving" or stale_reason(self._verifier_beat) or now < self._retry_at:
            return self.down_reason
        try:
            self._connect(CONNECT_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - e.g. its load failed: stays down, says why
            self._retry_at = now + CONNECT_RETRY_S
            if self.vclient is not None:
                self.vclient.close()
                self.vclient = None
            return f"the verifier did not connect: {getattr(e, 'message', e)}"
        self._moving = False
        return ""

    def _verifier_gone(self) -> str:
        """Why the verifier cannot answer ("" while it runs and beats)."""
        proc = self.verifier_proc
        if proc is not None and not proc.is_alive():
            return f"the verifier process exited (code {proc.exitcode})"
        return stale_reason(self._verifier_beat) if self._verifier_beat else ""

    def verifier_up(self) -> bool:
        now = time.monotonic()
        proc_dead = self.verifier_proc is not None and not self.verifier_proc.is_alive()
        if self.down_reason or proc_dead or now - self._beat_checked > 0.25:
            self._beat_checked = now  # its beat file is read at most 4 times a second
            if self._moving:
                reason = self._connect_moved()
            elif self.vclient is not None:
                reason = self._verifier_gone()
            else:
                reason = "the verifier did not start"
            if reason != self.down_reason:
                if reason:
                    log.error("deterministic verifier is down: %s (deterministic requests fail)", reason)
                else:
                    log.warning("deterministic verifier is up")
                self.down_reason = reason
                self._publish()
        return not self.down_reason

    def _publish(self) -> None:
        """The verifier's state for /health (the beat's status line) and for mg_verifier_up."""
        self.m.verifier_up.set(0 if self.down_reason else 1)
        if self.lifeline is not None:
            self.lifeline.status = f"verifier down: {self.down_reason}" if self.down_reason else "verifier up"

    def stop_verifier(self) -> None:
        if self.vclient is not None:
            try:
                if self.verifier_up():
                    self.vclient.shutdown(timeout_s=5)
            except Exception:  # noqa: BLE001
                pass
            self.vclient.close()
        if self.verifier_proc is not None:
            self.verifier_proc.join(5)
            if self.verifier_proc.is_alive():
                self.verifier_proc.kill()
                self.verifier_proc.join(5)  # (a handover's thread loads into the memory it frees)

