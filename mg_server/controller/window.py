"""The controller's window commit side (a mixin of `server.Controller`).

A protected request's every step is committed fast. Its tokens are checked behind, every live
request's pending tokens in one verify call (`_run_checks`, whose catch-up audits every token):
within CHECK_DELAY_FORWARDS forwards of a low-margin step, or once `window` tokens wait unchecked. Where the
verifier disagrees at answer index p, the controller cuts its own copy of the answer there, puts
the verifier's token at p, has the verifier drop its positions past p (`VerifyItem.rewind`), and
queues a `Rollback` that the seam applies in place at the request's next forward
(seam/rollback.py). Rows the seam sends before it has applied it carry the older epoch and
are dropped. A request SGLang ended with unchecked tokens is checked at once: its end held
(seam/rollback.py), its surplus rows carry `due`; or the seam's finish barrier asks `CheckTail`.
The seam's output hold releases what `checked` says.
"""

from __future__ import annotations

import logging

from mg_server.controller.state import ReqState
from mg_server.wire import protocol as P

# A low-margin step is checked at most this many forwards later. Why not at once: every check
# reads all the verifier's weights, and at batch 8 and a 10 % trigger rate almost every forward has
# a low-margin row, so checks of several forwards are coalesced into one call; why not later: a
# flip's rollback throws away the tokens decoded after it. On the 8B shape at a 0.7 % flip rate
# 16 measured best of 4, 8 and 16 (docs/history/window-verification.md).
CHECK_DELAY_FORWARDS = 16
log = logging.getLogger("mg.controller")
UNHELD = 1 << 30  # `checked` of a request after a missed flip: the seam holds nothing back any more


class WindowMixin:
    def _window_step(self, row: P.StepRow, st: ReqState) -> None:
        low = self.policy.should_verify(row.margin)
        self.m.steps.labels(decision="verify" if low else "fast").inc()
        st.tokens.append(row.fast_token)
        st.margins.append(row.margin)
        if row.released:
            st.released = st.steps
        if row.due and st.due_from is None:
            st.due_from = st.steps - 1
        if row.rid in self.parked and self._waits_parked(st):  # no room in the verifier's pool yet: no call
            if low:
                self.parked[row.rid].append(row.pos)
            return
        # why only until the end is checked: the surplus past it is never shown, so checking it
        # would only add verifier calls (a flip there is moot)
        if (row.due and st.checked < st.due_from) or st.steps - st.checked >= self.cfg.window:
            self.window_due = self.forwards
        elif low and (self.window_due is None or self.window_due > self.forwards + CHECK_DELAY_FORWARDS):
            self.window_due = self.forwards + CHECK_DELAY_FORWARDS
        if low or self.window_due is not None:
            self.checks.setdefault(row.rid, []).append(row.pos)

    def _checks_due(self) -> bool:
        """Idle work waits for it: checks once due."""
        return bool(self.checks) and (self.window_due is None or self.forwards >= self.window_due)

    def _all_window_checks(self) -> None:
        """A window check covers every live request with unchecked tokens: one verifier forward
        reads the weights once whatever rows it carries."""
        self.window_due = None
        for rid, st in self.reqs.items():
            if not st.finished_at and not st.error and st.checked < st.steps:
                self.checks.setdefault(rid, [])

    def _diverged(self, rid: str, st: ReqState) -> None:
        """The check found the verifier disagreeing: roll the request back."""
        if min(st.mismatches) + 1 - st.prompt_len >= st.released:
            self._roll_back(rid, st)
        else:  # a token a stream let leave early was wrong: a missed flip (verdict mismatch)
            self._missed_release(rid, st)

    def _roll_back(self, rid: str, st: ReqState) -> None:
        q = min(st.mismatches)  # t_{q+1} is the first token the verifier would not have chosen
        token = st.flip_token
        index = q + 1 - st.prompt_len
        self.m.dropped_steps.inc(len(st.tokens) - q - 2)  # t_{q+2} ..: decoded on the wrong timeline
        del st.tokens[q + 1:], st.margins[index:]
        st.tokens.append(token)
        st.margins.append(-1.0)  # the verifier's token: no fast margin
        st.mismatches.clear()
        st.flip_token, st.pred = -1, -1
        st.due_from = None  # a rollback before a held end voids it; one past it leaves it checked
        st.verifier_len, st.rewind = min(st.verifier_len, q + 1), True
        st.verified = [x for x in st.verified if x < q] + [q]
        st.repairs.append(q)
        st.epoch += 1
        st.checked = index + 1
        self.rollbacks[rid] = st.last_rollback = P.Rollback(rid=rid, index=index, token=token, epoch=st.epoch)
        self.m.rollbacks.inc()
        self.m.repair.inc()

    def _missed_release(self, rid: str, st: ReqState) -> None:
        """Nothing to roll back: the client has the wrong token. The request runs on unheld and
        unchecked (its answer no longer follows the verifier's), and its verdict is `mismatch`."""
        log.warning("missed flip: request %s answer token %d left in a stream before its check and the verifier "
                    "disagrees (verdict mismatch)", rid, min(st.mismatches) + 1 - st.prompt_len)
        st.checked = UNHELD
        self.m.missed_flips.inc()

    def _window_progress(self) -> dict[str, list[int]]:
        return {rid: [st.epoch, st.checked] for rid, st in self.reqs.items()
                if not st.finished_at and not st.error and not st.arrived_at}

    def _check_tail(self, rid: str) -> P.TailReply:
        """The finish barrier: every decided token of the request checked now, in one verify call
        that takes every window request's pending tokens too (requests of one batch often end in
        the same forward: one call for all of them, not one weight read each)."""
        st = self.reqs.get(rid)
        if st is None or st.error:
            return P.TailReply(error=st.error if st is not None else "unknown request")
        if st.checked < st.steps and not st.mismatches and rid not in self.rollbacks:
            self._all_window_checks()
            self._run_checks(first=rid)  # (never the one a full pool defers to the next turn)
        if st.error:
            return P.TailReply(error=st.error)
        self.rollbacks.pop(rid, None)
        # the latest rollback, told again: the seam may not have applied it yet (it knows by epoch)
        return P.TailReply(rollback=st.last_rollback, epoch=st.epoch, verified=st.checked)
