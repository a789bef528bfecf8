"""The controller's arrival side (a mixin of `server.Controller`): prompts computed at arrival.

SGLang's scheduler reports a deterministic request the moment it takes it (protocol `Arrive`,
one way, ahead of its first step). The controller holds its state from then on (`arrived_at`
until its first step; its verdict is `unknown` until then) and, once SGLang's own prefill is
over (no arrival waits for its first step: `_arrivals_ready`), has the verifier compute the
prompt up to its last position at an idle turn; the first answer token is checked against that
prediction with no verify call (`_first_token`). A high-margin first token has left already (the
seam's early release); a low-margin one waits for this computation. A prompt that begins like an
earlier one is mapped from the verifier's prefix cache (verifier/prefix.py), so a shared
preamble or n samples of one prompt cost it once.

Why behind SGLang's prefill and not beside it: the two take turns on one GPU. Measured (one
H200, Llama-3-8B shape, 32 cold prompts, 16 in flight, deterministic TTFT p50 over plain
SGLang's): beside, 1.98x / 2.10x at 100 % deterministic (1,250 / 8,000-token prompts); behind,
1.09x / 1.00x (p99 higher: a low-margin first token now waits for the whole prefill).
"""

from __future__ import annotations

import logging
import time

from mg_server.controller.state import ReqState
from mg_server.wire import protocol as P

log = logging.getLogger("mg.controller")

# An arrived request without a step this long is forgotten (SGLang aborted it in its queue, or it
# waits there still: its first step then starts it afresh); its verifier K/V is released.
ARRIVAL_TTL_S = 120.0
# An arrival without its first step (SGLang still prefills it, or it waits in SGLang's queue) holds the
# computation of arrived prompts this long at most
PREFILL_HOLD_S = 5.0


class ArrivalMixin:
    def _arrive(self, msg: P.Arrive) -> None:
        """A deterministic request reached SGLang's scheduler: its prompt is computed at the next
        idle turn (`_prefill_arrivals`)."""
        st = self.reqs.get(msg.rid)
        if self.cfg.mode == "off" or not msg.prompt or (st is not None and not st.finished_at):
            return
        self._new_request(msg.rid, ReqState.of_prompt(msg.prompt, msg.temperature, msg.seed,
                                                      arrived_at=time.monotonic()))
        self.arrivals[msg.rid] = None

    def _arrivals_ready(self) -> bool:
        """Arrived prompts may be computed now: no arrival younger than PREFILL_HOLD_S waits for
        its first step. Why: the verifier's prefill and SGLang's take turns on one GPU, so
        computing a prompt while SGLang prefills delays every first token; behind SGLang's prefill
        only a low-margin first token waits for it (module doc's numbers)."""
        if not self.arrivals:
            return False
        now = time.monotonic()
        for rid in self.arrivals:
            st = self.reqs.get(rid)
            if st is not None and st.arrived_at and now - st.arrived_at < PREFILL_HOLD_S:
                return False
        return self._arrival_fits(next(iter(self.arrivals)))

    def _arrival_fits(self, rid: str, held=None) -> bool:
        """The verifier's pool has room for this arrival's prompt and no older request waits for
        room (controller/pool.py); a request gone, failed or computed already takes none (its entry
        is dropped by `_prefill_arrivals`)."""
        st = self.reqs.get(rid)
        if st is None or st.error or st.finished_at or st.verifier_len or not (room := self._pool_room()):
            return True
        return not self._someone_waits() and self._may_enter(st, self._pool_held() if held is None else held, room)

    def _prefill_arrivals(self) -> None:
        """The verifier computes arrived prompts (one call's rows a turn, the oldest first): each
        item answers for the prompt's last position, so the verifier's first answer token is known
        (`st.pred`) before, or soon after, the request's first step. A failure here fails nothing:
        the request's checks compute what is missing, as without an arrival."""
        budget, todo, held = self._rows_per_call(), [], self._pool_held()
        for rid in list(self.arrivals):
            if budget <= 0 or not self._arrival_fits(rid, held):
                break  # (the oldest first: one that does not fit waits until a request leaves the pool)
            del self.arrivals[rid]
            st = self.reqs.get(rid)
            if st is None or st.error or st.finished_at or st.verifier_len or not self.verifier_up():
                continue
            if self._catch_up(rid, st, st.prompt_len - 1):
                continue
            todo.append((rid, st))
            budget -= st.prompt_len - st.verifier_len
            held.take_new(rid, st)
        if not todo:
            return
        results = self._verify([self._item(rid, st, st.prompt_len - 1) for rid, st in todo])
        for (rid, st), res in zip(todo, results):
            if isinstance(res, P.ErrorReply):
                log.debug("request %s: its prompt's computation at arrival failed: [%s] %s", rid, res.code,
                          res.message)
                continue
            self.m.arrival_prefills.inc()
            self._audit(rid, st, res)
            st.verifier_len = st.prompt_len
            self._first_token(rid, st)

    def _first_token(self, rid: str, st: ReqState) -> None:
        """The first answer token against the verifier's, once both are known (no verify call:
        the prefill at arrival predicted it); a disagreement is rolled back as a check's is."""
        q = st.prompt_len - 1
        if (st.steps < 1 or st.checked or st.error or st.mismatches or st.epoch or st.pred < 0
                or st.verifier_len != st.prompt_len):
            return
        self.m.verify.inc()
        if st.tokens[q + 1] == st.pred:
            st.verified.append(q)
            st.checked = 1
            if st.steps == 1:
                self.checks.pop(rid, None)  # nothing else of it waits for a check
            return
        self._missed_flip(rid, st, q, "first answer token differs from the verifier's", st.pred, st.pred_margin)
        self._diverged(rid, st)
        if st.epoch:  # rolled back to its first token: what was queued is moot (a check's rollback drops it too)
            self.checks.pop(rid, None)

    def _sweep_arrivals(self) -> None:
        """Forget arrivals that never stepped (ARRIVAL_TTL_S), their verifier K/V released."""
        now = time.monotonic()
        if now - self._arrivals_swept < 1.0:
            return
        self._arrivals_swept = now
        stale = [rid for rid, s in self.reqs.items() if s.arrived_at and now - s.arrived_at > ARRIVAL_TTL_S]
        for rid in stale:
            del self.reqs[rid]
            self.arrivals.pop(rid, None)
        self._release(stale)
