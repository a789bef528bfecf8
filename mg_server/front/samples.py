"""Deterministic requests that ask for several completions: single completions, then one answer.

Why the front splits them: SGLang serves n > 1 and a list of prompts by giving each copy a fresh
request id (and may prefill a shared prefix in an extra request with max_new_tokens 0), so mg's
seam cannot tell which copy is which, and every sample would carry the same seed (n equal
answers); the front's verdict would name an id SGLang never ran. Split into single requests,
each completion is a request with one prompt, `n: 1` and, for sample i, seed `seed + i`
(mod 2**64): individually reproducible, each with its own verdict.
- /generate (one prompt, seeded n > 1): the body becomes a batch of n copies of the prompt with
  list-form sampling_params (SGLang answers a list, as it does for n > 1); a batch of prompts
  with n > 1 is a 400.
- /v1/chat/completions, /v1/completions, not streamed: seeded n > 1, and on /v1/completions a
  list of prompts (texts or token-id lists), become one body per completion (prompt-major, as
  OpenAI orders choices), sent to SGLang concurrently and merged into one answer (choices in
  that order, usage summed). Streamed, that is a 400 (merging event streams would reorder them).
  The client leaving cancels every part (their requests see the disconnect and SGLang aborts them).
Requests without temperature > 0 and a seed keep n (n > 1 stays front.rules's 400).
"""

from __future__ import annotations

import asyncio
from typing import Any

from mg_server.front.rules import BadRequest


def _seeded_n(params: dict, seed_key: str) -> int:
    """n of a request that asks for several seeded samples (0 if not such a request)."""
    n, t, seed = params.get("n"), params.get("temperature"), params.get(seed_key)
    ok = (isinstance(n, int) and not isinstance(n, bool) and n > 1 and isinstance(t, (int, float))
          and not isinstance(t, bool) and t > 0 and isinstance(seed, int) and not isinstance(seed, bool))
    return n if ok else 0


def _prompt_list(body: dict, path: str) -> list | None:
    """The prompts of a /v1/completions body that names several (a list of texts, or of token-id
    lists), else None (one text, or one list of token ids)."""
    prompt = body.get("prompt")
    if path != "/v1/completions" or not isinstance(prompt, list) or not prompt:
        return None
    if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
        return prompt
    return None


def split_openai(body: dict, path: str) -> list[dict] | None:
    """One body per completion of an OpenAI request with several (module doc), else None."""
    n, prompts = _seeded_n(body, "seed"), _prompt_list(body, path)
    if not n and prompts is None:
        return None
    if body.get("stream"):
        what = "n > 1" if n else "a list of prompts"
        raise BadRequest(f"X-Deterministic: 1 serves {what} without streaming only: set stream false, or send one "
                         "request per completion (n 1, seeds seed, seed+1, ...: the samples this request would get)",
                         param="n" if n else "prompt")
    rid = body.get("rid")  # SGLang's own field: each completion needs its own id
    parts = []
    for prompt in prompts if prompts is not None else [None]:
        for i in range(n or 1):
            part = {**body, **({"prompt": prompt} if prompts is not None else {})}
            if n:
                part.update(n=1, seed=body["seed"] + i)
            if isinstance(rid, str):
                part["rid"] = f"{rid}-{len(parts)}"
            parts.append(part)
    return parts


def completions_per_prompt(body: dict) -> int:
    """How many consecutive parts of split_openai answer one prompt (n, or 1)."""
    return _seeded_n(body, "seed") or 1


def expand_generate(body: dict) -> dict:
    """A /generate body with one prompt and seeded n > 1 as a batch of n single samples."""
    params = body.get("sampling_params")
    n = _seeded_n(params, "sampling_seed") if isinstance(params, dict) else 0
    if not n:
        return body
    key = "text" if "text" in body else "input_ids"
    prompt: Any = body.get(key)
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt))):
        raise BadRequest("X-Deterministic: 1 serves sampling_params.n > 1 for one prompt per request; send the "
                         "prompts separately", param="sampling_params.n")
    out = {**body, key: [prompt] * n,
           "sampling_params": [{**params, "n": 1, "sampling_seed": params["sampling_seed"] + i} for i in range(n)]}
    if isinstance(body.get("rid"), str):
        out["rid"] = [f"{body['rid']}-{i}" for i in range(n)]
    return out


def merge_openai(answers: list[dict], per_prompt: int = 1) -> dict:
    """One OpenAI response from single-completion ones: choice i is part i; completion tokens
    summed over all, prompt tokens over the prompts (`per_prompt` consecutive parts share one)."""
    merged = dict(answers[0])
    merged["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    usage = merged.get("usage")
    if isinstance(usage, dict):
        def used(a: dict, key: str) -> int:
            return (a.get("usage") or {}).get(key) or 0

        prompt = sum(used(a, "prompt_tokens") for a in answers[::per_prompt])
        completion = sum(used(a, "completion_tokens") for a in answers)
        merged["usage"] = {**usage, "prompt_tokens": prompt, "completion_tokens": completion,
                           "total_tokens": prompt + completion}
    return merged


async def capture(app, scope: dict, body: bytes, gone: asyncio.Event) -> tuple[int, list, bytes]:
    """Run one request through the app in-process -> (status, headers, body). Its receive reports
    a disconnect once `gone` is set (the client of the whole request left), so SGLang aborts it."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
    sub = {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}
    sent, status, out_headers, chunks = False, [500], [], []

    async def receive() -> dict:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def keep(message: dict) -> None:
        if message["type"] == "http.response.start":
            status[0] = message.get("status", 200)
            out_headers.extend((k.lower(), v) for k, v in message.get("headers", []))
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(sub, receive, keep)
    return status[0], out_headers, b"".join(chunks)


async def run_parts(app, scope: dict, bodies: list[bytes], receive,
                    gone: asyncio.Event | None = None) -> list[tuple[int, list, bytes]]:
    """Every part through the app concurrently; a disconnect of the client (`receive`) reaches each
    (and sets `gone`)."""
    gone = gone or asyncio.Event()

    async def watch() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        gone.set()

    watcher = asyncio.ensure_future(watch())
    try:
        return await asyncio.gather(*(capture(app, scope, b, gone) for b in bodies))
    finally:
        watcher.cancel()
