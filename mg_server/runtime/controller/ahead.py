"""`--mg-verify-ahead` (experimental): the verifier answers a deterministic request's step while
the fast path computes it, not after. A mixin of the Controller (as the audit is).

Why: on the lagged seam the host asks for step N's verdict only after N's forward is done (it
needs N's margin), and SGLang appends N's token right after that, so the scheduler thread waits
for the whole verify call (2.1-3.1 ms on an H100, SmolLM2 at batch 8) while its next forward is
not yet prepared: a CUDA-event timeline found every such step host-bound, SGLang's stream idle
1.4-2.6 ms after it (benchmarks/results/gpu/HISTORY.md, "Fused prologue matmuls, and what one
verify call costs a bs-8 step"). The verifier's forward for step N needs no margin, only t_pos,
which is decided when the forward before N is processed, just before N is launched. So the seam
sends `VerifyAhead` for every protected row at N's launch, from a thread of its own; the
verifier's forward (its own stream) runs beside SGLang's, and when the host processes N the
verdict is there: `_verify` takes it from `chained` (the slot ring's rule, `_drop_stale_chained`,
applies as to a chained answer), and a fast-committed row's token is compared with it at once
(`_step`: a difference is a missed flip, as with a chained answer). On lag's rows no flip is
missed: the seam compares each fast row's token with its answer before the Step
(LagCommit.promote_ahead) and sends a differing row as a behind row, which `_step` verifies
(from the answer) as it does every behind row, so it is corrected as a low-margin row would be.

The cost: the verifier runs every protected step, not only the low-margin ones (its GPU work
shares the device with SGLang's forward), and its host work takes the GIL beside SGLang's.
Nothing here changes a token: an ahead result is the verifier's answer for the same tokens,
t_0 .. t_pos, that a verify call at the Step would send, and a row whose position moved on
(its Step came first) is skipped.
"""

from __future__ import annotations

from mg_server.runtime import protocol as P


class AheadMixin:
    """Mixed into Controller (which provides reqs, chained, policy, m and the verify helpers):
    answers kept for a coming step, verified ahead here or chained (VerifyItem.chain), and when
    a Step may use one (`_drop_stale_chained`)."""

    def _verify_ahead(self, rows: list[P.AheadRow]) -> None:
        ask = []  # (rid, state, pos, must)
        for row in rows:
            st = self.reqs.get(row.rid)
            if (st is None or st.error or st.finished_at or st.resumable or st.mismatches
                    or row.pos != len(st.tokens) - 1):  # gone, failed, checked behind, diverged, or stale
                continue
            known = self.chained.get(row.rid)
            if known is not None and known.pos == row.pos:  # a chained answer for this step exists
                continue
            ask.append((row.rid, st, row.pos, row.must))
        if not ask or self.cfg.mode == "off" or not self.verifier_up():
            return  # (the Step verifies or fails these rows itself)
        items = []
        for rid, st, pos, must in ask:
            rewind = st.verifier_len > pos  # it has seen t_pos already (a dropped chained answer)
            if rewind:
                st.verifier_len = pos
            elif err := self._catch_up(rid, st, pos):
                st.error = err
                continue
            # only a MUST row's column is sure to be written to SGLang's pool (VerifyItem.column)
            items.append((rid, st, pos, self._item(rid, st, pos, rewind=rewind, column=must)))
        if not items:
            return
        results = self._call_verifier([it for *_, it in items])
        for (rid, st, pos, _), res in zip(items, results):
            if isinstance(res, P.ErrorReply):  # as a failed verify call: the request fails loudly
                st.error = f"verifier (ahead): [{res.code}] {res.message}"
                self.m.verify_errors.inc()
                continue
            self.m.verify_ahead.inc()
            self._audit(rid, st, res)  # (the Step does not audit a chained answer again)
            st.verifier_len = pos + 1
            self.chained[rid] = res

    def _drop_stale_chained(self, ready: list) -> set[str]:
        """Use a chained answer only while its K/V slot surely outlives this call's reply: the
        slots are a ring, and every result since (catch-ups, checks, audits) took one. Else the
        row's step is verified again (a rewind to pos: the verifier has seen t_{pos} already).
        Returns the rids to rewind."""
        rewind: set[str] = set()
        if all(res is None for *_, res in ready):
            return rewind
        n_slots = self.vinfo.shm.n_slots if self.vinfo is not None and self.vinfo.shm is not None else 0
        newest = self.vclient.last_gen + 2 * len(ready)  # (this call adds <= 2 results per row)
        for k, (i, row, st, res) in enumerate(ready):
            if res is None:
                continue
            if res.slot < 0:  # an answer without its column (VerifyItem.column): kept unless a repair needs
                # it; a behind row's repair is deferred and may be skipped (sglang_ext/lagcommit.py)
                if row.behind or not (row.must or res.token != row.fast_token):
                    continue
            elif newest - res.gen < n_slots // 2:
                if row.must:
                    self.m.chained.inc()
                continue
            ready[k] = (i, row, st, None)
            st.verifier_len = row.pos
            rewind.add(row.rid)
        return rewind
