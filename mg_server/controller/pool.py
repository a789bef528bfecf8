"""The verifier's K/V pool as the controller sees it (a mixin of `server.Controller`): which
requests it holds, and which may enter it now.

The pool is sized to the deterministic load (verifier/budget.py: by default 2 % of SGLang's K/V,
two 8k-token prompts on the 8B shape), so long deterministic prompts can outnumber what it holds.
The engine then evicts its least recently used request for a newcomer, and that request's next
check computes it again from position 0. Rules, so each token is computed about once:

* a request the verifier holds (computed, not released) is checked whenever due;
* a new one enters (its arrival's prefill, its first check) when its tokens fit beside what the
  verifier holds, or when it holds nothing; otherwise it is parked: its tokens stay held in
  SGLang's output and its checks wait until a request leaves the pool (`_unpark`);
* the finish barrier's request enters at once (SGLang's scheduler waits for it); a held end
  (SGLang decodes a surplus behind it) waits for room DUE_PATIENCE forwards, then enters anyway:
  the seam's barrier would take it at 64 surplus tokens, stalling the scheduler;
* a held end, once checked, leaves the pool at once (`_free_checked_end`), not at its Finish.

Measured with a fake verifier of such a pool (tests/test_pool_admission.py: room for two of 8
requests of 190 tokens; burst / spaced arrivals, finish barrier / held ends): the verifier
computed 2.71 / 2.80 / 2.72 / 4.20x the requests' tokens before, 1.00-1.01x with these rules; on
a GPU at 100 % deterministic 8k-token prompts it computed 2.4x (docs/history/prefix-reuse.md).
The price: a parked request's low-margin first token waits for its turn in the pool.
"""

from __future__ import annotations

from mg_server.controller.state import ReqState

# Forwards a held end waits for room in the pool before it enters anyway (evicting the least
# recently used request). Why half of the seam's 64-token surplus (seam/rollback.SURPLUS_MAX):
# past that the seam's finish barrier checks it while SGLang's scheduler waits.
DUE_PATIENCE = 32


class PoolMixin:
    def _pool_room(self) -> int:
        """The verifier's pool in tokens (0: not known yet, nothing is parked)."""
        f = self.verifier_facts()
        return f.pool_tokens if f else 0

    @staticmethod
    def _holds(st: ReqState) -> bool:
        """The verifier holds this request's K/V (as far as the controller knows: an eviction shows
        at its next call, which computes it again)."""
        return st.verifier_len > 0 and not st.freed and (not st.finished_at or st.audit_pending)

    def _pool_held(self) -> int:
        return sum(st.verifier_len for st in self.reqs.values() if self._holds(st))

    def _may_enter(self, st: ReqState, held: int, room: int) -> bool:
        """A request the verifier does not hold may enter beside `held` tokens (module doc)."""
        return (not room or held == 0 or held + len(st.tokens) <= room
                or st.due_from is not None and st.steps - st.due_from >= DUE_PATIENCE)

    def _park(self, rid: str, positions: list[int]) -> None:
        self.parked[rid] = self.parked.pop(rid, []) + positions

    def _unpark(self) -> None:
        """A request left the pool: the parked checks are due again (they enter if they fit)."""
        if self.parked:
            for rid, positions in self.parked.items():
                self.checks[rid] = positions + self.checks.get(rid, [])
            self.parked = {}
            self.window_due = None

    def _check_order(self, todo: dict[str, list[int]], first: str) -> list[tuple[str, list[int]]]:
        """`first` (the finish barrier's), then the requests the verifier holds, then held ends,
        then the others in their order; each with its parked positions too."""
        def rank(rid: str) -> int:
            st = self.reqs.get(rid)
            return (0 if rid == first else 1 if st is None or self._holds(st) else 2 if st.due_from is not None
                    else 3)

        return [(rid, self.parked.pop(rid, []) + todo[rid]) for rid in sorted(todo, key=rank)]

    def _free_checked_end(self, rid: str, st: ReqState) -> None:
        """A held end checked through its end: the seam finishes it at its next forward and no
        check or audit needs its K/V any more, so the pool takes the next request now."""
        if st.due_from is not None and st.checked >= st.due_from and not st.mismatches and not st.freed:
            st.freed = True
            self._release([rid])
            self._unpark()
