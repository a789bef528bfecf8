"""The controller's side of its verifier: start, connect, liveness, stop (a mixin of Controller).

The controller spawns the worker as its child and waits for its hello before it answers anyone,
so a worker that cannot load fails the launcher's start at once. The worker's beat file
(wire.liveness) says whether it still runs.
"""

from __future__ import annotations

import logging
import time

from mg_server.wire.liveness import beat_path, stale_reason

log = logging.getLogger("mg.controller")


class WorkerMixin:
    # set by Controller.__init__: cfg, lifeline, m (metrics), verifier_proc, vclient, vinfo,
    # down_reason, _beat_checked, _verifier_beat

    def start_verifier(self) -> None:
        if self.cfg.verifier is None:
            return
        vcfg = self.cfg.verifier
        self._verifier_beat = beat_path(vcfg.ipc_path)
        from mg_server.verifier.server import start_verifier

        if self.lifeline is not None:
            self.lifeline.status = "verifier starting"
        self.verifier_proc = start_verifier(vcfg)
        self._connect(self.cfg.start_timeout_s)
        self._publish()

    def _connect(self, timeout_s: float) -> None:
        from mg_server.verifier.client import VerifierClient

        vcfg = self.cfg.verifier
        client = VerifierClient(vcfg.ipc_path, timeout_s=self.cfg.verify_timeout_s, client_name="controller",
                                peer_check=self._verifier_gone)
        self.vclient = client  # kept even if the hello fails: close() still sends it Shutdown
        # attach_slots=False: on CUDA attaching would open a CUDA context here for nothing.
        self.vinfo = client.connect(timeout_s=timeout_s, attach_slots=False)
        log.info("verifier ready: model %s, kernels %s", self.vinfo.model_id, self.vinfo.kernel_config_id)

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
            if self.vclient is not None:
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

