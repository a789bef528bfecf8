"""Window commit: a protected request rolled back in place inside SGLang's scheduler.

SGLang decodes a window request on the fast path; the controller checks its tokens behind in
windows. Where the verifier disagrees at answer index p, the seam rolls the request back at its
next forward F (the Sampler pre-hook, the one point valid in every scheduler loop mode):

1. `output_ids` keeps indices < p. Under the overlap scheduler one earlier forward's token is
   not appended yet (k = 1): `HeldOutputs` drops that append.
2. The K/V slots of positions >= O + p (O: prompt length) go back to the allocator, and the
   request's K/V counters are set to O + p, before F's result is processed: the radix tree must
   never take the discarded token's K/V under the verifier's token.
3. The batch's sequence length of the request is set to O + p at the next `prepare_for_decode`
   (before its + 1), new tensors as SGLang makes them.
4. The caller forces F's row to the verifier's token c: SGLang relays c as the next input at
   position O + p, appends it, applies its own end rules to it and streams it.

Two guards keep unverified tokens from leaving the scheduler (a rollback cannot take back what
the detokenizer has seen):
- the output hold: SGLang's stream accumulator sees only the verified prefix of a held request;
- the finish barrier: a held request that ends with unverified tokens has its tail checked at
  once (`check_tail`); on a disagreement the finish is undone and the rollback queued.
SGLang's own retraction (memory pressure) of a held request fails it loudly at its next step
(`Hold.retracted`): its re-prefill would carry unverified tokens.

Only this module changes SGLang's request and batch state; `seams.check` pins the facts it uses.
"""

from __future__ import annotations

import logging
import weakref
from array import array
from typing import Callable

import torch

log = logging.getLogger(__name__)

# Held requests (id(Req) -> Hold), installed by the seam; read by the class-level wrappers below.
# An entry lives as long as its Req: SGLang may stream a request's last output after the seam
# has reported its end, and that output must still be cut to what was checked.
_holds: dict[int, "Hold"] = {}
# Sequence lengths to install at the next prepare_for_decode: id(Req) -> O + p.
_seq_fixups: dict[int, int] = {}
_installed = False


class HeldOutputs(array):
    """A held request's `req.output_ids` (SGLang's int64 array; the scheduler appends with
    `append` at a prefill and `extend` at a decode step). `drop` > 0 discards that many next
    appends: the overlap scheduler's token of a forward sampled before the rollback."""

    def __new__(cls, items=()):
        self = super().__new__(cls, "q", items)
        self.drop = 0
        return self

    def append(self, token) -> None:
        if self.drop > 0:
            self.drop -= 1
            return
        super().append(token)

    def extend(self, tokens) -> None:
        for token in tokens:
            self.append(token)


class Hold:
    """What the seam knows of one held request: its verified answer length (the output hold and
    the finish barrier read it) and the tail check the barrier calls."""

    __slots__ = ("verified", "released", "check_tail", "lock", "retracted", "req")

    def __init__(self, check_tail: Callable[[object], tuple[int, int] | None], lock):
        self.req = None  # weakref to its Req (set by `hold`): an id() outlives nothing
        self.verified = 0  # answer tokens (not the prompt) checked by the verifier
        self.released = 0  # a stream's answer tokens that may leave unchecked (the margin gate)
        # req -> (p, c) of a disagreement, or None when all is verified; called with `lock` held
        self.check_tail = check_tail
        self.lock = lock  # the seam's: its finish watcher must not see an end the barrier undoes
        self.retracted = False  # SGLang retracted it (memory pressure): the seam fails it


def hold(req, check_tail, lock) -> Hold:
    """Start holding `req` (its first step): its outputs become `HeldOutputs`. The hold ends when
    the Req is garbage: a new Req at the same id() never finds it."""
    key, h = id(req), Hold(check_tail, lock)

    def gone(_ref, key=key, h=h):
        if _holds.get(key) is h:
            del _holds[key]

    h.req = weakref.ref(req, gone)
    _holds[key] = h
    if not isinstance(req.output_ids, HeldOutputs):
        req.output_ids = HeldOutputs(req.output_ids)
    return h


def held(req) -> Hold | None:
    """`req`'s hold, if it has one."""
    h = _holds.get(id(req))
    return h if h is not None and h.req() is req else None


def untrack(req) -> None:
    """The seam has reported `req`'s end. Its hold stays (its last output may still be streamed
    after the report: an abort's must stop at the checked prefix); a pending length fix goes."""
    _seq_fixups.pop(id(req), None)


def roll_back(req, decided: int, p: int, allocator, req_to_token) -> None:
    """Cut `req` back to answer indices < p (module doc, steps 1-3; the caller forces step 4).
    `decided`: the answer tokens the seam has decided, one more than `output_ids` holds while
    a forward's result is not processed yet (overlap)."""
    out = req.output_ids
    pending = decided - len(out)  # k: sampled, not appended yet (0 or 1)
    if not isinstance(out, HeldOutputs) or not 0 <= pending <= 1 or not 0 <= p <= len(out) + pending:
        raise RuntimeError(f"mg: cannot roll back request {req.rid!r} to {p} ({decided} decided, "
                           f"{len(out)} emitted)")
    if req.send_token_offset > p:  # the output hold makes this impossible; never rewrite what left
        raise RuntimeError(f"mg: request {req.rid!r} already sent {req.send_token_offset} tokens; "
                           f"cannot roll back to {p}")
    o = len(req.origin_input_ids)
    kv = req.kv
    if o + p < kv.cache_protected_len:
        raise RuntimeError(f"mg: rollback of {req.rid!r} to {p} reaches into its radix-cache prefix")
    del out[p:]
    out.drop = pending
    end = kv.kv_allocated_len
    if end > o + p:  # the slots of positions O+p .. end-1 (this forward's and the one in flight)
        slots = req_to_token[kv.req_pool_idx, o + p:end].clone()
        if slots.is_cuda:  # why: the allocator hands them out on the scheduler's stream, not this one
            torch.cuda.current_stream().synchronize()
        allocator.free(slots)
    kv.kv_committed_len = kv.kv_allocated_len = o + p
    _seq_fixups[id(req)] = o + p


def _prepare_for_decode(orig):
    def prepare_for_decode(self):
        if _seq_fixups:
            rows = [(i, _seq_fixups.pop(id(r))) for i, r in enumerate(self.reqs) if id(r) in _seq_fixups]
            if rows:
                # new tensors (SGLang's own rule here: a queued forward may still read the old ones)
                self.seq_lens_cpu = self.seq_lens_cpu.clone()
                for i, n in rows:
                    self.seq_lens_cpu[i] = n
                self.seq_lens = self.seq_lens_cpu.to(self.seq_lens.device, non_blocking=True).to(self.seq_lens.dtype)
                self.orig_seq_lens = self.seq_lens_cpu.to(self.orig_seq_lens.device,
                                                          non_blocking=True).to(self.orig_seq_lens.dtype)
                self.seq_lens_sum = None
        return orig(self)
    return prepare_for_decode


def _accept(orig):
    def accept(self, *, req):
        h = held(req)
        full = req.output_ids
        n = max(h.verified, h.released) if h is not None else 0
        if h is None or n >= len(full):
            return orig(self, req=req)
        if not req.finished() and n <= req.send_token_offset:
            return None  # nothing checked or released that was not sent: hold
        req.output_ids = full[:n]  # the checked or released prefix only (an abort ends here too)
        try:
            return orig(self, req=req)
        finally:
            req.output_ids = full
    return accept


def _update_finish_state(orig):
    def update_finish_state(self, *args, **kwargs):
        h = held(self)
        if h is None:
            return orig(self, *args, **kwargs)
        with h.lock:
            orig(self, *args, **kwargs)
            if not self.finished() or h.verified >= len(self.output_ids):
                return
            if type(self.finished_reason).__name__ == "FINISH_ABORT":
                return  # cut short: its verdict says so, and the hold sends only the verified prefix
            # why: a finished request is released to the radix tree and its client; a later
            # rollback could not take that back, so its tail is checked now (at most one window)
            if h.check_tail(self) is not None:
                self.finished_reason = None
                self.finished_len = None
    return update_finish_state


def _reset_for_retract(orig):
    def reset_for_retract(self):
        orig(self)
        h = held(self)
        if h is not None:  # why: its re-prefill would decode from unverified tokens (module doc)
            h.retracted = True
    return reset_for_retract


def _finishes_by_length(orig):
    def next_output_finishes_by_length(self):
        # why: the overlap loop leaves a request out of the next batch when its queued token ends
        # it by length; the finish barrier may undo that end, and the request must still decode
        return False if held(self) is not None else orig(self)
    return next_output_finishes_by_length


def install() -> None:
    """Wrap SGLang's five functions once per process (scheduler process; seams.check pinned them)."""
    global _installed
    if _installed:
        return
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.scheduler_components.output_streamer import _GenerationStreamAccumulator

    ScheduleBatch.prepare_for_decode = _prepare_for_decode(ScheduleBatch.prepare_for_decode)
    _GenerationStreamAccumulator.accept = _accept(_GenerationStreamAccumulator.accept)
    Req.update_finish_state = _update_finish_state(Req.update_finish_state)
    Req.reset_for_retract = _reset_for_retract(Req.reset_for_retract)
    Req.next_output_finishes_by_length = _finishes_by_length(Req.next_output_finishes_by_length)
    _installed = True
