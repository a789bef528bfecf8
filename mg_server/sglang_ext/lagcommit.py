"""`--mg-commit lag` (experimental): the lagged seam's rows are verified one forward behind, so a
low-margin step never holds the stream. LaggedControl's lag side (a mixin, as the controller's
audit is).

Why: a held gate leaves the GPU idle for a whole verify call (3.5 ms on the H100 for SmolLM2,
measured in benchmarks/verify_timeline.py), and at batch 8 with a 10 % trigger rate about half of
all forwards hold. Here the device lets the fast token of a low-margin row through (need 2 in
kernels.gate), and the host asks the verifier one forward later, while the GPU already runs the
next forward (whose input is that fast token). Flips are rare, so the verifier nearly always
agrees and nothing else happens. When it disagrees at output index i (position pos):
- the emitted token is swapped before SGLang's scheduler appends it to the request's output
  (`Outputs.append`; under the overlap scheduler the next forward's sampler call, which drains
  this one, comes before that append; if not, the append drains it), so nothing downstream
  (finish checks, streamed text, the radix cache, mg's Finish) ever sees the fast token;
- the request's next forward (already computed from the fast token) is a MUST row: its gate
  holds, the controller verifies it whatever its margin (StepRow.must), its logits are forced
  to the verifier's token, and its K/V column (position pos + 1, computed from the wrong token)
  and the deferred repair of pos are overwritten with the verifier's columns.
So the answer is the verifier's, as in hold mode; only a disagreement costs a held verify call.
With `--mg-verify-ahead on` every step's answer is known when its forward is processed, so a row
above tau whose fast token differs from it is corrected the same way (`promote_ahead`), where
without it the step would be a missed flip.
The MUST row is honoured on either seam path (the synchronous one, taken when a seeded row or a
user's logit processor joins the batch, verifies and repairs it the same way: hook._control).
A deferred repair whose verifier slot was reused meanwhile is skipped: it only replaces the fast
path's bits of a column with the verifier's (as hold mode's repair does), so the answer does not
depend on it; the MUST row's own column, from the wrong token, is never skipped.

Measured on the H100 (benchmarks/results/gpu/HISTORY.md, "One forward behind"): no gain where
the verifier's process time-slices the GPU with SGLang's; under CUDA MPS it beats holding.
"""

from __future__ import annotations

from array import array

from mg_server import metrics
from mg_server.kernels.decide import BEHIND, HOLD, LAZY, MUST
from mg_server.runtime import protocol as P
from mg_server.sglang_ext.hook import pool_row, resumable


class LagCommit:
    """Mixed into LaggedControl (which provides drain, link and the Forward records)."""

    def init_lag(self, lag: bool) -> None:
        self.lag = lag
        self.unsettled: dict[tuple[str, int], int] = {}  # (key, output index) -> target of the forward deciding it
        self.corrections: dict[tuple[str, int], int] = {}  # (key, output index) -> the verifier's token
        self.fixups: dict[str, list[tuple[int, int, int]]] = {}  # key -> deferred repairs (pos, slot, gen): MUST next
        self.corrected = metrics.lag_corrections() if lag else None
        self.answered_ahead = metrics.musts_answered_ahead() if lag else None

    def mode(self, req, key: str) -> int:
        """The row's mode for kernels.decide: LAZY (resumable), MUST (its input token was
        corrected: verify now), BEHIND (lag), else HOLD."""
        if resumable(req) or self.seam.config.window:  # (window rows: checked behind, rolled back)
            return LAZY
        if not self.lag:
            return HOLD
        return MUST if key in self.fixups else BEHIND

    def track_outputs(self, f, expected: list[int], modes: list[int]) -> None:
        """At launch: route each request's output list through output_token (Outputs), and
        remember which forward decides each BEHIND row's output token."""
        for (_, req, key), e, mode in zip(f.rows, expected, modes):
            if type(req.output_ids) is not Outputs:
                req.output_ids = Outputs(req.output_ids, self, key)
            if mode == BEHIND and e >= 0:
                f.outs.append((key, e - len(req.origin_input_ids) + 1))
                self.unsettled[f.outs[-1]] = f.target

    def correct(self, req, key: str, pos: int, d) -> None:
        """The verifier disagreed with a BEHIND row's fast token (module doc)."""
        self.corrections[(key, pos - len(req.origin_input_ids) + 1)] = d.token
        self.fixups.setdefault(key, []).append((pos, d.slot, d.gen))

    def promote_ahead(self, f, steps, need: dict[int, int]) -> None:
        """--mg-verify-ahead: a fast row (need 0) of a BEHIND request whose step the verifier
        answered ahead with another token becomes a behind row (need 2), as if its margin had
        been below tau: its token went through the gate either way and is not emitted yet, so
        the Step verifies it from the kept answer and the swap corrects it (module doc), where it
        would otherwise be a missed flip (the controller verifies every behind row: StepRow.behind)."""
        lag_keys = {key for key, _ in f.outs}
        for i, _, pos, _, tok, key in steps:
            if need[i] == 0 and key in lag_keys:
                res = self.link.client.ahead_answer(key, pos)
                if res is not None and res.token != tok:
                    need[i] = 2

    def output_token(self, key: str, index: int, token: int) -> int:
        """SGLang appends `token` as output `index` of the request: if that step is verified
        behind, wait for its verdict (normally known already) and return the verifier's token.
        A swapped token also settles the request's MUST forward here, if it is launched: the
        scheduler may release the request in this same call (the swapped token can end it), and
        its K/V columns must be repaired while it still holds them, before the radix cache
        keeps them under the verifier's token. (That forward holds the stream until answered,
        so answering it now only shortens the hold.)"""
        target = self.unsettled.get((key, index))
        if target is not None:
            self.drain(wait=True, upto=target)
        fixed = self.corrections.pop((key, index), None)
        if fixed is None:
            return token
        self.corrected.inc()  # (counted here: a look-ahead row's correction is never emitted)
        if key in self.fixups and not self.answer_ahead(key):
            self.drain(wait=True)
        return fixed

    def answer_ahead(self, key: str) -> bool:
        """--mg-verify-ahead: answer the request's MUST forward (launched, not yet processed)
        from the answers its launch asked for, before the forward's gate would hold: the MUST
        rows' tokens and K/V repairs do not depend on that forward's own values. Waits for its
        ahead call (started at its launch, ~1.4 ms of verifier beside SGLang's forward), not for
        the forward's whole GPU step, and the gate then never holds (measured without it: 1-2 ms
        of idle GPU after ~13 % of bs-8 steps). The forward is processed later as any other (its
        Step commits the same answers). False (nothing done) where it cannot: then drain."""
        if self.ahead is None:
            return False
        with self.lock:
            f = next((f for f in self.pending if any(k == key for _, k, _ in f.musts)), None)
            if f is None or f.answered is not None or f.ahead is None or not f.ahead.wait(self.gate_timeout_s):
                return False
            gens, numel, answers = self.link.slots.gens, self.gate.slot_numel, {}
            for row, k, pos in f.musts:
                res, req = self.link.client.ahead_answer(k, pos), f.rows[row][1]
                if res is None or pool_row(req) is None or res.slot < 0 or int(gens[res.slot]) != res.gen:
                    return False  # (no answer kept, a released row, a reused slot: the drain decides)
                answers[k] = (res, req)
            tokens, repairs = [0] * len(f.rows), []
            for row, k, pos in f.musts:
                res, req = answers[k]
                tokens[row] = res.token
                rpi = int(pool_row(req))
                for p, slot, gen in [(pos, res.slot, res.gen), *self.take_deferred(k)]:
                    repairs.append((slot * numel, rpi, p))
                    f.answered_checks.append((req, k, slot, gen))
            f.answered = {k: res.token for k, (res, _) in answers.items()}
            self.gate.release(f.target, tokens, repairs)
            self.answered_ahead.inc()
            return True

    def inject_fault(self, logits, positions, rows) -> None:
        """Tests only (HookConfig.fault_missed_flip = k, the CPU lagged seam): the k-th answer
        token of every row becomes the runner-up, ahead of the top token by fault_flip_margin (at
        least one ulp), so the fast path emits it and, below tau, the verifier is asked."""
        import torch

        cfg = self.seam.config
        for i, req, _ in rows:
            if int(positions[i]) - len(req.origin_input_ids) + 1 == cfg.fault_missed_flip:
                top = logits[i].float().topk(2)
                up = torch.nextafter(top.values[0], torch.tensor(float("inf"))) + cfg.fault_flip_margin
                logits[i, top.indices[1]] = up.to(logits.dtype)

    def must_keys(self, live) -> set[str]:
        """The synchronous seam's step rows (hook._control) whose request owes a MUST step."""
        return {key for *_, key in live if key in self.fixups}

    def take_deferred(self, key: str) -> list[tuple[int, int, int]]:
        """Pop the request's deferred repairs (pos, slot, gen), without those whose verifier slot
        was reused meanwhile (skipped: module doc)."""
        gens = self.link.slots.gens  # (slot -1: an answer verified ahead without its column)
        return [(p, slot, gen) for p, slot, gen in self.fixups.pop(key, []) if slot >= 0 and int(gens[slot]) == gen]

    def with_deferred(self, repair, live):
        """hook._control's repair callback for MUST rows: the row's own column, then the
        deferred ones (module doc)."""
        key_of = {id(req): key for _, req, *_, key in live}

        def both(req, pos: int, d) -> None:
            repair(req, pos, d)
            for p, slot, gen in self.take_deferred(key_of[id(req)]):
                repair(req, p, P.StepDecision(rid=d.rid, slot=slot, gen=gen))
        return both

    def settled(self, f) -> None:
        """After a forward is processed: its output tokens are decided; forget what requests that
        mg no longer tracks left behind."""
        for k in f.outs:
            self.unsettled.pop(k, None)
        if self.fixups or self.corrections:
            tracked = self.link.tracked
            for k in [k for k in list(self.fixups) if k not in tracked]:
                self.fixups.pop(k, None)
            for k in [k for k in list(self.corrections) if k[0] not in tracked]:  # (popped by the scheduler too)
                self.corrections.pop(k, None)


class Outputs(array):
    """A lag request's `req.output_ids` (SGLang's is an int64 array): the scheduler adds each
    emitted token with `append` (a prefill) or `extend` (a decode step; seams.py checks both
    source facts), and a token verified behind is swapped for the verifier's there, before
    anything reads it."""

    def __new__(cls, items, lag: LagCommit, key: str):
        self = super().__new__(cls, "q", items)
        self._lag, self._key = lag, key
        return self

    def append(self, token) -> None:
        super().append(self._lag.output_token(self._key, len(self), int(token)))

    def extend(self, tokens) -> None:
        for token in tokens:
            self.append(token)


__all__ = ["LagCommit", "Outputs"]
