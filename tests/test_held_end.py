"""The held end (seam/rollback.py): a deterministic request that SGLang ends with unchecked tokens
stays unfinished while they are checked, decodes a surplus nobody sees, and finishes at its end
once checked; the barrier takes over where it may not decode on. A stand-in Req with SGLang's
finish rules (length, stop token, abort); no server."""

import gc
import threading
from types import SimpleNamespace

import pytest

from mg_server.seam import rollback


class FINISH_LENGTH:  # noqa: N801 - SGLang's class names are what the seam reads
    pass


class FINISH_MATCHED_TOKEN:  # noqa: N801
    pass


class FINISH_ABORT:  # noqa: N801
    message = "client went away"


class Req:
    """SGLang's Req, as far as its finish rules and output go (schedule_batch.Req)."""

    def __init__(self, max_new=4, eos=None):
        self.origin_input_ids = [1, 2, 3]
        self.output_ids = []
        self.max_new, self.eos = max_new, eos
        self.finished_reason = self.finished_len = self.to_finish = None
        self.send_token_offset = 0

    def finished(self):
        return self.finished_reason is not None

    @property
    def sampling_params(self):
        return SimpleNamespace(max_new_tokens=self.max_new)

    def update_finish_state(self):  # SGLang's rules, in its order
        if self.finished():
            return
        if self.to_finish:
            self.finished_reason, self.to_finish = self.to_finish, None
            return
        if self.output_ids[-1] == self.eos:
            self.finished_reason, self.finished_len = FINISH_MATCHED_TOKEN(), len(self.output_ids)
            return
        if len(self.output_ids) >= self.max_new:
            self.finished_reason, self.finished_len = FINISH_LENGTH(), self.max_new


class Seam:
    """The seam's side: the news (verified lengths, rollbacks) and the barrier's calls."""

    def __init__(self):
        self.barrier_calls = []  # upto of each check_tail
        self.barrier_answer = None  # (p, c) to return, or None with `verified` set
        self.barrier_verified = 0

    def check_tail(self, req, upto):
        self.barrier_calls.append(upto)
        h = rollback.held(req)
        if self.barrier_answer is not None:
            return self.barrier_answer
        h.verified = max(h.verified, self.barrier_verified)
        return None


@pytest.fixture
def held(monkeypatch):
    monkeypatch.setattr(rollback, "hold_ends", True)
    monkeypatch.setattr(rollback, "seq_limit", 1000)
    monkeypatch.setattr(rollback, "only_ends", False)
    update = rollback._update_finish_state(Req.update_finish_state)
    seam = Seam()

    def make(**kw):
        req = Req(**kw)
        rollback.hold(req, seam.check_tail, threading.Lock())
        return req

    def step(req, *tokens):  # SGLang's decode steps: append each token, apply its finish rules
        for token in tokens:
            req.output_ids.append(token)
            update(req)

    return make, step, seam


def shown(req):
    """What SGLang's stream accumulator would send now (output_ids_through_stop past the offset)."""
    sent = []

    def orig(self, *, req):
        out = req.output_ids if req.finished_len is None else req.output_ids[:req.finished_len]
        sent.append(list(out[req.send_token_offset:]))
        req.send_token_offset = len(out)

    rollback._accept(orig)(None, req=req)
    return sent[0] if sent else None


def test_a_length_end_with_unchecked_tokens_decodes_on_unseen_and_finishes_at_its_end_once_checked(held):
    make, step, seam = held
    req = make(max_new=4)
    h = rollback.held(req)
    step(req, 10, 11, 12, 13)
    h.verified = 2  # tokens 12 and 13 unchecked at the end
    step_end = h.end
    assert not req.finished() and step_end[0] == 4 and isinstance(step_end[1], FINISH_LENGTH)
    assert seam.barrier_calls == []  # SGLang was not blocked
    assert shown(req) == [10, 11]
    step(req, 14)  # the surplus: past max_new, SGLang's rule would end it again; still held
    step(req, 15)
    assert not req.finished() and shown(req) is None  # nothing new checked: nothing sent
    h.verified = 6  # the check reached the surplus
    step(req, 16)
    assert req.finished() and isinstance(req.finished_reason, FINISH_LENGTH) and req.finished_len == 4
    assert shown(req) == [12, 13]  # the answer, never the surplus


def test_a_stop_token_end_keeps_its_reason_and_length(held):
    make, step, seam = held
    req = make(max_new=50, eos=99)
    h = rollback.held(req)
    step(req, 10, 99)
    assert h.end is not None and not req.finished()
    step(req, 99)  # a surplus stop token changes nothing
    assert h.end[0] == 2
    h.verified = 2
    step(req, 20)
    assert isinstance(req.finished_reason, FINISH_MATCHED_TOKEN) and req.finished_len == 2


def test_a_rollback_past_the_end_is_moot_and_one_before_it_voids_the_end(held):
    make, step, seam = held
    req = make(max_new=3)
    h = rollback.held(req)
    step(req, 10, 11, 12)
    assert h.end is not None
    assert not h.moot(1)  # before the end: a real rollback (the seam applies it, voiding the end)
    assert h.moot(4) and h.verified == 4  # in the surplus: the tokens before it agree
    step(req, 13)
    assert req.finished() and req.finished_len == 3


def test_the_barrier_checks_a_held_end_past_the_surplus_limit(held, monkeypatch):
    make, step, seam = held
    monkeypatch.setattr(rollback, "SURPLUS_MAX", 2)
    req = make(max_new=2)
    step(req, 10, 11)
    step(req, 12)
    assert seam.barrier_calls == [] and not req.finished()
    seam.barrier_verified = 2
    step(req, 13)  # the second surplus token: decoding on is over, the barrier checks the end
    assert seam.barrier_calls == [2] and req.finished() and req.finished_len == 2


def test_the_barrier_checks_at_once_where_a_held_end_may_not_decode_on(held, monkeypatch):
    make, step, seam = held
    seam.barrier_verified = 3
    monkeypatch.setattr(rollback, "only_ends", True)  # the last forward held ends only
    req = make(max_new=3)
    step(req, 10, 11, 12)
    assert seam.barrier_calls == [3] and req.finished() and rollback.held(req).end is None
    monkeypatch.setattr(rollback, "only_ends", False)
    monkeypatch.setattr(rollback, "hold_ends", False)  # no lagged path (a CPU host)
    req = make(max_new=2)
    step(req, 10, 11)
    assert seam.barrier_calls == [3, 2] and req.finished()
    monkeypatch.setattr(rollback, "hold_ends", True)
    monkeypatch.setattr(rollback, "seq_limit", 6)  # near the sequence limit
    req = make(max_new=2)
    step(req, 10, 11)
    assert seam.barrier_calls == [3, 2, 2] and req.finished()


def test_the_barrier_finding_a_flip_before_a_held_end_voids_it(held, monkeypatch):
    make, step, seam = held
    monkeypatch.setattr(rollback, "SURPLUS_MAX", 1)
    req = make(max_new=3)
    h = rollback.held(req)
    step(req, 10, 11, 12)
    seam.barrier_answer = (1, 77)
    step(req, 13)
    assert h.end is None and not req.finished()  # the rollback applies at the next forward


def test_an_end_is_reported_once_the_moment_the_request_finishes_with_its_answer_checked(held, monkeypatch):
    """Reported from the finishing (scheduler) thread, not when the finish watcher next runs: never
    while an end is held, a flip voided it or the request was cut short, and once only."""
    make, step, seam = held
    ends = []

    def make_reported(**kw):
        req = make(**kw)
        rollback.held(req).on_end = lambda r, n: ends.append((r, n))
        return req

    req = make_reported(max_new=3)  # a held end: reported when its check reaches the end
    h = rollback.held(req)
    step(req, 10, 11, 12, 13)
    h.verified = 2
    step(req, 14)
    assert ends == [] and not req.finished()
    h.verified = 5
    step(req, 15)
    assert ends == [(req, 3)] and req.finished_len == 3
    step(req, 16)  # SGLang's rules run again on a finished request: not a second report
    assert ends == [(req, 3)]
    ends.clear()
    checked = make_reported(max_new=2)  # every token checked before its end: reported at the end
    rollback.held(checked).verified = 2
    step(checked, 10, 11)
    assert ends == [(checked, 2)]
    ends.clear()
    monkeypatch.setattr(rollback, "only_ends", True)  # the barrier: reported once it checked the end
    seam.barrier_verified = 2
    barrier = make_reported(max_new=2)
    step(barrier, 10, 11)
    assert ends == [(barrier, 2)] and barrier.finished()
    ends.clear()
    seam.barrier_answer = (0, 77)  # the barrier found a flip: not finished, nothing reported
    flipped = make_reported(max_new=2)
    step(flipped, 10, 11)
    assert ends == [] and not flipped.finished()
    seam.barrier_answer = None
    cut = make_reported(max_new=5)  # cut short: the finish watcher reports it
    step(cut, 10)
    cut.to_finish = FINISH_ABORT()
    step(cut, 11)
    assert ends == [] and isinstance(cut.finished_reason, FINISH_ABORT)


def test_an_abort_during_a_held_end_stands_and_shows_only_the_checked_tokens(held):
    make, step, seam = held
    req = make(max_new=3)
    h = rollback.held(req)
    step(req, 10, 11, 12)
    h.verified = 1
    req.to_finish = FINISH_ABORT()
    step(req, 13)
    assert isinstance(req.finished_reason, FINISH_ABORT)
    assert shown(req) == [10]


def test_a_hold_outlives_nothing_but_its_request(held):
    make, _, _ = held
    req = make()
    key = id(req)
    assert rollback.held(req) is not None and rollback.held(Req()) is None
    del req
    gc.collect()
    assert key not in rollback._holds


def test_note_forward_says_when_a_forward_carries_held_ends_only(held):
    make, step, _ = held
    a, b = make(max_new=1), make(max_new=5)
    step(a, 10)
    step(b, 10)
    assert rollback.held(a).end is not None and rollback.held(b).end is None
    rollback.note_forward(1, [(0, a, "a")])
    assert rollback.only_ends
    rollback.note_forward(2, [(0, a, "a"), (1, b, "b")])
    assert not rollback.only_ends
    rollback.note_forward(2, [(0, a, "a")])  # a plain row beside it
    assert not rollback.only_ends


def test_a_held_end_reserves_what_it_may_still_decode_in_sglangs_admission(held):
    """SGLang's admission counts max_new_tokens - len(output_ids) tokens still to come for each
    running request: negative for a held length end's surplus. The seam counts what the end may
    still decode instead (SURPLUS_MAX past it), never less than SGLang's own count."""
    make, step, seam = held

    def sglangs(adder, req):  # PrefillAdder._get_running_request_total_token_offset, ratio 1
        return req.max_new - len(req.output_ids)

    offset = rollback._running_offset(sglangs)
    req = make(max_new=4)
    step(req, 10, 11)
    assert offset(None, req) == 2  # held, no end yet: SGLang's own count
    step(req, 12, 13, 14, 15)  # ends at 4 unchecked, then two surplus tokens
    assert rollback.held(req).end[0] == 4 and sglangs(None, req) == -2
    assert offset(None, req) == rollback.SURPLUS_MAX - 2
    stop = make(max_new=50, eos=99)
    step(stop, 10, 99)  # a stop-token end far below max_new: its surplus may pass max_new
    assert offset(None, stop) == max(48, rollback.SURPLUS_MAX)
    plain = Req(max_new=4)
    plain.output_ids = [5, 6, 7, 8, 9]
    assert offset(None, plain) == -1  # a request mg does not hold: untouched


def test_a_voided_held_end_reserves_what_may_be_decoded_again(held):
    """The barrier finds a flip before a held end: the end is void, but the surplus stays in
    output_ids until the rollback applies at the next forward. Meanwhile the request reserves
    what follows its verified prefix, never SGLang's negative count."""
    make, step, seam = held
    offset = rollback._running_offset(lambda adder, req: req.max_new - len(req.output_ids))
    req = make(max_new=4)
    step(req, 10, 11, 12, 13)  # held end at 4, one token checked
    h = rollback.held(req)
    h.verified = 1
    step(req, *range(20, 20 + rollback.SURPLUS_MAX))  # the surplus reaches its limit: the barrier checks
    seam.barrier_answer = (2, 77)
    step(req, 99)
    assert h.end is None and seam.barrier_calls  # voided by the flip at answer index 2
    assert offset(None, req) == 4 - 1  # max_new - verified, not 4 - len(output_ids)
