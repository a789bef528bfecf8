"""The verifier's K/V pool as the controller sees it (a mixin of `server.Controller`): which
requests it holds, and which may enter it now.

The pool is sized to the deterministic load (verifier/budget.py: by default 2 % of SGLang's K/V,
two 8k-token prompts on the 8B shape), so long deterministic prompts can outnumber what it holds.
The engine then evicts its least recently used request for a newcomer, and that request's next
check computes it again from position 0. Rules, so each token is computed about once:

* a request the verifier holds (computed, not released) is checked whenever due;
* a new one enters (its arrival's prefill, its first check) when its tokens fit beside what the
  verifier holds, or when it holds nothing; otherwise it is parked: its tokens stay held in
  SGLang's output and its checks wait until a request leaves the pool (`_release`); new ones
  enter in their order (one parked: the younger wait too, so a long one is not overtaken);
* a prompt's whole blocks that an earlier request computed count once (the verifier's prefix
  cache maps them: n samples of one prompt, a shared preamble);
* the finish barrier's request enters at once (SGLang's scheduler waits for it); a held end
  (SGLang decodes a surplus behind it) waits for room DUE_PATIENCE forwards, then enters anyway:
  the seam's barrier would take it at 64 surplus tokens, stalling the scheduler;
* a held end, once checked, leaves the pool at once (`_free_checked_end`), not at its Finish;
* one the verifier evicted all the same (those it holds outgrew the pool) is parked, and
  computed again once it fits (`_evicted`), not at once, which would evict the next one.

Measured with a fake verifier of such a pool (tests/test_pool_admission.py: room for two of 8
requests of 190 tokens; burst / spaced arrivals, finish barrier / held ends): the verifier
computed 2.71 / 2.80 / 2.72 / 4.20x the requests' tokens before, 1.00-1.01x with these rules;
answers that outgrow the pool 5.52x, 1.17x. On a GPU at 100 % deterministic 8k-token prompts it
computed 2.4x (docs/history/prefix-reuse.md).
The price: a parked request's low-margin first token waits for its turn in the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mg_server.controller.state import ReqState
from mg_server.verifier.prefix import BLOCK
from mg_server.wire import protocol as P

# Forwards a held end waits for room in the pool before it enters anyway (evicting the least
# recently used request). Why half of the seam's 64-token surplus (seam/rollback.SURPLUS_MAX):
# past that the seam's finish barrier checks it while SGLang's scheduler waits.
DUE_PATIENCE = 32


def prompt_blocks(st: ReqState) -> tuple[int, ...]:
    """Keys of the prompt's whole blocks the prefix cache may map, each naming every token up to
    its end: never the prompt's last position (verifier/engine._reusable; a prompt longer than a
    call goes in chunks, each mapping along the chain the one before held)."""
    if st.block_keys is None:
        keys, h = [], 0
        for a in range(0, (st.prompt_len - 1) // BLOCK * BLOCK, BLOCK):
            h = hash((h, tuple(st.tokens[a:a + BLOCK])))
            keys.append(h)
        st.block_keys = tuple(keys)
    return st.block_keys


@dataclass
class Held:
    """The pool's tokens as the controller counts them: shared prompt blocks once, the rest per
    request. `chunk`: the rows of a catch-up call (a longer prompt goes in chunks of it)."""

    chunk: int = 0
    blocks: set[int] = field(default_factory=set)
    own: dict[str, int] = field(default_factory=dict)  # rid -> its tokens outside the shared blocks

    @property
    def tokens(self) -> int:
        return BLOCK * len(self.blocks) + sum(self.own.values())

    def need(self, st: ReqState) -> int:
        """The tokens `st` would add at its current length (its blocks held already are mapped),
        plus one block where a call of it ends inside them: that call's last position is computed
        though a cached block holds it, whose slots the engine frees after the forward only
        (verifier/engine._register)."""
        shared = BLOCK * sum(1 for b in prompt_blocks(st) if b in self.blocks)
        return len(st.tokens) - shared + (BLOCK if self.chunk and shared >= self.chunk else 0)

    def take(self, rid: str, st: ReqState, length: int) -> None:
        """`st` held at `length` tokens, its blocks computed (a request the verifier holds)."""
        keys = prompt_blocks(st)[: length // BLOCK]
        self.blocks.update(keys)
        self.own[rid] = length - BLOCK * len(keys)

    def take_new(self, rid: str, st: ReqState) -> None:
        """`st` entering now: its own whole length (blocks computed in one forward beside an equal
        one are shared only after it), less the blocks held already, which it maps."""
        self.own[rid] = self.need(st)


class PoolMixin:
    def _pool_room(self) -> int:
        """The verifier's pool in tokens (0: not known yet, nothing is parked)."""
        f = self.verifier_facts()
        return f.pool_tokens if f else 0

    @staticmethod
    def _holds(st: ReqState) -> bool:
        """The verifier holds this request's K/V (as far as the controller knows: an eviction shows
        at its next call, which computes it again)."""
        return (st.verifier_len > 0 and not st.freed and not st.error
                and (not st.finished_at or st.audit_pending))

    def _pool_held(self) -> Held:
        held = Held(self._rows_per_call())
        for rid, st in self.reqs.items():
            if self._holds(st):
                held.take(rid, st, st.verifier_len)
        return held

    @staticmethod
    def _may_enter(st: ReqState, held: Held, room: int) -> bool:
        """A request the verifier does not hold may enter beside `held` (module doc)."""
        return (not room or not held.own or held.tokens + held.need(st) <= room
                or st.due_from is not None and st.steps - st.due_from >= DUE_PATIENCE)

    @staticmethod
    def _waits_parked(st: ReqState) -> bool:
        """A parked request's step asks for no check: not yet a held end past its patience."""
        return st.due_from is None or st.steps - st.due_from < DUE_PATIENCE

    def _park(self, rid: str, positions: list[int]) -> None:
        self.parked[rid] = self.parked.pop(rid, []) + positions

    def _someone_waits(self) -> bool:
        """A live request waits for room (those failed or ended while parked are dropped)."""
        for rid in [r for r, _ in self.parked.items() if (s := self.reqs.get(r)) is None or s.error or s.finished_at]:
            del self.parked[rid]
        return bool(self.parked)

    def _unpark(self) -> None:
        """A request left the pool: the parked checks are due again (they enter if they fit)."""
        if self.parked:
            for rid, positions in self.parked.items():
                self.checks[rid] = positions + self.checks.get(rid, [])
            self.parked = {}
            self.window_due = None

    def _check_order(self, todo: dict[str, list[int]], first: str) -> list[tuple[str, list[int]]]:
        """`first` (the finish barrier's), then the requests the verifier holds, then held ends,
        then the others, oldest first; each with its parked positions too."""
        age = {rid: k for k, rid in enumerate(self.reqs)}  # (insertion order: the oldest first)

        def rank(rid: str) -> tuple[int, int]:
            st = self.reqs.get(rid)
            if rid == first or st is None or self._holds(st):
                return (0 if rid == first else 1, 0)
            return (2 if st.due_from is not None else 3, age.get(rid, 0))

        return [(rid, self.parked.pop(rid, []) + todo[rid]) for rid in sorted(todo, key=rank)]

    def _recompute(self, it: P.VerifyItem) -> P.VerifyResult | P.ErrorReply:
        """The verifier evicted this request's shadow K/V for others' (its pool is sized to the
        deterministic load, not to every request's whole length): compute it again from position
        0, in chunks, then the item's position. The same bits as the first time: a token's K/V and
        logits depend only on the tokens before it (batch- and chunk-invariant kernels)."""
        st = self.reqs[it.rid]
        self.m.recomputes.inc()
        st.verifier_len, st.rewind, st.freed = 0, False, False
        if err := self._catch_up(it.rid, st, it.pos):
            return P.ErrorReply(code=P.ErrorCode.INTERNAL, rid=it.rid, message=err)
        (res,) = self._call_verifier([self._item(it.rid, st, it.pos)])
        return res

    def _evicted(self, rid: str, st: ReqState, positions: list[int], first: str) -> bool:
        """The verifier evicted a request it held (those it holds outgrew the pool): computed again
        from position 0 at once where it fits (False), else parked until it does (True), since
        computing it now would evict the next one; the finish barrier's request and a held end past
        its patience are computed at once."""
        if rid == first or not self._waits_parked(st):
            return False
        st.verifier_len, st.rewind, st.freed = 0, False, False
        if not (room := self._pool_room()) or self._may_enter(st, self._pool_held(), room):
            return False
        self.m.recomputes.inc()  # (computed again by its check's catch-up once it enters)
        self._park(rid, positions)
        return True

    def _free_checked_end(self, rid: str, st: ReqState) -> None:
        """A held end checked through its end: the seam finishes it at its next forward and no
        check or audit needs its K/V any more, so the pool takes the next request now."""
        if st.due_from is not None and st.checked >= st.due_from and not st.mismatches and not st.freed:
            st.freed = True
            self._release([rid])
