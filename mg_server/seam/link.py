"""The step seam's link to mg's controller, in SGLang's scheduler process (hook.py's StepSeam
owns one): one socket for one-way step reports and finishes; the finish watcher thread, which
reports every finished deterministic request the scheduler thread did not (an answer that ends
with its every token checked and reported is reported at once: `report_end`), draining the
lagged path's forwards first; and the news watcher, which hands the controller's rollbacks and
checked lengths to the tracked requests. Also each tracked request's state (`Tracked`) and how SGLang
ends a request (`end_rules`, sent with its Finish)."""

from __future__ import annotations

import logging
from contextlib import contextmanager
import threading
import time
from dataclasses import dataclass

from mg_server import env, metrics
from mg_server.config import HookConfig
from mg_server.seam import rollback
from mg_server.wire import protocol as P
from mg_server.wire.liveness import BEAT_PERIOD_S, seam_beat_path, write_beat

log = logging.getLogger(__name__)


def end_rules(req) -> dict:
    """How SGLang ends `req` (Req.check_finished): max_new_tokens, then its stop token ids unless
    ignore_eos; stop strings, regexes and grammars are text rules mg does not model."""
    sp = req.sampling_params
    stop: set[int] = set()
    if not sp.ignore_eos:
        stop |= set(sp.stop_token_ids or ()) | set(req.eos_token_ids or ())
        tok = getattr(req, "tokenizer", None)
        if tok is not None:
            stop |= {tok.eos_token_id} if tok.eos_token_id is not None else set()
            stop |= set(getattr(tok, "additional_stop_token_ids", None) or ())
    text_rules = bool(sp.stop_strs) or bool(getattr(sp, "stop_regex_strs", None)) or req.grammar is not None
    return {"max_new": int(sp.max_new_tokens or 0), "stop_ids": sorted(stop), "correctable": not text_rules}


@dataclass
class StepDecision:
    """The seam's decision for one step row (the seam decides, the controller checks behind)."""

    rid: str
    token: int = -1  # the token t_{pos+1} to emit (the fast one, or the verifier's at a rollback)
    verified: bool = False  # the verifier computed this step (a rollback's token)
    error: str = ""  # non-empty: the step could not be served deterministically (fail it)


@dataclass
class Tracked:
    req: object  # SGLang's Req (identity: a reused rid is another request)
    tokens: list[int]  # t_0 .. t_{n-1}: the prompt, then every token mg decided
    failed: bool = False  # aborted by mg: later forwards (the abort lands a step later) are ignored
    hold: object = None  # its rollback.Hold (verified length, finish barrier)
    epoch: int = 0  # rollbacks applied (StepRow.epoch)
    ended: bool = False  # its Finish was sent from the scheduler thread (report_end); later rows are not steps
    rollback: object = None  # a protocol.Rollback to apply at its next forward


def _untrack(tracked: dict, rid: str) -> None:
    """Forget a request (the caller holds its link's lock); its output hold stays with the Req."""
    t = tracked.pop(rid)
    if getattr(t, "hold", None) is not None:
        rollback.untrack(t.req)


class ControllerLink:
    """The seam's connection to the controller, plus the finish watcher thread.

    One socket for one-way step reports, finish barrier checks and finishes, used under
    `rpc_lock`: zmq keeps one socket's messages in order, so a Finish never overtakes the report
    of the request's last steps (two sockets would be read in either order).
    """

    # the lagged control path's drain(wait) (lagged.py): a Finish follows the reports of every
    # forward launched before it (the overlap scheduler's look-ahead forward included)
    before_finish = None
    published_tracked = -1  # the last len(tracked) set on mg_tracked_requests (set when it changes)

    def __init__(self, config: HookConfig):
        from mg_server.controller.client import ControllerClient
        from mg_server.policy import Policy

        self.config = config
        if env.stacks_on_usr1():
            import faulthandler
            import signal

            faulthandler.register(signal.SIGUSR1, all_threads=True)
        self.client = ControllerClient(config.controller_ipc, timeout_s=config.step_timeout_s, client_name="hook")
        self.info = self.client.hello()
        self.policy = Policy(self.info.mode, self.info.tau)  # the controller's own policy (pure)
        self.tracked: dict[str, Tracked] = {}  # instance key -> state, until its Finish is sent
        self.lock = threading.Lock()  # guards `tracked`
        self.rpc_lock = threading.Lock()  # guards `client`
        self.beat_path, self._last_beat, self.watch_error = seam_beat_path(config.controller_ipc), 0.0, ""
        threading.Thread(target=self._watch_finished, name="mg-finish-watch", daemon=True).start()
        threading.Thread(target=self._watch_news, name="mg-news-watch", daemon=True).start()

    def _watch_news(self) -> None:
        """Ask the controller for its news of the tracked requests (`WindowNews`): rollbacks to
        apply, checked lengths the output hold may release.

        Own client and thread: the controller answers after a check in progress (milliseconds),
        and neither the scheduler thread nor the finish watcher should wait for that."""
        from mg_server.controller.client import ControllerClient

        client, failing = None, False
        while True:
            time.sleep(0.005)  # (each ask takes the GIL from the scheduler thread for a moment)
            with self.lock:
                if not any(getattr(t, "hold", None) is not None and not t.failed for t in self.tracked.values()):
                    continue
            try:
                client = client or ControllerClient(self.config.controller_ipc, timeout_s=self.config.step_timeout_s,
                                                    client_name="hook-news")
                reply, failing = client.news(), False
            except Exception as e:  # noqa: BLE001 - the hold then releases nothing; verdicts stay honest
                if not failing:
                    log.warning("mg: asking the controller for its news failed: %s", e)
                client, failing = None, True
                time.sleep(0.1)
                continue
            if reply.rollbacks or reply.verified:
                self.window_news(reply.rollbacks, reply.verified)

    def window_news(self, rollbacks: list[P.Rollback], verified: dict[str, list[int]]) -> None:
        """The controller's news: rollbacks to apply at their requests' next forward, and how much
        of each request is checked (what the output hold may release; only for the seam's epoch)."""
        with self.lock:
            for rb in rollbacks:
                t = self.tracked.get(rb.rid)
                if t is not None and t.hold is not None and rb.epoch > t.epoch and not t.hold.moot(rb.index):
                    t.rollback = rb
            for rid, (epoch, n) in verified.items():
                t = self.tracked.get(rid)
                if t is not None and t.hold is not None and epoch == t.epoch and t.rollback is None:
                    t.hold.verified = max(t.hold.verified, n)

    def _watch_finished(self) -> None:
        """A request's last token is never the input of a forward; report the ends the scheduler
        thread did not (aborts, ends of requests mg lost track of) from here.

        The thread must outlive any error (without it every deterministic response would wait
        for a Finish that never comes): each round is guarded, and the thread beats a file that
        the front's /health reads (a stale beat or an error status makes /health a 503)."""
        while True:
            time.sleep(0.005)
            try:
                if self.before_finish is not None:
                    self.before_finish(False)  # forwards whose values are ready (a gate may be holding)
                self._report_finished()
                self.watch_error = ""
            except Exception as e:  # noqa: BLE001 - survive, say so in the beat, try again
                if not self.watch_error:
                    log.exception("mg: the finish watcher failed (retrying)")
                self.watch_error = f"{type(e).__name__}: {e}"[:200]
            self._beat()

    def _beat(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or self.watch_error or now - self._last_beat >= BEAT_PERIOD_S:
            self._last_beat = now
            try:
                write_beat(self.beat_path, f"error {self.watch_error}" if self.watch_error else "ok")
            except OSError:  # run folder removed at shutdown
                pass

    @staticmethod
    def finish_of(rid: str, req, epoch: int) -> P.Finish:
        """The Finish of a finished `req`: an answer through its stop (a held end's surplus is not
        part of it, rollback.py); an aborted one whole (its finished_len may be what the output
        hold showed)."""
        aborted = type(req.finished_reason).__name__ == "FINISH_ABORT"
        reason = str(getattr(req.finished_reason, "message", "")) if aborted else ""
        flen = None if aborted else getattr(req, "finished_len", None)
        output = list(req.output_ids if flen is None else req.output_ids[:flen])
        return P.Finish(rid=rid, output=output, aborted=aborted, reason=reason, epoch=epoch, **end_rules(req))

    def report_end(self, rid: str, req, epoch: int) -> None:
        """A request's Finish from the scheduler thread (seam/news.py's `ended`), in order behind
        the steps this thread reported on the same socket."""
        msg = self.finish_of(rid, req, epoch)
        with self.rpc_lock:
            self.client.finish(msg)

    def _finish(self, msg: P.Finish) -> None:
        with _beating_while_waiting(self, self.rpc_lock):  # a long verify step may hold it
            self.client.finish(msg)

    def _report_finished(self) -> None:
        broken: list[str] = []  # reported as cut short: never `verified`
        with _beating_while_waiting(self, self.lock):
            done = []
            for rid, t in list(self.tracked.items()):
                try:
                    finished = t.req.finished()
                except Exception as e:  # noqa: BLE001 - a broken entry must not block the others
                    log.error("mg: %s ends here: its state cannot be read (%s)", rid, e)
                    _untrack(self.tracked, rid)
                    if not t.ended:  # (its Finish went already: never a second, cut-short one)
                        broken.append(rid)
                    continue
                if finished:
                    done.append((rid, t.req))
        if (done or broken) and self.before_finish is not None:
            # the lagged path's forwards launched before these requests finished (the last
            # steps, the look-ahead one) are processed first, while mg still tracks them
            self.before_finish(True)
        epochs, sent = {}, set()  # sent: Finishes the scheduler thread sent already (report_end)
        with _beating_while_waiting(self, self.lock):
            for rid, req in done:
                t = self.tracked.get(rid)
                if t is not None and t.req is req:
                    epochs[rid] = t.epoch
                    if t.ended:
                        sent.add(rid)
                    _untrack(self.tracked, rid)
            if len(self.tracked) != self.published_tracked:  # (0 once traffic stops, else a leak)
                self.published_tracked = len(self.tracked)
                metrics.tracked_requests().set(self.published_tracked)
        for rid, req in done:
            if rid in sent:
                continue
            try:
                self._finish(self.finish_of(rid, req, epochs.get(rid, 0)))
            except Exception as e:  # noqa: BLE001 - the verdict then stays "running" and says so
                log.error("mg: could not report the end of %s: %s", rid, e)
        for rid in broken:
            self._finish(P.Finish(rid=rid, output=[], aborted=True, reason="mg lost track of the request"))


@contextmanager
def _beating_while_waiting(link: ControllerLink, lock: threading.Lock):
    """`lock` for the finish watcher, which beats while it waits. Why: the finish barrier holds
    `link.lock` through a verify call (on a CPU, a 64-request wave's catch-up: about a minute), and
    a long verify step holds `link.rpc_lock`; the watcher is waiting, not dead, and /health must not
    call it down."""
    while not lock.acquire(timeout=BEAT_PERIOD_S):
        link._beat(force=True)
    try:
        yield
    finally:
        lock.release()
