"""Measure SGLang's fast path against the verifier-alone reference, through HTTP.

Each batch is ONE batched `/generate` (all rows enter the scheduler together), greedy, with
`ignore_eos`, `return_logprob` and `top_logprobs_num`. SGLang's greedy sampler takes the argmax
of the logits and, when logprobs are asked for, their log_softmax in fp32 (`layers/sampler.py`),
so top-1 minus top-2 logprob is the top-1/top-2 logit margin that mg's seam computes. Only
output logprobs are requested (no `logprob_start_len`), so the prefill still computes logits
for the last position only and the forward is unchanged (tested: the emitted tokens are the
same with and without logprobs).

Rollback: a row whose token differs from the reference at position q (a flip) is resumed in a
later round from the prompt plus the reference's first q+1 tokens, inside a new batch of the
same size. Every position of every sequence is then a synchronous step (prefix equal to the
reference's), as if each flip had been repaired (mg repairs the flipped K/V column; rollback
recomputes the prefix on the fast path, the paper prototype's "restart-from-rollback").
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import requests


TOP_N = 3  # top-2 gives the margin; a third entry finds the emitted token in a tie of 3


class MeasurementError(RuntimeError):
    """The server's answer cannot be read as a greedy decode with top-2 logprobs."""


@dataclass
class Trace:
    """One prompt decoded at one batch size; lists are [max_tokens], one entry per position."""

    prompt: int  # index into the prompt set
    batch_size: int
    margins: list[float] = field(default_factory=list)  # fast path's top-1 - top-2 logit margin
    flips: list[bool] = field(default_factory=list)  # fast path's token != the reference's
    fast_tokens: list[int] = field(default_factory=list)  # fast path's top-1 token
    second_tokens: list[int] = field(default_factory=list)  # fast path's top-2 token
    rounds: int = 0  # batched requests this prompt took part in (1 + rollbacks)

    def to_json(self) -> dict:
        return {"prompt": self.prompt, "batch_size": self.batch_size, "margins": self.margins,
                "flips": [int(f) for f in self.flips], "fast_tokens": self.fast_tokens,
                "second_tokens": self.second_tokens, "rounds": self.rounds}

    @classmethod
    def from_json(cls, d: dict) -> "Trace":
        return cls(d["prompt"], d["batch_size"], [float(m) for m in d["margins"]], [bool(f) for f in d["flips"]],
                   list(d["fast_tokens"]), list(d["second_tokens"]), d["rounds"])


@dataclass(frozen=True)
class Row:
    tokens: list[int]  # [n] emitted tokens
    margins: list[float]  # [n] top-1 - top-2 logprob (= logit margin)
    seconds: list[int]  # [n] runner-up tokens


def generate_rows(url: str, rows: list[list[int]], max_new: int, timeout_s: float) -> list[Row]:
    """One batched greedy /generate of token prompts with top-2 logprobs per output token."""
    body = {
        "input_ids": rows,
        "sampling_params": [{"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}] * len(rows),
        "return_logprob": True,
        "top_logprobs_num": TOP_N,
    }
    r = requests.post(url + "/generate", json=body, timeout=timeout_s)
    if r.status_code != 200:
        raise MeasurementError(f"/generate answered {r.status_code}: {r.text[:500]}")
    out = r.json()
    if not isinstance(out, list) or len(out) != len(rows):
        raise MeasurementError(f"/generate returned {type(out).__name__} for {len(rows)} rows")
    return [_row(o, max_new) for o in out]


def logprobs_neutral(url: str, rows: list[list[int]], max_new: int, timeout_s: float) -> dict:
    """The same batch without logprobs: its tokens must equal the measured ones, or the margins
    were read from a different computation than the one being calibrated."""
    body = {"input_ids": rows,
            "sampling_params": [{"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}] * len(rows)}
    r = requests.post(url + "/generate", json=body, timeout=timeout_s)
    if r.status_code != 200:
        raise MeasurementError(f"/generate answered {r.status_code}: {r.text[:500]}")
    plain = [o["output_ids"] for o in r.json()]
    with_lp = [row.tokens for row in generate_rows(url, rows, max_new, timeout_s)]
    differ = [i for i, (a, b) in enumerate(zip(plain, with_lp)) if a != b]
    if differ:
        raise MeasurementError(f"asking for logprobs changed the tokens of rows {differ}: margins would not "
                               "describe the plain fast path")
    return {"rows": len(rows), "tokens": max_new, "equal": True}


def _row(o: dict, max_new: int) -> Row:
    ids, top = o["output_ids"], o["meta_info"]["output_top_logprobs"]
    if len(ids) != max_new or len(top) != max_new:
        raise MeasurementError(f"asked for {max_new} tokens, got {len(ids)} tokens and {len(top)} logprob rows")
    margins, seconds = [], []
    for t, (tok, cand) in enumerate(zip(ids, top)):
        lps = {int(c[1]): float(c[0]) for c in cand}
        best = max(lps.values())
        # greedy: the emitted token has the top logprob of the same logits. At a tie argmax takes
        # the lower id while the top-k list may put either first, so look it up by id.
        if lps.get(tok) != best:
            raise MeasurementError(f"position {t}: emitted token {tok} is not a top-1 of {cand}; not greedy?")
        runner = max((i for i in lps if i != tok), key=lambda i: lps[i])
        margins.append(_snap(best - lps[runner]))
        seconds.append(runner)
    return Row(list(ids), margins, seconds)


def _snap(margin: float) -> float:
    """The logit margin from two fp32 logprobs: (l1 - lse) - (l2 - lse) carries ~1e-7 of rounding.
    With bf16 logits the true margin is a difference of two bf16 values, a multiple of 2^-16
    whenever the top logits exceed 2^-9 in size; snapping recovers it exactly, so a step sits on
    the same side of a tau as in mg's seam (strict comparison; margins are discrete)."""
    return round(margin * 65536) / 65536


def measure(url: str, prompts: list[list[int]], refs: list[list[int]], batch_size: int, max_tokens: int,
            timeout_s: float, progress=lambda n: None) -> list[Trace]:
    """Every position of every prompt on the fast path at `batch_size`, against `refs` (the
    reference's first max_tokens tokens of each prompt). `progress(n)` gets positions measured."""
    if any(len(r) < max_tokens for r in refs):
        raise ValueError("every reference needs max_tokens tokens")
    traces = [Trace(i, batch_size, [math.nan] * max_tokens, [False] * max_tokens, [-1] * max_tokens,
                    [-1] * max_tokens) for i in range(len(prompts))]
    pending = [(i, 0) for i in range(len(prompts))]  # (prompt, first position to measure)
    while pending:
        resumed = []
        for g in range(0, len(pending), batch_size):
            group = pending[g:g + batch_size]
            rows = [prompts[i] + refs[i][:start] for i, start in group]
            max_new = max(max_tokens - start for _, start in group)
            rows += [prompts[j] for j in _neighbours([i for i, _ in group], len(prompts), batch_size - len(group))]
            for (i, start), row in zip(group, generate_rows(url, rows, max_new, timeout_s)):
                tr = traces[i]
                tr.rounds += 1
                n = max_tokens - start
                for k in range(n):
                    pos = start + k
                    tr.margins[pos], tr.fast_tokens[pos] = row.margins[k], row.tokens[k]
                    tr.second_tokens[pos] = row.seconds[k]
                    if row.tokens[k] != refs[i][pos]:
                        tr.flips[pos] = True
                        n = k + 1
                        if pos + 1 < max_tokens:  # resume on the reference's prefix (rollback)
                            resumed.append((i, pos + 1))
                        break
                progress(n)
        pending = resumed
    return traces


def _neighbours(members: list[int], n_prompts: int, count: int) -> list[int]:
    """`count` other prompts of the set (unmeasured rows that fill a batch to its size), cycling
    from after the group's last member; a set smaller than the batch repeats prompts."""
    out, j = [], max(members) + 1
    others = [k for k in range(n_prompts) if k not in members] or list(range(n_prompts))
    start = next((x for x, k in enumerate(others) if k >= j), 0)
    for x in range(count):
        out.append(others[(start + x) % len(others)])
    return out
