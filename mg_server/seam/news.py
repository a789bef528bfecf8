"""The step seam's window commit side (a mixin of hook.StepSeam).

Every protected row is committed fast (the controller checks the tokens behind:
controller/window.py). The controller's news (a rollback to apply, how much is checked) reaches
`Tracked` through the link's stop watcher or the finish barrier; the forward that next carries a
request with a rollback takes the synchronous path, which applies it in place (rollback.py) and
forces the verifier's token. Rows the seam sends carry the request's epoch (its rollbacks
applied), so the controller drops those of a timeline it has cut already.
"""

from __future__ import annotations

import logging
from functools import partial

from mg_server.config import INSTANCE_PARAM, instance_key
from mg_server.seam import rollback
from mg_server.seam.link import StepDecision, Tracked
from mg_server.wire import protocol as P

log = logging.getLogger(__name__)


class WindowSeam:
    def mark_window_rows(self, rows: list[P.StepRow], live) -> None:
        """The seam's epoch of each row's request (StepRow.epoch), and whether a stream's token may
        leave before its check (StepRow.released: the margin gate's early release)."""
        policy = self.link.policy
        with self.link.lock:
            for r, (_, req, *_) in zip(rows, live):
                t = self.link.tracked.get(r.rid)
                r.epoch = t.epoch if t is not None else 0
                if t is not None and t.hold is not None and t.hold.end is not None:
                    r.due = True  # a held end's surplus: its end is checked at once, and never released
                    continue
                # why: a high-margin stretch cannot flip (calibration), so a stream need not wait for
                # its check; tau 0 releases nothing early, and a low-margin step stops the stretch
                if not (req.stream and policy.mode == "margin" and policy.tau > 0 and r.margin >= policy.tau):
                    continue
                decided = len(t.tokens) - len(req.origin_input_ids) if t is not None else 0
                h = t.hold if t is not None else None
                if decided == (max(h.verified, h.released) if h is not None else 0):
                    r.released = True
                    if h is not None:
                        h.released = decided + 1
                    else:
                        self._released_first.add(r.rid)

    def _rollback_due(self, rows) -> bool:
        """A request of this forward has a rollback to apply (the synchronous path does it)."""
        with self.link.lock:
            return any(getattr(self.link.tracked.get(key), "rollback", None) is not None for _, _, key in rows)

    def _roll_back(self, live: list, fails: list) -> list[tuple[int, StepDecision]]:
        """Apply the rollbacks the controller queued for these rows' requests (rollback.py): each
        such row is forced to the verifier's token and taken out of `live` (the controller has
        cut its own copy already). Caller holds the link's lock."""
        rolled, keep = [], []
        for row in live:
            i, req, _, _, _, _, key = row
            t = self.link.tracked.get(key)
            rb = t.rollback if t is not None else None
            if rb is not None and t.hold.moot(rb.index):  # queued before its request's end was held
                t.rollback, rb = None, None
            if rb is None:
                keep.append(row)
                continue
            o = len(req.origin_input_ids)
            try:
                rollback.roll_back(req, len(t.tokens) - o, rb.index, self.runner.token_to_kv_pool_allocator,
                                   self.runner.req_to_token_pool.req_to_token)
            except Exception as e:  # noqa: BLE001 - fail the request loudly, never emit unchecked tokens
                fails.append((req, key, f"rollback failed: {e}"))
                continue
            if self.plan is not None:  # (TP: the followers roll back alike, ranks.py)
                self.plan.at(i).rollback = (len(t.tokens) - o, rb.index)
            log.debug("mg: request %s rolled back to answer index %d (token %d)", key, rb.index, rb.token)
            del t.tokens[o + rb.index:]
            t.tokens.append(rb.token)
            t.epoch, t.rollback = rb.epoch, None
            t.hold.verified, t.hold.end = rb.index + 1, None  # (a rollback before a held end voids it)
            rolled.append((i, StepDecision(rid=key, token=rb.token, verified=True)))
        live[:] = keep
        return rolled

    def check_tail(self, key: str, req, upto: int) -> tuple[int, int] | None:
        """The finish barrier (rollback.py): the controller checks the request's every token now.
        Called in the scheduler thread from SGLang's finish rules; (p, token) of a disagreement
        before answer index `upto` (applied at the request's next forward) or None once the first
        `upto` tokens are checked."""
        link = self.link  # (the caller holds link.lock: the finish watcher must not see this end yet)
        t = link.tracked.get(key)
        if t is None or t.hold is None:  # (untracked: mg lost it, and reported it cut short)
            self._fail(req, "mg lost track of the request at its end")
            req.finished_reason, req.to_finish = req.to_finish, None
            return None
        try:
            with link.rpc_lock:
                reply = link.client.check_tail(key)
        except Exception as e:  # noqa: BLE001 - fail loudly rather than release unchecked tokens
            reply = P.TailReply(error=f"mg controller unavailable: {e}")
        if reply.error:
            self._fail_at_finish(t, req, reply.error)
            return None
        rb = reply.rollback or t.rollback
        log.debug("mg: finish barrier of %s: %s (epoch %d, verified %d of %d)", key, rb, t.epoch, reply.verified,
                 len(req.output_ids))
        if rb is not None and rb.epoch > t.epoch:
            if not t.hold.moot(rb.index, upto):
                t.rollback = rb
                return rb.index, rb.token
            t.rollback = None
        if reply.epoch == t.epoch:
            t.hold.verified = max(t.hold.verified, reply.verified)
        if t.hold.verified < upto:  # never let unchecked tokens out as an answer
            self._fail_at_finish(t, req, f"finish barrier: {t.hold.verified} of {upto} tokens checked")
        return None

    def ended(self, key: str, req, n: int) -> None:
        """The request finished with every one of its `n` answer tokens checked (rollback.py; the
        scheduler thread, the caller holds link.lock): its Finish goes now, if the seam has reported every
        step through the end, else the finish watcher sends it after the lagged path's drain (a
        forward processed late: SGLang's delayed sampling; or `checked` unheld after a missed
        flip). Rows of later forwards are not reported (hook's `_classify`) or, classified before
        this, dropped by the controller as a finished request's."""
        t = self.link.tracked.get(key)
        if t is None or t.req is not req or t.failed or t.ended:
            return
        if len(t.tokens) - len(req.origin_input_ids) < n:  # (a report appends to `tokens` after its send)
            return
        t.ended = True
        try:
            self.link.report_end(key, req, t.epoch)
        except Exception as e:  # noqa: BLE001 - never raise into SGLang's finish rules: the watcher reports it
            t.ended = False
            log.warning("mg: the end of %s goes to the finish watcher: %s", key, e)

    def _fail_at_finish(self, t: Tracked, req, why: str) -> None:
        """Fail a request the finish barrier holds: its abort replaces the end SGLang just gave it."""
        t.failed = True
        self._fail(req, why)
        req.finished_reason, req.to_finish = req.to_finish, None

    def hold(self, req, t: Tracked) -> None:
        """The request's output held until checked, its finish behind the barrier (rollback.py)."""
        key = instance_key(req.rid, (req.sampling_params.custom_params or {}).get(INSTANCE_PARAM))
        t.hold = rollback.hold(req, partial(self.check_tail, key), self.link.lock, partial(self.ended, key))
        if key in self._released_first:  # (its first row was released before it was tracked)
            self._released_first.discard(key)
            t.hold.released = 1
