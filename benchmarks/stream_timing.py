"""Decode ms/step from streamed /generate answers: a module of `gpu_sweep.py --stream-interval K`
and of `offline_throughput.py`'s streams (no command of its own).

Why: the difference of two runs' wall times ((time of N tokens - time of S) / (N - S)) carries
every one-off cost of either run (prefill, the prompts' catch-up, the final audit) and every
stall of ~1 s that one run hits and the other does not; over 32 rows of 128 tokens those swamp a
few ms per step (docs/history/gpu-measurements.md, "Holding, re-measured and profiled"). Here each answer streams a chunk every `interval` tokens
(SGLang's per-request `stream_interval`), the client stamps each chunk as it arrives, and a row's
ms/step is the time between its first chunk at or past token N/4 and its last chunk (token N),
over the tokens between: prefill, the first steps and the verdict's wait stay out, every
decode step in between (held forwards included) stays in. A body's ms/step is the median of its
rows' (they decode in the same forwards).

That steady measure understates a held row's cost: the output hold sends a deterministic row's
first timed chunk only after its first check, while decoding goes on during that check, so the
check's time drops out of the interval (on an H200 the 8B shape's all-deterministic bs 32 rows
timed -23 % against plain SGLang with a 32-forward check delay, impossible for the same
forwards). Each row is therefore also timed as a whole answer: from the post to its last chunk,
per answer token (`answer_ms`; prefill and every wait included, the same rule for both servers).
A deterministic response ends with its verdict event, after the last chunk: `verdict_wait_ms`
times that wait per body.
"""

from __future__ import annotations

import json
import statistics
import threading
import time


def read_stream(resp, clock=time.perf_counter, marks: dict | None = None) -> tuple[dict[int, list[tuple[int, float]]], list]:
    """SSE lines of a /generate stream -> ({index: [(completion tokens, arrival time)]}, the
    states of mg's verdict event, `data: {"mg_verdict": {...}}`, if one came); `marks["verdict"]`:
    that event's arrival time. Raises on an error event."""
    points: dict[int, list[tuple[int, float]]] = {}
    states: list = []
    buf = b""
    for chunk in resp.iter_content(chunk_size=None):  # as the bytes arrive, not in 512-byte reads
        now = clock()
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                ev = json.loads(line[len(b"data: "):])
                if "error" in ev:
                    raise RuntimeError(f"stream error: {ev['error']}")
                if "mg_verdict" in ev:
                    states = ev["mg_verdict"]["states"]
                    if marks is not None:
                        marks["verdict"] = now
                    continue
                points.setdefault(ev.get("index", 0), []).append((ev["meta_info"]["completion_tokens"], now))
    return points, states


def _last(points: list[tuple[int, float]], new: int) -> tuple[int, float]:
    """A row's last chunk, which must complete its `new` tokens."""
    if not points or points[-1][0] != new:
        raise RuntimeError(f"a row streamed {points[-1][0] if points else 0} of {new} tokens")
    return points[-1]


def steady_ms(points: list[tuple[int, float]], new: int) -> float:
    """ms/step of one row from its (tokens, time) chunks: first chunk at or past new/4 to the last."""
    last = _last(points, new)
    first = next(p for p in points if p[0] >= new // 4)
    if last[0] <= first[0]:
        raise RuntimeError(f"too few chunks to time ({len(points)}); lower --stream-interval")
    return (last[1] - first[1]) / (last[0] - first[0]) * 1e3


def answer_ms(points: list[tuple[int, float]], new: int, posted: float) -> float:
    """ms per answer token of one row as its client sees the whole answer: post to last chunk."""
    return (_last(points, new)[1] - posted) / new * 1e3


def verdict_wait_ms(points: dict[int, list[tuple[int, float]]], marks: dict) -> float:
    """ms from a body's last chunk (of any row) to its verdict event, which ends a deterministic
    response (the whole answers stop at the last chunk)."""
    if "verdict" not in marks:
        raise RuntimeError("a deterministic stream ended without its verdict event")
    return (marks["verdict"] - max(p[-1][1] for p in points.values())) * 1e3


def stream_batch(url: str, rows: list[list[int]], new: int, n_det: int, singles: bool = False,
                 interval: int = 8) -> dict:
    """gpu_sweep.front_batch with streamed answers: the first n_det rows deterministic (one body,
    or one request each with singles), the rest one plain body, all posted at the same moment.
    -> {"det"/"plain": ms/step (median over the rows), "det_answer"/"plain_answer": ms per token
    of the whole answers (median over the rows), "det_verdict": the verdict states,
    "det_verdict_wait": ms from a deterministic body's last chunk to its verdict (median over the
    bodies)}."""
    import requests

    params = {"max_new_tokens": new, "ignore_eos": True, "temperature": 0, "stream_interval": interval}
    out: dict = {}

    def post(key: str, part: list[list[int]], headers: dict) -> None:
        try:
            posted, marks = time.perf_counter(), {}
            with requests.post(url + "/generate", json={"input_ids": part, "sampling_params": params,
                                                        "stream": True},
                               headers=headers, timeout=600, stream=True) as r:
                r.raise_for_status()
                points, states = read_stream(r, marks=marks)
            if len(points) != len(part):
                raise RuntimeError(f"{len(points)} of {len(part)} rows streamed")
            out[key] = [steady_ms(p, new) for p in points.values()]
            out[key + "_answer"] = [answer_ms(p, new, posted) for p in points.values()]
            out[key + "_verdict"] = ",".join(sorted(set(states))) if headers else ""
            if headers:  # every deterministic body ends with its verdict event (mode off: unverified)
                out[key + "_verdict_wait"] = verdict_wait_ms(points, marks)
        except Exception as e:  # noqa: BLE001 - reported by the caller
            out[key + "_error"] = repr(e)

    n_parts = post_all(rows, n_det, singles, post, out)
    res: dict = {}
    if n_parts:
        res["det"] = statistics.median([x for k in range(n_parts) for x in out[f"det{k}"]])
        res["det_answer"] = statistics.median([x for k in range(n_parts) for x in out[f"det{k}_answer"]])
        waits = [out[f"det{k}_verdict_wait"] for k in range(n_parts) if f"det{k}_verdict_wait" in out]
        if waits:
            res["det_verdict_wait"] = statistics.median(waits)
        verdicts = {out[f"det{k}_verdict"] for k in range(n_parts)}
        res["det_verdict"] = verdicts.pop() if len(verdicts) == 1 else "mixed: " + ";".join(sorted(verdicts))
    if "plain" in out:
        res["plain"] = statistics.median(out["plain"])
        res["plain_answer"] = statistics.median(out["plain_answer"])
    return res


def post_all(rows: list[list[int]], n_det: int, singles: bool, post, out: dict) -> int:
    """Send the rows as clients send them, all at the same moment, one thread each: the first
    n_det deterministic as one body (singles: one request each), the rest as one plain body. post(key, part, headers) records
    into `out` ("<key>_error" on failure). -> the number of deterministic parts (keys det0..)."""
    parts = [[row] for row in rows[:n_det]] if singles else [rows[:n_det]] if n_det else []
    jobs = [threading.Thread(target=post, args=(f"det{k}", part, {"X-Deterministic": "1"}))
            for k, part in enumerate(parts)]
    if n_det < len(rows):
        jobs.append(threading.Thread(target=post, args=("plain", rows[n_det:], {})))
    for j in jobs:
        j.start()
    for j in jobs:
        j.join()
    if errors := [v for k, v in out.items() if k.endswith("_error")]:
        raise RuntimeError(f"a timed request failed: {errors[0]}")
    return len(parts)
