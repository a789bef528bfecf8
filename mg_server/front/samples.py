"""`n > 1` for seeded deterministic requests: n single samples, sample i seeded with seed + i.

Why the front splits them: SGLang serves n > 1 itself by giving each copy a fresh random request
id (and may prefill a shared prefix in an extra request with max_new_tokens 0), so mg's seam
cannot tell which copy is sample i, and every copy would carry the same seed (n equal answers).
Split into single requests, sample i is exactly the request with `n: 1` and seed `seed + i`
(mod 2**64): individually reproducible, and distinct because their noise differs.
- /generate (one prompt): the body becomes a batch of n copies of the prompt with list-form
  sampling_params (SGLang answers a list, as it does for n > 1); a batch of prompts with n > 1
  is a 400.
- /v1/chat/completions, /v1/completions, not streamed: the middleware sends n bodies to SGLang
  concurrently and merges the n answers into one (choices in sample order, usage summed).
  Streamed n > 1 is a 400 (merging n event streams would reorder their events).
Requests without temperature > 0 and a seed are left alone (their n > 1 stays front.policy's 400).
"""

from __future__ import annotations

from typing import Any

from mg_server.front.policy import BadRequest


def _seeded_n(params: dict, seed_key: str) -> int:
    """n of a request that asks for several seeded samples (0 if not such a request)."""
    n, t, seed = params.get("n"), params.get("temperature"), params.get(seed_key)
    ok = (isinstance(n, int) and not isinstance(n, bool) and n > 1 and isinstance(t, (int, float))
          and not isinstance(t, bool) and t > 0 and isinstance(seed, int) and not isinstance(seed, bool))
    return n if ok else 0


def split_openai(body: dict) -> list[dict] | None:
    """n single-sample bodies for an OpenAI request with n > 1 and a seed, else None."""
    n = _seeded_n(body, "seed")
    if not n:
        return None
    if body.get("stream"):
        raise BadRequest("X-Deterministic: 1 serves n > 1 without streaming only: set stream false, or send n "
                         "requests with n 1 and seeds seed, seed+1, ... (the samples this request would get)",
                         param="n")
    rid = body.get("rid")  # SGLang's own field: each sample needs its own id
    return [{**body, "n": 1, "seed": body["seed"] + i, **({"rid": f"{rid}-{i}"} if isinstance(rid, str) else {})}
            for i in range(n)]


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


def merge_openai(answers: list[dict]) -> dict:
    """One OpenAI response from n single-sample ones: choice i is sample i, usage summed."""
    merged = dict(answers[0])
    merged["choices"] = [{**a["choices"][0], "index": i} for i, a in enumerate(answers)]
    usage = merged.get("usage")
    if isinstance(usage, dict):
        completion = sum((a.get("usage") or {}).get("completion_tokens") or 0 for a in answers)
        merged["usage"] = {**usage, "completion_tokens": completion,
                           "total_tokens": (usage.get("prompt_tokens") or 0) + completion}
    return merged
