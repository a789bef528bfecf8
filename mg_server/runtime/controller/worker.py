"""The controller's side of its verifier: start, connect, liveness, stop (a mixin of Controller).

Two placements (verifier/server.py, "Placement"):
- process (default): the controller spawns the worker as its child and waits for its hello
  before it answers anyone, so a worker that cannot load fails the launcher's start at once.
- scheduler (`ControllerConfig.spawn_verifier` False): SGLang's scheduler process starts the
  worker as a thread, after the controller is up. The controller connects once the worker's
  beat says "serving" (looked at from `verifier_up`, at most 4 times a second); until then the
  verifier reads as down, so a deterministic step fails instead of waiting. The seam starts the
  thread before its own hello, and the controller's answer to that hello connects first, so the
  seam's first step finds the verifier connected.
Either way the worker's beat file (runtime.liveness) says whether it still runs.
"""

from __future__ import annotations

import logging
import time

from mg_server.runtime.liveness import beat_path, read_beat, stale_reason

log = logging.getLogger("mg.controller")

CONNECT_TIMEOUT_S = 2.0  # scheduler placement: one hello to a worker whose beat says it serves
CONNECT_RETRY_S = 1.0  # and the pause after a failed one


class WorkerMixin:
    # set by Controller.__init__: cfg, lifeline, m (metrics), verifier_proc, vclient, vinfo,
    # down_reason, _beat_checked, _verifier_beat, direct_verifier

    def start_verifier(self) -> None:
        if self.cfg.verifier is None:
            return
        vcfg = self.cfg.verifier
        self._verifier_beat = beat_path(vcfg.ipc_path)
        if not self.cfg.spawn_verifier:
            self.down_reason = "the verifier has not started yet (it starts with SGLang's scheduler)"
            self._publish()
            return
        from mg_server.runtime.verifier.server import start_verifier

        if self.lifeline is not None:
            self.lifeline.status = "verifier starting"
        self.verifier_proc = start_verifier(vcfg)
        self._connect(self.cfg.start_timeout_s)
        self._publish()

    def _connect(self, timeout_s: float) -> None:
        from mg_server.runtime.verifier.client import VerifierClient

        vcfg = self.cfg.verifier
        # (the controller hosted by SGLang's scheduler process calls its verifier directly: inproc.py)
        client = self.direct_verifier or VerifierClient(
            vcfg.ipc_path, timeout_s=self.cfg.verify_timeout_s, client_name="controller",
            peer_check=self._verifier_gone, spin_s=self.cfg.ipc_spin_s)
        if self.cfg.spawn_verifier:  # kept even if the hello fails: close() still sends it Shutdown
            self.vclient = client
        try:
            # attach_slots=False: the controller relays (slot, gen) to the hook; on CUDA attaching
            # would open a CUDA context here for nothing.
            self.vinfo = client.connect(timeout_s=timeout_s, attach_slots=False,
                                        expect_kernel_config_id=self.cfg.expect_kernel_config_id)
        except BaseException:
            if not self.cfg.spawn_verifier:
                client.close()
            raise
        self.vclient = client
        log.info("verifier ready: model %s, kernels %s", self.vinfo.model_id, self.vinfo.kernel_config_id)

    def _verifier_gone(self) -> str:
        """Why the verifier cannot answer ("" while it runs and beats)."""
        proc = self.verifier_proc
        if proc is not None and not proc.is_alive():
            return f"the verifier process exited (code {proc.exitcode})"
        return stale_reason(self._verifier_beat) if self._verifier_beat else ""

    def _connect_started(self) -> str:
        """Scheduler placement: connect once the worker serves; why not ("" once connected). A
        failed attempt is retried after CONNECT_RETRY_S, each with a short timeout: the controller
        is single-threaded, so a worker that beats but does not answer must not stall it."""
        beat = read_beat(self._verifier_beat)
        if beat is None or beat.status != "serving" or stale_reason(self._verifier_beat):
            return self.down_reason
        now = time.monotonic()
        if now < getattr(self, "_retry_at", 0.0):
            return self.down_reason
        try:
            self._connect(timeout_s=CONNECT_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - e.g. its load failed: stays down, says why
            self._retry_at = now + CONNECT_RETRY_S
            return f"the verifier did not connect: {getattr(e, 'message', e)}"
        return ""

    def verifier_up(self) -> bool:
        now = time.monotonic()
        proc_dead = self.verifier_proc is not None and not self.verifier_proc.is_alive()
        if self.down_reason or proc_dead or now - self._beat_checked > 0.25:
            self._beat_checked = now  # its beat file is read at most 4 times a second
            if self.vclient is not None:
                reason = self._verifier_gone()
            elif self.cfg.verifier is not None and not self.cfg.spawn_verifier:
                reason = self._connect_started()
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

