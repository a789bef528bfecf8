"""The streamed decode measures of the GPU sweep (benchmarks/gpu_sweep.py) on synthetic
chunk times: the steady measure drops the wait of a held row's first check, the whole-answer
measure keeps it, and a deterministic body's verdict wait is timed from its last chunk."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from gpu_sweep import answer_ms, read_stream, steady_ms, verdict_wait_ms  # noqa: E402

NEW, STEP_MS = 64, 10.0  # a 64-token answer decoded at 10 ms a token, posted at t = 0


def test_plain_row_both_measures_give_the_step():
    points = [(k, k * STEP_MS / 1e3) for k in range(8, NEW + 1, 8)]  # a chunk every 8 tokens
    assert steady_ms(points, NEW) == pytest.approx(STEP_MS)
    assert answer_ms(points, NEW, posted=0.0) == pytest.approx(STEP_MS)


def test_held_row_steady_measure_understates_and_the_answer_measure_does_not():
    # Held until checked: the first check starts after token 33 and takes 50 ms while decoding
    # goes on, releasing tokens 1-32 at once; the rest leave after the finish barrier (20 ms).
    check_end, barrier_end = (33 * STEP_MS + 50) / 1e3, (NEW * STEP_MS + 20) / 1e3
    points = [(32, check_end)] + [(k, barrier_end) for k in range(40, NEW + 1, 8)]
    assert steady_ms(points, NEW) < 0.9 * STEP_MS  # the check's 50 ms fell out of the interval
    assert answer_ms(points, NEW, posted=0.0) > STEP_MS  # every wait counted


def test_a_short_row_is_refused():
    with pytest.raises(RuntimeError, match="streamed 56 of 64"):
        answer_ms([(56, 0.5)], NEW, posted=0.0)


class FakeStream:
    """A /generate SSE body, one network read per item."""

    def __init__(self, reads):
        self.reads = reads

    def iter_content(self, chunk_size=None):
        yield from self.reads


def test_the_verdict_wait_runs_from_the_bodys_last_chunk_to_its_verdict_event():
    reads = [b'data: {"index": 0, "meta_info": {"completion_tokens": 8}}\n',
             b'data: {"index": 1, "meta_info": {"completion_tokens": 8}}\ndata: {"index": 1, "meta_info": '
             b'{"completion_tokens": 16}}\n',
             b'data: {"index": 0, "meta_info": {"completion_tokens": 16}}\n',
             b'data: {"mg_verdict": {"states": ["verified", "verified"]}}\n', b"data: [DONE]\n"]
    times = iter([0.10, 0.25, 0.30, 0.38, 0.39])
    marks = {}
    points, states = read_stream(FakeStream(reads), clock=lambda: next(times), marks=marks)
    assert points == {0: [(8, 0.10), (16, 0.30)], 1: [(8, 0.25), (16, 0.25)]} and states == ["verified"] * 2
    assert verdict_wait_ms(points, marks) == pytest.approx(80.0)  # 0.38 - 0.30: row 0 ended last
    with pytest.raises(RuntimeError, match="without its verdict"):
        verdict_wait_ms(points, {})
