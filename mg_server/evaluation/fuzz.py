"""A fuzz run of a server's request surface (client side, loopback): random JSON shapes, types
and headers on every route mg fronts, bounded in time.

Each request is a valid body of one route mutated at random (keys dropped or added, values of
any JSON type, SGLang's and OpenAI's parameter names with odd values, mg's own field names),
or no JSON at all, sent with a random `X-Deterministic` value (or a misspelt header, or a
compressed body). Every answer is recorded; the run counts what no client may ever get:
- a 5xx, or no answer (a connection reset, a hang past the client timeout);
- a server that stops (checked at the end: /health 200);
- a `verified` deterministic /generate answer of token ids whose tokens are not the
  verifier-alone reference's (`Report.verified`: prompt, sampling rule and answer, for the
  caller to decode with the reference engine: `mismatches`).
"""

from __future__ import annotations

import gzip
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import requests

ROUTES = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/generate"),
          ("PUT", "/generate"), ("GET", "/health"), ("GET", "/v1/models"), ("GET", "/get_model_info"),
          ("GET", "/metrics"), ("POST", "/v1/responses"), ("POST", "/v1/embeddings"), ("POST", "/nowhere")]
FLAGS = ["1", "1", "1", "0", "true", "false", "yes", "", "2", "TRUE"]
# parameter names a client may try, each with a random value (front.rules, SGLang's protocol)
NAMES = ["temperature", "top_p", "top_k", "min_p", "seed", "sampling_seed", "n", "best_of", "max_tokens",
         "max_completion_tokens", "max_new_tokens", "min_tokens", "min_new_tokens", "stop", "stop_token_ids",
         "ignore_eos", "stream", "logprobs", "top_logprobs", "return_logprob", "logit_bias", "frequency_penalty",
         "presence_penalty", "repetition_penalty", "response_format", "tools", "tool_choice", "regex", "json_schema",
         "ebnf", "rid", "model", "echo", "suffix", "user", "lora_path", "image_data", "custom_params",
         "custom_logit_processor", "mg_deterministic", "mg_seed", "mg_temperature", "mg_mark", "session_params",
         "return_hidden_states", "stream_options", "priority", "no_stop_trim", "skip_special_tokens",
         "input_ids", "text", "prompt", "messages", "sampling_params", "X_Deterministic"]


@dataclass
class Report:
    sent: int = 0
    by_status: dict[str, int] = field(default_factory=dict)
    server_errors: list[str] = field(default_factory=list)  # 5xx and transport failures, with the request
    verdicts: dict[str, int] = field(default_factory=dict)
    verified: list[dict] = field(default_factory=list)  # {"prompt", "temperature", "seed", "answer"}
    alive: bool = False  # /health 200 after the run

    def to_json(self) -> dict:
        return {"sent": self.sent, "by_status": self.by_status, "server_errors": self.server_errors[:20],
                "n_server_errors": len(self.server_errors), "verdicts": self.verdicts,
                "n_verified_checkable": len(self.verified), "alive": self.alive}


def _value(rng: random.Random, depth: int = 0):
    """A random JSON value (containers only a few levels deep)."""
    kind = rng.randrange(12 if depth < 3 else 8)
    if kind < 8:
        return [None, True, False, rng.choice([0, 1, -1, 7, 2 ** 63, -(2 ** 70), 10 ** 9]),
                rng.choice([0.0, 0.5, 1.5, -3.25, 1e308, 1e-9]), "",
                rng.choice(["x", "héllo", "\u0000", "🙂" * 20, "a" * 3000, "1", "null"]), rng.randrange(50000)][kind]
    if kind == 8:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 9:
        return {rng.choice(NAMES): _value(rng, depth + 1) for _ in range(rng.randrange(4))}
    if kind == 10:
        return [rng.randrange(50000) for _ in range(rng.randrange(1, 6))]
    return [{"role": rng.choice(["user", "system", "bot"]), "content": _value(rng, depth + 1)}]


def _valid(rng: random.Random, path: str, prompt: list[int]) -> dict:
    new = rng.choice([1, 2, 4, 8])
    if path == "/v1/chat/completions":
        content = rng.choice(["Hi", "2+2?", "Name a color"])
        return {"model": "default", "messages": [{"role": "user", "content": content}], "max_tokens": new}
    if path == "/v1/completions":
        return {"model": "default", "prompt": rng.choice(["Once", prompt, ["a", "b"]]), "max_tokens": new}
    if path == "/generate":
        params = {"max_new_tokens": new, "temperature": 0}
        if rng.random() < 0.3:
            params.update(temperature=rng.choice([0.5, 1.0]), sampling_seed=rng.randrange(1000))
        return {"input_ids": prompt, "sampling_params": params} if rng.random() < 0.7 else \
            {"text": "The sky is", "sampling_params": params}
    return {"input": "x", "model": "default"}


def _mutate(rng: random.Random, body: dict) -> dict:
    body = json.loads(json.dumps(body))
    for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
        op = rng.randrange(4)
        target = body.get("sampling_params") if isinstance(body.get("sampling_params"), dict) and rng.random() < 0.5 \
            else body
        if op == 0 and target:
            target.pop(rng.choice(list(target)))
        else:
            target[rng.choice(NAMES)] = _value(rng)
    # every answer bounded: the run is bounded in time (an unbounded plain answer on a CPU runs to the
    # 8k context, minutes: not a hang, but it would read as one here)
    if "messages" in body or "prompt" in body:
        if not any(isinstance(body.get(k), int) for k in ("max_tokens", "max_completion_tokens")):
            body["max_tokens"] = 16
    elif isinstance(body.get("sampling_params"), dict) and not isinstance(
            body["sampling_params"].get("max_new_tokens"), int):
        body["sampling_params"]["max_new_tokens"] = 16
    for where in (body, body.get("sampling_params")):  # keep most answers short
        if isinstance(where, dict):
            for k in ("max_tokens", "max_new_tokens", "max_completion_tokens"):
                v = where.get(k)
                if isinstance(v, int) and not isinstance(v, bool) and v > 16 and rng.random() < 0.95:
                    where[k] = 16
    return body


def one_request(rng: random.Random, url: str, prompts: list[list[int]], timeout_s: float) -> dict:
    method, path = rng.choice(ROUTES)
    prompt = rng.choice(prompts)
    body = _valid(rng, path, prompt)
    if rng.random() < 0.8:
        body = _mutate(rng, body)
    headers = {"Content-Type": "application/json"}
    flag = rng.choice(FLAGS + [None, None]) if rng.random() < 0.9 else None
    if flag is not None:
        headers["X-Deterministic"] = flag
    if rng.random() < 0.03:
        headers["X_Deterministic"] = "1"
    data = json.dumps(body).encode()
    r = rng.random()
    if r < 0.04:
        data = rng.choice([b"not json", b"[]", b'"s"', b"null", b"{", b"[" * 5000, b"\xff\xfe"])
    elif r < 0.06:
        data, headers["Content-Encoding"] = gzip.compress(data), "gzip"
    out = {"method": method, "path": path, "flag": flag, "body": body}
    try:
        resp = requests.request(method, url + path, data=data if method != "GET" else None, headers=headers,
                                timeout=timeout_s)
    except requests.RequestException as e:
        return {**out, "status": "no answer", "error": repr(e)[:200]}
    out.update(status=resp.status_code, verdict=resp.headers.get("x-mg-verdict", ""))
    sp = body.get("sampling_params") if isinstance(body, dict) else None
    if (out["verdict"] == "verified" and path == "/generate" and "input_ids" in body and body["input_ids"] == prompt
            and isinstance(sp, dict) and "application/json" in resp.headers.get("content-type", "")):
        try:
            answer = resp.json()
        except ValueError:
            answer = None
        if isinstance(answer, dict) and isinstance(answer.get("output_ids"), list):
            t = sp.get("temperature") or 0
            out["check"] = {"prompt": prompt, "answer": answer["output_ids"], "temperature": float(t),
                            "seed": int(sp.get("sampling_seed") or 0) if t else 0}
    return out


def run(url: str, prompts: list[list[int]], seconds: float, seed: int = 0, workers: int = 4,
        timeout_s: float = 120.0) -> Report:
    """Fuzz `url` for `seconds` with `workers` concurrent clients (module doc)."""
    rep = Report()
    deadline = time.monotonic() + seconds

    def worker(k: int) -> list[dict]:
        rng, got = random.Random(seed * 1000 + k), []
        while time.monotonic() < deadline:
            got.append(one_request(rng, url, prompts, timeout_s))
        return got

    with ThreadPoolExecutor(workers) as pool:
        results = [r for rs in pool.map(worker, range(workers)) for r in rs]
    for r in results:
        rep.sent += 1
        status = str(r["status"])
        rep.by_status[status] = rep.by_status.get(status, 0) + 1
        if status == "no answer" or status.startswith("5"):
            rep.server_errors.append(json.dumps({k: r.get(k) for k in ("method", "path", "flag", "status", "error",
                                                                       "body")})[:600])
        if r.get("verdict"):
            rep.verdicts[r["verdict"]] = rep.verdicts.get(r["verdict"], 0) + 1
        if "check" in r:
            rep.verified.append(r["check"])
    try:
        rep.alive = requests.get(url + "/health", timeout=30).status_code == 200
    except requests.RequestException:
        rep.alive = False
    return rep


def mismatches(engine, checks: list[dict]) -> list[dict]:
    """The verified answers that are not the verifier-alone reference (verifier.reference). One
    reference per (prompt, temperature, seed), as long as its longest answer: a shorter answer's
    reference is its prefix (each token depends on the tokens before it and its position only)."""
    from mg_server.verifier.reference import greedy_reference

    longest: dict[tuple, int] = {}
    for c in checks:
        key = (tuple(c["prompt"]), c["temperature"], c["seed"] if c["temperature"] > 0 else None)
        longest[key] = max(longest.get(key, 0), len(c["answer"]))
    refs = {}
    for i, (key, n) in enumerate(longest.items()):
        if n:
            prompt, temperature, seed = key
            (refs[key],) = greedy_reference(engine, [list(prompt)], n, rid_prefix=f"fuzz{i}",
                                            temperature=temperature, seeds=[seed] if seed is not None else None)
    bad = []
    for c in checks:
        key = (tuple(c["prompt"]), c["temperature"], c["seed"] if c["temperature"] > 0 else None)
        if c["answer"] and refs[key].tokens[: len(c["answer"])] != c["answer"]:
            bad.append({**c, "reference": refs[key].tokens[: len(c["answer"])]})
    return bad
