"""mg's runtime as the main process sees it: the controller's start, its supervision, its stop.

The controller (which starts the verifier) starts before SGLang; a first start that fails ends
the server's start with the child's own error. Afterwards `Runtime.watch` (a thread) supervises
it: a controller that exits, or whose beat is older than liveness.WEDGED_AFTER_S (it is killed),
is started again after liveness.Restarts' backoff. Until the new one beats, this process writes
the controller's beat itself: a placeholder (pid NO_PROCESS) whose status says why, so /health is
a 503 with the reason and every client's waiting call gives up at once (liveness.PeerWatch);
mg_verifier_up is 0 and mg_controller_restarts_total counts each start. The new controller binds
the same socket and beat file, so the seam's and the front's clients reach it by themselves. It
knows none of its predecessor's requests: their later steps and ends fail there, and a verdict it
never heard of is `unknown` (never `verified`). It must report the same verifier as the first
(the front and the seam keep the first one's kernels, weights and K/V pool), else the start
counts as failed. A controller that gave up on its verifier (GAVE_UP_EXIT), or Restarts.limit
failures in a row, stop the server: its drain, then exit code 1 with the reason (launch.shutdown).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import replace

from mg_server import metrics
from mg_server.controller.client import ControllerClient
from mg_server.controller.server import start_controller
from mg_server.launch import shutdown
from mg_server.wire import protocol as P
from mg_server.wire.channel import RpcError
from mg_server.wire.liveness import (BEAT_PERIOD_S, GAVE_UP_EXIT, NO_PROCESS, WEDGED_AFTER_S, Restarts, beat_path,
                                     read_beat, stale_reason, write_beat)

log = logging.getLogger(__name__)

FIRST_BEAT_WAIT_S = 60.0  # a new controller's first beat (its imports, on a busy host); else its start failed


class Runtime:
    """The controller of one server: `start` (the first), `watch` (a thread), `stop` (at exit)."""

    def __init__(self, cfg):
        self.cfg = cfg  # config.ControllerConfig
        self.beat = beat_path(cfg.ipc_path)
        self.proc = None  # the controller process now (a restart's from its spawn on: `stop` sees it)
        self.info: P.ControllerInfo | None = None  # the first controller's
        self.restarts = Restarts()
        self.stopped = threading.Event()  # `stop` ran (at exit): a controller that exits now is no loss

    def start(self) -> P.ControllerInfo:
        """The first start: its ControllerInfo, or RuntimeError with the child's error."""
        metrics.controller_restarts()  # (0 until a restart: /metrics shows it from the start)
        self.info = self._start_one(None)
        if self.cfg.verifier is not None:  # a restarted controller's verifier gets this one's pool
            pool = self.info.verifier_pool_tokens
            self.cfg = replace(self.cfg, verifier=replace(self.cfg.verifier, pool_tokens=pool))
        self.restarts.up(time.monotonic())
        return self.info

    def _start_one(self, status: str | None) -> P.ControllerInfo:
        """Spawn a controller and wait for its hello (its verifier is up by then). `status`: a
        restart's placeholder status, kept in the beat file until the new one beats."""

        proc = self.proc = start_controller(self.cfg if status is None else replace(self.cfg, start_status=status))

        def controller_gone() -> str:  # a dead or stopped controller fails the start now, not after start_timeout_s
            if not proc.is_alive():
                return f"the mg controller exited during start-up (code {proc.exitcode})"
            return stale_reason(self.beat, pid=proc.pid)

        try:
            if status is not None:
                self._hold_beat(proc, status)
            with ControllerClient(self.cfg.ipc_path, timeout_s=self.cfg.start_timeout_s, client_name="launcher",
                                  peer_check=controller_gone) as client:
                info = client.hello()
            if not info.kernel_config_id:  # (up, or on CUDA its pool allocated: SGLang may start)
                raise RuntimeError("the deterministic verifier did not start")
        except BaseException as e:
            # a controller that answered (its verifier failed) exits by itself, stopping the verifier
            proc.join(10 if isinstance(e, RpcError) else 0)
            if proc.is_alive():
                proc.kill()  # a live non-daemon child would keep this process from exiting
                proc.join(5)
            if isinstance(e, RpcError):
                raise RuntimeError(e.message) from None
            raise
        return info

    def _hold_beat(self, proc, status: str) -> None:
        """Write the placeholder beat until `proc` beats itself (module doc)."""
        deadline = time.monotonic() + FIRST_BEAT_WAIT_S
        while proc.is_alive():
            beat = read_beat(self.beat)
            if beat is not None and beat.pid == proc.pid:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the new controller did not beat within {FIRST_BEAT_WAIT_S:.0f}s")
            write_beat(self.beat, status, pid=NO_PROCESS)
            time.sleep(BEAT_PERIOD_S / 2)

    def _ending(self) -> bool:
        """A stop began (the server's, or this runtime's at exit): a controller that exits is no loss."""
        return shutdown.STOPPING.is_set() or self.stopped.is_set()

    def watch(self) -> None:
        """Supervise the controller until the server stops (module doc)."""
        while not self._ending():
            reason = self._wait_lost()
            if not reason or not self._recover(reason):
                return

    def _wait_lost(self) -> str:
        """Why the controller is lost, once it is ("" once a stop began, or it gave up)."""
        proc = self.proc
        while True:
            proc.join(BEAT_PERIOD_S)
            if self._ending():  # a stop in progress ends it: not news
                return ""
            if not proc.is_alive():
                if proc.exitcode != GAVE_UP_EXIT:
                    return f"the controller exited (code {proc.exitcode})"
                beat = read_beat(self.beat)
                status = beat.status.removeprefix("verifier down: ") if beat else "gave up"
                self._stop_server(f"the deterministic verifier {status}")
                return ""
            beat = read_beat(self.beat)
            if beat is not None and beat.pid == proc.pid and beat.age_s > WEDGED_AFTER_S:
                proc.kill()
                proc.join(5)
                return f"the controller did not beat for {beat.age_s:.0f}s (killed)"

    def _recover(self, reason: str) -> bool:
        """Start controllers until one serves (True), or the server stops (False)."""
        lost_at = time.monotonic()
        log.error("mg controller lost: %s; deterministic requests fail until it is back", reason)
        metrics.verifier_up().set(0)
        while not self._ending():
            delay = self.restarts.failed(time.monotonic())
            if delay is None:
                self._stop_server(f"the mg controller failed {self.restarts.in_a_row} times in a row; the last: "
                                  f"{reason}")
                return False
            status = f"verifier down: controller restarting after: {reason}"
            due = time.monotonic() + delay
            while not self._ending():
                write_beat(self.beat, status, pid=NO_PROCESS)
                if time.monotonic() >= due:
                    break
                time.sleep(BEAT_PERIOD_S)
            if self._ending():
                break
            metrics.controller_restarts().inc()
            log.warning("mg: starting the controller again (attempt %d)", self.restarts.in_a_row)
            try:
                info = self._start_one(status)
                why = differs(self.info, info)
            except Exception as e:  # noqa: BLE001 - a failed start counts, and backs off
                why = f"the new controller did not start: {e}"
            if why:
                log.error("mg: %s", why)
                self._end(self.proc)
                reason = why
                continue
            self.restarts.up(time.monotonic())
            log.warning("mg controller restarted: serving %.1fs after it was lost", time.monotonic() - lost_at)
            return True
        return False

    @staticmethod
    def _end(proc) -> None:
        if proc is not None and proc.is_alive():
            proc.kill()
            proc.join(5)

    @staticmethod
    def _stop_server(reason: str) -> None:
        """Stop the server on a failure: the drain, then exit code 1 with `reason`."""
        log.error("mg: %s; stopping the server", reason)
        shutdown.fail(reason)
        os.kill(os.getpid(), signal.SIGTERM)

    def stop(self) -> None:
        """At exit: the controller stops (its verifier with it)."""
        self.stopped.set()
        proc = self.proc
        if proc is None:
            return
        if proc.is_alive():
            try:
                with ControllerClient(self.cfg.ipc_path, timeout_s=5, client_name="launcher") as client:
                    client.shutdown()
            except Exception:  # noqa: BLE001 - it is killed below
                pass
            proc.join(10)
        self._end(proc)


def differs(first: P.ControllerInfo, new: P.ControllerInfo) -> str:
    """Why a restarted controller's verifier is not the one the front and the seam hold ("" if it is)."""
    for what, a, b in (("kernel configuration", first.kernel_config_id, new.kernel_config_id),
                       ("model", first.model_id, new.model_id),
                       ("K/V pool", first.verifier_pool_tokens, new.verifier_pool_tokens),
                       ("capacity", first.verifier_max_requests, new.verifier_max_requests)):
        if a != b:
            return f"the restarted controller's verifier has another {what} ({b} != {a})"
    return ""
