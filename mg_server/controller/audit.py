"""The controller's audit side: missed flips, a request's end, its tail audit and its verdict.

A mixin of `server.Controller` (the same process and state; split out to keep each file
readable): it uses the controller's request table (`reqs`), deferred tail audits (`pending`),
metrics (`m`), config (`cfg`), verifier client (`vclient`, `verifier_up`) and its catch-up
(`_catch_up`, `_item`). A request's verdict is `verified` only when its answer is complete and
every emitted token was checked against the verifier (server module doc).
"""

from __future__ import annotations

import logging
import time

from mg_server.controller.correct import AnswerCompletion, can_correct
from mg_server.controller.state import ReqState
from mg_server.wire import protocol as P

log = logging.getLogger("mg.controller")

# Tail audits per verify call: finished requests' tails go to the verifier together (one batched
# forward; on the H100 8 requests' step costs 1.61 ms where one costs 1.36), bounded well below
# the verifier's items per message (VerifierConfig.max_batch_items, 64).
AUDIT_ITEMS = 32
# A missed flip's completion runs in slices of about this long, one per verdict ask (the front
# asks every 10 ms while it reads `running`): Steps are served in between (correct.AnswerCompletion).
CORRECTION_SLICE_S = 0.02


class AuditMixin:
    def _missed_flip(self, rid: str, st: ReqState, pos: int, what: str, token: int, margin: float) -> None:
        """t_{pos+1} is not the verifier's `token`, which it chose with `margin` (each position once)."""
        if pos in st.mismatches:
            return
        if not st.mismatches or pos < min(st.mismatches):
            st.flip_token = token
        st.mismatches.append(pos)
        i = pos + 1 - st.prompt_len  # the fast margin of the token the verifier overturned (tau's headroom)
        if 0 <= i < len(st.margins) and st.margins[i] >= 0:
            self.m.flip_margin.observe(st.margins[i])
        # the verifier's margin there and where it sits against the request's verified steps and
        # repairs tell a near-tie above tau from a fast path that went wrong after a repair
        last_rep = max((p for p in st.repairs if p <= pos), default=-1)
        last_ver = max((p for p in st.verified if p <= pos), default=-1)
        # (debug: a disagreement is usually rolled back before anyone sees it; window.py warns
        # where a released token was wrong)
        log.debug("disagreement: request %s position %d (%s); answer token %d, verifier margin %.4g (tau %.4g); "
                    "last verified step %d, last repair %d (repairs %d, verified %d)", rid, pos, what,
                    pos - st.prompt_len + 1, margin, self.policy.tau, last_ver, last_rep, len(st.repairs),
                    len(st.verified))

    def _audit(self, rid: str, st: ReqState, res: P.VerifyResult) -> None:
        """The verifier's catch-up recomputed steps that were committed from the fast path."""
        q, start = res.first_mismatch, res.pos - len(res.audit_tokens)  # it covered start .. pos
        if q >= 0:  # the verifier's t_{q+1}: its previous prediction (q = start - 1) or this audit's
            i = q - start
            token, margin = (st.pred, st.pred_margin) if i < 0 else (
                res.audit_tokens[i], res.audit_margins[i] if i < len(res.audit_margins) else float("nan"))
            self._missed_flip(rid, st, q, "fast-path token differs from the verifier's", token, margin)
        st.pred, st.pred_margin = res.token, res.margin

    def _audit_through(self, rid: str, st: ReqState, pos: int, res: P.VerifyResult, what: str) -> None:
        """A result at pos whose t_{pos+1} was decided already (a check, the tail audit): audit its
        catch-up and that token too; the verifier has then seen t_0 .. t_pos."""
        self._audit(rid, st, res)
        if res.first_mismatch < 0 and res.token != st.tokens[pos + 1]:
            self._missed_flip(rid, st, pos, what, res.token, res.margin)
        st.verifier_len = pos + 1

    def _finish(self, msg: P.Finish) -> None:
        st = self.reqs.get(msg.rid)
        if st is None:
            st = self.reqs[msg.rid] = ReqState(error="request finished without a step the controller saw")
        if not st.error and st.tokens and msg.aborted and msg.epoch < st.epoch:
            # cut before the seam applied the latest rollback: SGLang's answer left mg's timeline at
            # the cut, and an aborted answer is never verified, so only the part before it must agree
            st.reconcile_cut(msg.output, st.last_rollback.index)
            self.rollbacks.pop(msg.rid, None)
        elif not st.error and st.tokens:
            extra = st.reconcile(msg.output)
            if extra:  # the overlap scheduler's look-ahead forward(s) after the last token, a held end's surplus
                self.m.lookahead.inc(extra)
                log.debug("request %s: %d look-ahead step(s) dropped", msg.rid, extra)
        st.arrived_at = 0.0
        st.aborted = (msg.reason or "aborted") if msg.aborted else ""
        st.end = msg
        st.finished_at, st.audit_pending = time.monotonic(), True
        self.pending[msg.rid] = None

    def _complete(self, rids: list[str]) -> None:
        """The deferred part of Finish for these finished requests: audit their tails (together:
        one verify call serves up to AUDIT_ITEMS of them in one batched forward), then free the
        verifier's shadow caches."""
        done, todo = [], []  # todo: (rid, state, tokens) of the tails to audit
        for rid in dict.fromkeys(rids):  # each once, in order
            self.pending.pop(rid, None)
            st = self.reqs.get(rid)
            if st is None or not st.audit_pending:
                continue
            done.append((rid, st))
            n = len(st.tokens)
            # t_{n-1} was chosen at position n-2; unless that step was verified, audit the tail
            # (if the request emitted a token at all: with max_new_tokens 0, t_{n-1} is the prompt's).
            emitted = n > st.prompt_len
            if (emitted and not st.aborted and not st.error and self.cfg.mode != "off"
                    and st.verifier_len < n - 1):
                todo.append((rid, st, n))
        if todo:
            self._final_audits(todo)
        for _, st in done:
            st.audit_pending = False
        self._release([rid for rid, _ in done])
        self._expire()

    def _release(self, rids: list[str]) -> None:
        """Free the verifier's shadow caches of these requests (if it is up); the parked checks
        are due again (controller/pool.py)."""
        if rids:
            self._unpark()
        if rids and self.vclient is not None and self.verifier_up():
            try:
                self.vclient.release(rids, timeout_s=5)
            except Exception as e:  # noqa: BLE001 - a failed release only costs verifier memory
                log.warning("release of %d request(s) failed: %s", len(rids), e)

    def _final_audits(self, todo: list[tuple[str, ReqState, int]]) -> None:
        """Each request's catch-up, then its last decided step (position n - 2), AUDIT_ITEMS per
        verify call; a request's failure is its own (the others' results stand)."""
        from mg_server.verifier.client import VerifierError

        if not self.verifier_up():
            for _, st, _ in todo:
                st.error = "deterministic verifier is not running (final audit)"
            return
        ready, flipped = [], {id(st) for _, st, _ in todo if st.mismatches}  # (a stream's missed flip: counted)
        for rid, st, n in todo:
            st.error = self._catch_up(rid, st, n - 2)
            if not st.error:
                ready.append((rid, st, n))
        for k in range(0, len(ready), AUDIT_ITEMS):
            part = ready[k:k + AUDIT_ITEMS]
            results = self._verify([self._item(rid, st, n - 2) for rid, st, n in part])  # (rows bounded)
            for (rid, st, n), res in zip(part, results):
                if isinstance(res, P.ErrorReply):
                    st.error = f"verifier (final audit): {VerifierError.of(res)}"
                else:
                    self._audit_through(rid, st, n - 2, res, "final token")
        # an answer whose end was never checked before it left: nothing can roll it back now
        self.m.missed_flips.inc(sum(1 for _, st, _ in todo if st.mismatches and not st.error and id(st) not in flipped))

    def _verdict(self, rid: str, correct: bool = False) -> P.VerdictReply:
        if rid in self.pending:  # its response is waiting for this audit: run every pending one with it
            self._complete([rid, *self.pending])
        st = self.reqs.get(rid)
        if st is None or st.arrived_at:  # (arrived, never stepped: as if unseen)
            return P.VerdictReply(rid=rid, state=P.VerdictState.UNKNOWN)
        if correct and st.correction is None and can_correct(st, self.cfg.mode) and self.verifier_up():
            job = self.completing.get(rid)
            if job is None:
                job = self.completing[rid] = AnswerCompletion(rid, st, self.cfg.verify_timeout_s)
            try:
                corr = job.advance(self.vclient, CORRECTION_SLICE_S)
            except Exception as e:  # noqa: BLE001 - the verdict stays `mismatch`
                self.completing.pop(rid, None)
                log.error("request %s: correction failed: %s", rid, e)
            else:
                if corr is None:  # not complete yet: the front asks again (and Steps go first)
                    return P.VerdictReply(rid=rid, state=P.VerdictState.RUNNING, steps=st.steps,
                                          verified_steps=len(st.verified), repairs=len(st.repairs),
                                          mismatch_positions=list(st.mismatches))
                del self.completing[rid]
                st.correction = corr
                self.m.corrections.inc()
                log.warning("request %s: missed flip at answer token %d corrected by the verifier (%d tokens, "
                            "%d verify calls)", rid, corr.first, len(corr.output), job.calls)
        return P.VerdictReply(rid=rid, state=st.state(self.cfg.mode), steps=st.steps,
                              verified_steps=len(st.verified), repairs=len(st.repairs),
                              mismatch_positions=list(st.mismatches), error=st.error or st.aborted,
                              correction=st.correction if correct else None)

    def _count_live(self) -> None:
        """mg_live_requests: after each tail audit and at idle turns, so 0 once traffic stops."""
        self.m.live_requests.set(sum(1 for s in self.reqs.values() if not s.finished_at and not s.arrived_at))
        self.m.pool_waiting.set(len(self.parked))

    def _expire(self) -> None:
        self._count_live()
        now = time.monotonic()
        for rid in [r for r, s in self.reqs.items() if s.finished_at and now - s.finished_at > self.cfg.verdict_ttl_s]:
            del self.reqs[rid]
            job = self.completing.pop(rid, None)  # a completion nobody asked for again
            if job is not None and self.vclient is not None:
                job.release(self.vclient)
