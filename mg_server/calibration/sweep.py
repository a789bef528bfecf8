"""Statistics of a calibration: flip rates, the tau sweep, the chosen tau and its transfer.

Pure functions over measured steps (numpy only). A step is triggered at tau when
`not margin >= tau`, exactly `mg_server.policy.Policy.should_verify` in mode margin (strict, and a
NaN margin is verified).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Sweep points (logit units) besides the data's own: SGLang's bf16 logits make margins
# multiples of small powers of two, so the grid sits on values margins actually take.
BASE_GRID = (0.0, 1 / 32, 1 / 16, 1 / 8, 3 / 16, 1 / 4, 3 / 8, 1 / 2, 5 / 8, 3 / 4, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0,
             8.0, 16.0)


@dataclass
class SetData:
    """One prompt set's measurements."""

    name: str
    source: str
    prompts: list[list[int]]  # [K][prompt_len] chat-templated token ids
    refs: list[list[int]]  # [K][max_tokens] the verifier-alone answer
    ref_margins: list[list[float]]  # [K][max_tokens] the verifier's margin at each position
    traces: dict  # batch size -> [fastpath.Trace per prompt]


@dataclass(frozen=True)
class Steps:
    """Every measured step of one prompt set, flattened; all arrays are [S]."""

    margin: np.ndarray  # float64: the fast path's top-1/top-2 logit margin
    flip: np.ndarray  # bool: the fast path's token differs from the reference's
    ref_margin: np.ndarray  # float64: the verifier-alone reference's margin at the same position
    seq: np.ndarray  # int64: sequence id (one per prompt and batch size)
    batch_size: np.ndarray  # int64
    prompt: np.ndarray  # int64: index in the prompt set
    pos: np.ndarray  # int64: generated-token position

    @property
    def n_seq(self) -> int:
        return int(self.seq.max()) + 1 if len(self.seq) else 0


def flatten(traces: dict[int, list], ref_margins: list[list[float]]) -> Steps:
    """traces: batch size -> [fastpath.Trace per prompt]; ref_margins: [K][max_tokens]."""
    cols: dict[str, list] = {k: [] for k in ("margin", "flip", "ref_margin", "seq", "batch_size", "prompt", "pos")}
    seq = 0
    for bs in sorted(traces):
        for tr in traces[bs]:
            n = len(tr.margins)
            cols["margin"] += tr.margins
            cols["flip"] += tr.flips
            cols["ref_margin"] += ref_margins[tr.prompt][:n]
            cols["seq"] += [seq] * n
            cols["batch_size"] += [bs] * n
            cols["prompt"] += [tr.prompt] * n
            cols["pos"] += list(range(n))
            seq += 1
    types = {"margin": np.float64, "flip": bool, "ref_margin": np.float64}
    return Steps(**{k: np.asarray(v, dtype=types.get(k, np.int64)) for k, v in cols.items()})


def triggered(margin: np.ndarray, tau: float) -> np.ndarray:
    return ~(margin >= tau)  # Policy.should_verify: strict, NaN verified


def at_tau(steps: Steps, tau: float) -> dict:
    """Trigger rate (of all steps), flip recall (of flips) and sequence determinism (sequences
    all of whose flips are triggered) at one tau."""
    trig = triggered(steps.margin, tau)
    flips = steps.flip
    caught = trig & flips
    missed_seqs = np.unique(steps.seq[flips & ~trig])
    n_flips = int(flips.sum())
    return {
        "tau": tau,
        "trigger": float(trig.mean()) if len(trig) else 0.0,
        "recall": float(caught.sum() / n_flips) if n_flips else 1.0,
        "determinism": (steps.n_seq - len(missed_seqs)) / steps.n_seq if steps.n_seq else 1.0,
        "missed_flips": n_flips - int(caught.sum()),
    }


def sweep(steps: Steps, taus) -> list[dict]:
    return [at_tau(steps, t) for t in sorted(set(taus))]


def by_batch_size(steps: Steps) -> dict[str, dict]:
    """Flip rate per batch size: flips / synchronous steps (every step is synchronous here)."""
    out = {}
    for bs in sorted(set(steps.batch_size.tolist())):
        sel = steps.batch_size == bs
        seqs = np.unique(steps.seq[sel])
        flipped = np.unique(steps.seq[sel & steps.flip])
        out[str(bs)] = {"steps": int(sel.sum()), "flips": int(steps.flip[sel].sum()),
                        "flip_rate": float(steps.flip[sel].mean()), "sequences": len(seqs),
                        "sequences_with_flips": len(flipped)}
    return out


def max_flip_margin(steps: Steps) -> float:
    """The largest margin at which a flip was seen (-inf without flips; NaN margins are always
    verified, so they do not count)."""
    m = steps.margin[steps.flip]
    m = m[~np.isnan(m)]
    return float(m.max()) if len(m) else -math.inf


def tau100(steps: Steps) -> float:
    """The smallest swept tau with 100 % flip recall (paper §4.3: the smallest tested threshold):
    the first BASE_GRID point above the largest flip margin, since the trigger is strict
    (margin < tau); 0 without flips. Above the grid: the next power of two."""
    m_star = max_flip_margin(steps)
    if m_star == -math.inf:
        return 0.0
    above = [t for t in BASE_GRID if t > m_star]
    return above[0] if above else 2.0 ** (math.floor(math.log2(m_star)) + 1)


def margin_shift(steps: Steps) -> np.ndarray:
    """|fast margin - reference margin| at steps whose tokens agree: how far batching moved the
    margin. A flip at fast margin m needs the same kind of shift, at least m, of the pair it swaps."""
    ok = ~steps.flip & ~np.isnan(steps.margin) & ~np.isnan(steps.ref_margin)
    return np.abs(steps.margin[ok] - steps.ref_margin[ok])


def quantiles(x: np.ndarray, qs=(0.5, 0.9, 0.99, 0.999, 1.0)) -> dict[str, float]:
    if not len(x):
        return {}
    return {f"p{q * 100:g}" if q < 1 else "max": float(np.quantile(x, q)) for q in qs}


# Steps whose reference margin is below this many logits are the near ties, where a flip can
# happen (every flip seen on CPU and GPU had a reference margin <= 0.25): their margin shifts
# bound how far above tau100 a flip could still fall.
NEAR_TIE = 1.0
TAU_STEP = 64  # the chosen tau is rounded up to a multiple of 1/64 logit


def near_tie_shift(steps: Steps) -> np.ndarray:
    """Margin shifts (see margin_shift) at stable steps whose reference margin is a near tie."""
    ok = ~steps.flip & ~np.isnan(steps.margin) & (steps.ref_margin < NEAR_TIE)
    return np.abs(steps.margin[ok] - steps.ref_margin[ok])


def choose_tau(steps: Steps, safety_factor: float | None = None) -> dict:
    """tau = tau100 x safety factor. Derived (safety_factor None): a flip at fast margin m needs
    the pair of tokens it swaps to move by at least m between the fast path and the reference,
    so tau is raised to the largest margin shift D seen at any stable near-tie step:
    safety = max(1, D / tau100). A flip above tau would need a shift larger than every one of
    the near-tie steps measured. An explicit safety factor overrides this."""
    t100 = tau100(steps)
    shifts = near_tie_shift(steps)
    d = float(shifts.max()) if len(shifts) else 0.0
    if safety_factor is None:
        safety = max(1.0, d / t100) if t100 > 0 else 1.0
        rule = (f"max(1, D / tau100) with D = {d:.4g}, the largest |fast - reference| margin shift over "
                f"{len(shifts)} stable steps with reference margin < {NEAR_TIE:g}")
    else:
        safety, rule = safety_factor, "given (--safety-factor)"
    tau = t100 * safety if t100 > 0 else d  # no flip seen: the shift bound alone
    tau = math.ceil(tau * TAU_STEP) / TAU_STEP  # up, to a short number
    return {"tau": tau, "tau100": t100, "max_flip_margin": max_flip_margin(steps),
            "safety_factor": tau / t100 if t100 > 0 else math.inf, "safety_rule": rule, "near_tie_shift_max": d,
            "near_tie_steps": int(len(shifts))}
