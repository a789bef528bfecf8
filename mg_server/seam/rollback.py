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
- the held end: a held request that ends with unverified tokens stays unfinished (`Hold.end`);
  SGLang decodes it on (a surplus nobody sees) while the controller checks the end beside its
  forwards; once the tokens up to the end are checked it finishes with `finished_len` at the end
  (SGLang's own rule for a speculative overshoot: the client gets the tokens through the stop,
  the release frees the K/V past it). A disagreement before the end voids the end (the rollback
  applies; SGLang's rules end the request again later); one in the surplus is moot.
  An answer that finishes with its every token checked (a held end once checked, after the
  barrier, or one checked before its end) is reported to the controller at once from the
  scheduler thread (`Hold.on_end`).
- the finish barrier, where a held end cannot be used (no lagged path, i.e. a CPU host: the
  verifier shares SGLang's cores; past SURPLUS_MAX tokens; near the sequence limit; a forward of
  held ends only, where the surplus would only slow the check): the tail is checked at once
  (`check_tail`, blocking the scheduler); on a disagreement the finish is undone and the
  rollback queued.
SGLang's own retraction (memory pressure) of a held request fails it loudly at its next step
(`Hold.retracted`): its re-prefill would carry unverified tokens.

Only this module changes SGLang's request and batch state; `sglang_facts.check` pins the facts it uses.
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
# Held ends (module doc): on only with the lagged control path (it sets these at attach).
hold_ends = False
seq_limit = 0  # tokens a request may reach (prompt + answer): SGLang's context, its req_to_token width
SURPLUS_MAX = 64  # a held end's surplus tokens before the barrier checks it instead
only_ends = False  # the last launched forward carried held ends only (set by the seam's hook)
ranks = None  # SGLang's TP ranks (seam/ranks.py), set by the seam under TP: the finish rules agree


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

    __slots__ = ("verified", "released", "check_tail", "lock", "retracted", "req", "end", "on_end")

    def __init__(self, check_tail: Callable[[object], tuple[int, int] | None], lock,
                 on_end: Callable[[object, int], None] | None = None):
        self.req = None  # weakref to its Req (set by `hold`): an id() outlives nothing
        self.verified = 0  # answer tokens (not the prompt) checked by the verifier
        self.released = 0  # a stream's answer tokens that may leave unchecked (the margin gate)
        # (req, upto) -> (p, c) of a disagreement before answer index `upto`, or None when the
        # first `upto` tokens are verified; called with `lock` held
        self.check_tail = check_tail
        self.lock = lock  # the seam's: its finish watcher must not see an end the barrier undoes
        self.retracted = False  # SGLang retracted it (memory pressure): the seam fails it
        self.end = None  # a held end: (answer length, finished_reason) SGLang gave it
        # (req, answer length) -> None, called with `lock` held once the request has finished with
        # its every answer token checked: its end is reported from the scheduler thread (seam/news.py)
        self.on_end = on_end

    def shown(self) -> int:
        """Answer tokens the output hold lets SGLang stream: checked or released, never past a held end."""
        n = max(self.verified, self.released)
        return n if self.end is None else min(n, self.end[0])

    def moot(self, index: int, end: int | None = None) -> bool:
        """A rollback at answer index `index` is moot if it lies at or past the answer's end
        (`end`, default a held end's): the tokens before it agree, so they count as verified."""
        end = end if end is not None else (self.end[0] if self.end is not None else None)
        if end is None or index < end:
            return False
        self.verified = max(self.verified, index)
        return True


def hold(req, check_tail, lock, on_end=None) -> Hold:
    """Start holding `req` (its first step): its outputs become `HeldOutputs`. The hold ends when
    the Req is garbage: a new Req at the same id() never finds it."""
    key, h = id(req), Hold(check_tail, lock, on_end)

    def gone(_ref, key=key, h=h):
        if _holds.get(key) is h:
            del _holds[key]
            _seq_fixups.pop(key, None)  # (a TP follower reports no end to untrack it by)

    h.req = weakref.ref(req, gone)
    _holds[key] = h
    if not isinstance(req.output_ids, HeldOutputs):
        req.output_ids = HeldOutputs(req.output_ids)
    return h


def held(req) -> Hold | None:
    """`req`'s hold, if it has one."""
    h = _holds.get(id(req))
    return h if h is not None and h.req() is req else None


def note_forward(batch_size: int, rows) -> None:
    """The seam's hook at each sampler call: whether this forward carries held ends only."""
    global only_ends
    only_ends = 0 < len(rows) == batch_size and all(
        (h := held(req)) is not None and h.end is not None for _, req, _ in rows)


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
        n = h.shown() if h is not None else 0
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
            ended_before = self.finished()
            orig(self, *args, **kwargs)
            if type(self.finished_reason).__name__ == "FINISH_ABORT":
                return  # cut short: its verdict says so, and the hold sends only the verified prefix
            if ranks is not None and (h.end is not None or self.finished()):
                return _agree_finish(self, h, ended_before, ranks)  # (every rank reads the same here)
            _finish_rules(self, h, ended_before)
    return update_finish_state


def _agree_finish(req, h: Hold, ended_before: bool, ranks) -> None:
    """Under TP (seam/ranks.py): rank 0 applies mg's finish rules and every other rank takes its
    outcome (a follower's hold lags rank 0's checked length, and only rank 0 can check a tail)."""
    if ranks.leader:
        _finish_rules(req, h, ended_before)
        ranks.share((req.finished_reason, req.finished_len, req.to_finish, h.verified, h.released, h.end))
    else:
        req.finished_reason, req.finished_len, req.to_finish, h.verified, h.released, h.end = ranks.share(None)


def _finish_rules(req, h: Hold, ended_before: bool) -> None:
    """mg's finish rules of a held request SGLang has just stepped (module doc)."""
    if h.end is not None:  # a held end: what SGLang decides about the surplus is moot
        _held_end(req, h)
    elif req.finished() and h.verified < len(req.output_ids):
        # why: a finished request is released to the radix tree and its client; a later
        # rollback could not take that back, so its tail is checked first
        n = _answer_len(req)
        if hold_ends and _may_hold(req, h) and not only_ends:
            h.end = (n, req.finished_reason)  # checked beside SGLang's forwards instead
            req.finished_reason = req.finished_len = None
        elif h.check_tail(req, n) is not None:
            req.finished_reason = req.finished_len = None
    if not ended_before:
        _checked_end(req, h)


def _checked_end(req, h: Hold) -> None:
    """A request that has just finished with every answer token checked: its end is reported now,
    from this (the scheduler's) thread. Why not by the finish watcher alone: that thread waits
    for the GIL behind the scheduler's, 50-100 ms at times on a GPU host, and the answer's
    verdict waits for the end's report."""
    if h.on_end is None or not req.finished() or type(req.finished_reason).__name__ == "FINISH_ABORT":
        return
    n = _answer_len(req)
    if h.verified >= n:
        h.on_end(req, n)


def _answer_len(req) -> int:
    """A finished request's answer through its stop (SGLang's finished_len, else every output)."""
    return req.finished_len if req.finished_len is not None else len(req.output_ids)


def _may_hold(req, h: Hold) -> bool:
    """Whether a held end may decode on: within SURPLUS_MAX tokens past it and the sequence limit."""
    surplus = len(req.output_ids) - (h.end[0] if h.end is not None else len(req.output_ids))
    return surplus < SURPLUS_MAX and len(req.origin_input_ids) + len(req.output_ids) + 2 < seq_limit


def _held_end(req, h: Hold) -> None:
    """A held end at a later step: finish once its tokens are checked; check them now where it
    may not decode on (module doc); else leave it unfinished."""
    n, reason = h.end
    req.finished_reason = req.finished_len = None
    if h.verified < n and (only_ends or not _may_hold(req, h)):
        if h.check_tail(req, n) is not None:
            h.end = None  # a disagreement before the end: the rollback voids it
            return
    if h.verified >= n:
        req.finished_reason, req.finished_len = reason, n


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
        # it by length; a held end or the finish barrier may undo that end, and the request must still decode
        return False if held(self) is not None else orig(self)
    return next_output_finishes_by_length


def _running_offset(orig):
    def offset(self, req):
        own, h = orig(self, req), held(req)
        if h is None:
            return own
        # why: SGLang's admission counts max_new_tokens - len(output_ids) tokens still to come for
        # a running request, negative for a held length end (its surplus), which would admit more
        # than fits and retract (a retracted held request fails); a held end decodes at most
        # SURPLUS_MAX tokens past its end before its tail is checked and it finishes
        if h.end is not None:
            return max(own, SURPLUS_MAX - (len(req.output_ids) - h.end[0]), 0)
        # an end voided by a flip keeps its surplus until the rollback applies at the next
        # forward; after it, at most the unverified part is decoded again
        return own if own >= 0 else max(req.sampling_params.max_new_tokens - h.verified, 0)
    return offset


def install() -> None:
    """Wrap SGLang's six functions once per process (scheduler process; sglang_facts.check pinned them)."""
    global _installed
    if _installed:
        return
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.managers.scheduler_components.output_streamer import _GenerationStreamAccumulator

    ScheduleBatch.prepare_for_decode = _prepare_for_decode(ScheduleBatch.prepare_for_decode)
    _GenerationStreamAccumulator.accept = _accept(_GenerationStreamAccumulator.accept)
    Req.update_finish_state = _update_finish_state(Req.update_finish_state)
    Req.reset_for_retract = _reset_for_retract(Req.reset_for_retract)
    Req.next_output_finishes_by_length = _finishes_by_length(Req.next_output_finishes_by_length)
    PrefillAdder._get_running_request_total_token_offset = _running_offset(
        PrefillAdder._get_running_request_total_token_offset)
    _installed = True
