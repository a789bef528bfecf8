"""The controller's side of its verifier: start, liveness, restarts, stop (a mixin of Controller).

The worker is the controller's child. Each start runs in a thread of its own (`VerifierStart`:
spawn, then wait for the worker's hello) while the controller serves: Steps of requests fail
while no verifier is up, and the launcher's ControllerHello is answered once the first start has
succeeded or failed (server.serve_forever). A first start that fails ends the controller with the
worker's own error (the launcher exits with it).

After that the worker is supervised. One whose beat is stale is down (its calls fail, new steps
fail) and up again if it beats again; one that exited, or has not beaten for
liveness.WEDGED_AFTER_S, is lost: killed, and every request whose state it held fails (its shadow
K/V is gone: live requests and finished ones still waiting for their tail audit; finished ones
with a verdict keep it, their tokens were all checked). A new worker starts after
liveness.Restarts' backoff; it must be the same verifier (model, kernels, weights, K/V pool: the
front and the seam keep the first one's), else the start counts as failed.
On CUDA a start has two stages (verifier.server): the worker's first hello comes once its K/V
pool is allocated (`reserved`: the facts the launcher needs to start SGLang, whose weights the
worker then waits for), its second once it computes on them (`info`).
Restarts.limit failures in a row stop the controller with GAVE_UP_EXIT, its beat saying why: the
launcher then stops the server. The beat's status line says all of this to /health.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace

from mg_server.wire import protocol as P
from mg_server.wire.liveness import (GAVE_UP_EXIT, WEDGED_AFTER_S, beat_path, exit_reason, read_beat, stale_reason,
                                     wait_gone)

log = logging.getLogger("mg.controller")

# A restarted controller's first start waits this long for its predecessor's verifier (an orphan
# that exits within a beat period) before it spawns its own: two would hold the GPU's memory.
PREDECESSOR_WAIT_S = 5.0


class VerifierStart:
    """One start of the worker, in a thread of its own (module doc). `proc`, `client`, `info` or
    `error` once `done()`."""

    def __init__(self, cfg, expect: P.HelloReply | None, predecessor: int = 0):
        self.cfg, self.expect = cfg, expect  # the ControllerConfig; the first worker's hello (None: this is it)
        self.proc = self.client = self.info = None
        self.reserved: P.HelloReply | None = None  # the first hello's facts (stage 1)
        self.error: P.ErrorReply | None = None
        self.began = time.monotonic()
        self._thread = threading.Thread(target=self._run, args=(predecessor,), name="mg-verifier-start", daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def _run(self, predecessor: int) -> None:
        from mg_server.verifier.client import VerifierClient
        from mg_server.verifier.server import start_verifier
        from mg_server.wire.channel import RpcError

        vcfg, e0 = self.cfg.verifier, self.expect
        try:
            if predecessor and not wait_gone(predecessor, PREDECESSOR_WAIT_S):
                log.warning("the previous verifier (pid %d) still runs; starting a new one beside it", predecessor)
            self.proc = start_verifier(vcfg)
            self.client = VerifierClient(vcfg.ipc_path, timeout_s=self.cfg.verify_timeout_s, client_name="controller",
                                         peer_check=self._gone)
            expect = dict(expect_model_id=e0.model_id if e0 else "",
                          expect_kernel_config_id=e0.kernel_config_id if e0 else "")
            info = self.client.connect(timeout_s=self.cfg.start_timeout_s, **expect)
            if not info.ready:  # stage 1 done: SGLang may start; the next hello waits for stage 2
                self.reserved = info
                info = self.client.connect(timeout_s=self.cfg.verifier.weights_timeout_s + self.cfg.start_timeout_s,
                                           **expect)
            self.info = info
            if e0 is not None and (why := differs(e0, self.info)):
                self.error = P.ErrorReply(code=P.ErrorCode.MODEL_MISMATCH, message=why)
        except Exception as e:  # noqa: BLE001 - the controller decides (module doc)
            code, message = (e.code, e.message) if isinstance(e, RpcError) else (P.ErrorCode.INTERNAL, f"{e!r}")
            self.error = P.ErrorReply(code=code, message=message)

    def _gone(self) -> str:
        proc = self.proc
        return exit_reason(proc, "verifier") or stale_reason(beat_path(self.cfg.verifier.ipc_path), pid=proc.pid)

    def abandon(self) -> None:
        """The start failed, or the controller stops: the worker is killed, the client closed."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        self._thread.join(2)
        if self.proc is not None:
            self.proc.join(5)
        if self.client is not None and self.done():
            self.client.close()


def differs(first: P.HelloReply, new: P.HelloReply) -> str:
    """Why a restarted worker is not the verifier the front and the seam hold ("" if it is)."""
    for what, a, b in (("model", first.model_id, new.model_id),
                       ("K/V pool", (first.pool_tokens, first.max_requests, first.max_seq_len),
                        (new.pool_tokens, new.max_requests, new.max_seq_len))):
        if a != b:
            return f"the restarted verifier's {what} differs from the first one's ({b} != {a})"
    return ""


class WorkerMixin:
    # set by Controller.__init__: cfg, lifeline, m (metrics), verifier_proc, vclient, vinfo, start_error,
    # down_reason, restarts, exit_code, running, completing, reqs, _start, _restart_at, _lost_at,
    # _beat_checked, _verifier_beat

    def start_verifier(self) -> None:
        """The first start, in the background (`_tend` ends it)."""
        if self.cfg.verifier is None:
            return
        self._verifier_beat = beat_path(self.cfg.verifier.ipc_path)
        old = read_beat(self._verifier_beat)  # a restarted controller's predecessor's verifier
        self._start = self._begin_start(old.pid if old is not None and old.pid else 0)

    def _begin_start(self, predecessor: int = 0) -> VerifierStart:
        return VerifierStart(self.cfg, self.vinfo, predecessor)

    def verifier_starting(self) -> bool:
        """The first start runs and has no facts yet (the launcher's hello waits for them)."""
        return self.cfg.verifier is not None and self.verifier_facts() is None and self.start_error is None

    def verifier_facts(self) -> P.HelloReply | None:
        """The verifier's hello: the worker's, or a first start's stage 1 (its pool, its kernels)."""
        return self.vinfo or (self._start.reserved if self._start is not None else None)

    def _verifier_gone(self) -> str:
        """Why the verifier cannot answer ("" while it runs and beats)."""
        proc = self.verifier_proc
        why = exit_reason(proc, "verifier")
        return why or (stale_reason(self._verifier_beat, pid=proc.pid if proc else None) if self._verifier_beat else "")

    def _wedged(self) -> bool:
        beat = read_beat(self._verifier_beat) if self._verifier_beat else None
        return beat is not None and beat.age_s > WEDGED_AFTER_S and beat.pid == getattr(self.verifier_proc, "pid", None)

    def verifier_up(self) -> bool:
        if self._start is not None or self._restart_at is not None:
            self._tend()
        if self.vclient is None:  # starting, restarting, did not start or gave up
            if not self.down_reason and not self.verifier_starting():
                self.down_reason = "the verifier did not start"
                self._publish()
            return False
        now = time.monotonic()
        proc_dead = self.verifier_proc is not None and not self.verifier_proc.is_alive()
        if self.down_reason or proc_dead or now - self._beat_checked > 0.25:
            self._beat_checked = now  # its beat file is read at most 4 times a second
            reason = self._verifier_gone()
            if reason and (proc_dead or self._wedged()):
                self._lose(reason if proc_dead else f"{reason}; killed after {WEDGED_AFTER_S:.0f}s without a beat")
                self._tend()  # (a first restart is due at once)
                return False
            if reason != self.down_reason:
                if reason:
                    log.error("deterministic verifier is down: %s (deterministic requests fail)", reason)
                else:
                    log.warning("deterministic verifier is up")
                self.down_reason = reason
                self._publish()
        return not self.down_reason

    def _lose(self, reason: str) -> None:
        """The worker is gone for good (module doc): its requests fail, a new one is due."""
        failed = 0
        for st in self.reqs.values():
            if not st.error and (not st.finished_at or st.audit_pending):
                st.error = f"deterministic verifier is not running: it was lost ({reason})"
                failed += 1
        self.completing.clear()  # (their shadow caches went with it)
        log.error("deterministic verifier lost: %s; %d request(s) it held fail", reason, failed)
        client, proc = self.vclient, self.verifier_proc
        self.vclient = self.verifier_proc = None
        client.close()
        if proc is not None:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        self._lost_at = time.monotonic()
        self._failed(reason)

    def _failed(self, reason: str) -> None:
        """A loss, or a new worker that did not start: the next start after the backoff, or give up."""
        delay = self.restarts.failed(time.monotonic())
        if delay is None:
            self.down_reason = f"gave up after {self.restarts.in_a_row} failures in a row; the last: {reason}"
            log.error("deterministic verifier: %s; the controller stops", self.down_reason)
            self.running, self.exit_code = False, GAVE_UP_EXIT
        else:
            self._restart_at = time.monotonic() + delay
            self.down_reason = f"restarting after: {reason}"
        self._publish()

    def _tend(self) -> None:
        """Start a worker that is due, take one whose start is done."""
        if self._restart_at is not None and time.monotonic() >= self._restart_at:
            self._restart_at = None
            self.m.verifier_restarts.inc()
            log.warning("starting the deterministic verifier again (attempt %d)", self.restarts.in_a_row)
            self._start = self._begin_start()
        job = self._start
        if job is None or not job.done():
            return
        self._start = None
        if job.error is not None:
            job.abandon()
            if self.vinfo is None:  # the first start: told to the launcher, which exits with it
                why = f"the deterministic verifier did not start: {job.error.message}"
                log.error("%s", why)
                self.start_error = P.ErrorReply(code=job.error.code, message=why)
                self.down_reason = "the verifier did not start"
                self._publish()
            else:
                self._failed(f"the new verifier did not start: {job.error.message}")
            return
        job.client.peer_check = self._verifier_gone
        first = self.vinfo is None
        if first:  # a restarted worker gets this one's pool (verifier.server: VerifierConfig.pool_tokens)
            self.cfg = replace(self.cfg, verifier=replace(self.cfg.verifier, pool_tokens=job.info.pool_tokens))
        self.verifier_proc, self.vclient, self.vinfo = job.proc, job.client, job.info
        now = time.monotonic()
        self.restarts.up(now)
        self.down_reason, self._beat_checked = "", now
        if first:
            log.info("verifier ready: model %s, kernels %s", job.info.model_id, job.info.kernel_config_id)
        else:
            log.warning("deterministic verifier restarted: up %.1fs after it was lost", now - self._lost_at)
        self._publish()

    def _publish(self) -> None:
        """The verifier's state for /health (the beat's status line) and for mg_verifier_up."""
        up = self.vclient is not None and not self.down_reason
        self.m.verifier_up.set(1 if up else 0)
        if self.lifeline is not None:
            self.lifeline.set_status("verifier up" if up else f"verifier down: {self.down_reason}" if self.down_reason
                                     else self.cfg.start_status)

    def stop_verifier(self) -> None:
        if self._start is not None:
            self._start.abandon()
            self._start = None
        if self.vclient is not None:
            try:
                if self.verifier_proc is None or self.verifier_proc.is_alive():
                    self.vclient.shutdown(timeout_s=5)
            except Exception:  # noqa: BLE001
                pass
            self.vclient.close()
        if self.verifier_proc is not None:
            self.verifier_proc.join(5)
            if self.verifier_proc.is_alive():
                self.verifier_proc.kill()
