"""Locust users of the soak benchmark: `python benchmarks/soak.py --minutes 5 --out FILE` starts
the server and runs this file (no command of its own).

Mixed traffic against one mg-server, each request classified by what it may answer:
- DetUser: deterministic /generate of a fixed prompt set (token ids, ignore_eos) whose
  verifier-alone references come in MG_SOAK_WORKLOAD; every `verified` answer is compared with
  its reference (a difference is the one result that must never happen). Half of them reuse a
  per-user request id.
- PlainUser: sampled chat (temperature 0.7) and plain penalty requests.
- DisconnectUser: deterministic and plain requests, streamed or not, that the client drops after
  0.05-1.5 s (random client disconnects).
- AbortUser: deterministic requests cut by /abort_request after a random delay; answers must say
  `aborted` (or be complete and equal the reference).
- BadUser: bodies that must get a 4xx: not JSON, wrong types, token ids outside the vocabulary,
  grammars (plain and deterministic), penalties and sampling with X-Deterministic, endpoints mg
  does not serve with the header.
Counters go to MG_SOAK_RESULT (JSON) at the end: requests per kind and status, unexpected
statuses (any 5xx, any other status a kind must not get), verified answers that differ.
"""

from __future__ import annotations

import json
import os
import random
import uuid
from collections import Counter

import gevent
import requests
from locust import HttpUser, between, events, task

W = json.loads(open(os.environ["MG_SOAK_WORKLOAD"]).read())
DET, REFS, OTHER, MAX_NEW = W["det"], W["refs"], W["other_texts"], W["max_new"]
VOCAB = W["vocab"]
HDR = {"X-Deterministic": "1"}
STATS = {"status": Counter(), "unexpected": Counter(), "verdicts": Counter(), "verified_compared": 0,
         "verified_mismatch": 0, "examples": []}


def record(kind: str, status, ok: bool, note: str = "") -> None:
    STATS["status"][f"{kind} {status}"] += 1
    if not ok:
        STATS["unexpected"][f"{kind} {status}"] += 1
        if len(STATS["examples"]) < 20:
            STATS["examples"].append(f"{kind} {status}: {note[:200]}")


def det_body(i: int, rid: str | None = None) -> dict:
    body = {"input_ids": DET[i], "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True}}
    if rid:
        body["rid"] = rid
    return body


def check_det(kind: str, i: int, r) -> None:
    verdict = r.headers.get("x-mg-verdict", "")
    STATS["verdicts"][f"{kind} {r.status_code} {verdict}"] += 1
    if r.status_code != 200:
        record(kind, r.status_code, False, r.text)
        return
    out = r.json()["output_ids"]
    if verdict == "verified":
        STATS["verified_compared"] += 1
        if out != REFS[i]:
            STATS["verified_mismatch"] += 1
            record(kind, "verified-differs", False, f"prompt {i}")
            return
    elif kind == "det" or verdict not in ("aborted", "unknown"):  # unknown: cut before mg saw a step
        record(kind, f"200-{verdict}", False, "a deterministic answer that is not verified")
        return
    record(kind, 200, True)


class _User(HttpUser):
    abstract = True
    wait_time = between(0.1, 0.8)


class DetUser(_User):
    weight = 3

    def on_start(self):
        self.rid = f"soak-{uuid.uuid4().hex[:8]}"

    @task
    def det(self):
        i = random.randrange(len(DET))
        body = det_body(i, self.rid if random.random() < 0.5 else None)  # a reused id, sequentially
        with self.client.post("/generate", json=body, headers=HDR, name="det", catch_response=True) as r:
            check_det("det", i, r)
            r.success()


class PlainUser(_User):
    weight = 2

    @task(3)
    def chat(self):
        body = {"model": "default", "max_tokens": 16, "temperature": 0.7,
                "messages": [{"role": "user", "content": random.choice(OTHER)}]}
        with self.client.post("/v1/chat/completions", json=body, name="plain", catch_response=True) as r:
            record("plain", r.status_code, r.status_code == 200, r.text)
            r.success()

    @task(1)
    def penalties(self):
        body = {"model": "default", "max_tokens": 16, "temperature": 0.5, "frequency_penalty": 0.5,
                "presence_penalty": 0.3, "prompt": random.choice(OTHER)}
        with self.client.post("/v1/completions", json=body, name="plain penalty", catch_response=True) as r:
            record("plain-penalty", r.status_code, r.status_code == 200, r.text)
            r.success()


class DisconnectUser(_User):
    weight = 1

    @task
    def drop(self):
        det = random.random() < 0.5
        stream = random.random() < 0.5
        i = random.randrange(len(DET))
        body = det_body(i) | {"stream": stream}
        try:  # plain requests library: a read timeout closes the connection (a client disconnect)
            requests.post(self.host + "/generate", json=body, headers=HDR if det else {},
                          timeout=(2, random.uniform(0.05, 1.5)), stream=stream)
            STATS["status"]["disconnect finished-first"] += 1
        except requests.RequestException:
            STATS["status"]["disconnect dropped"] += 1


class AbortUser(_User):
    weight = 1

    @task
    def abort(self):
        i = random.randrange(len(DET))
        rid = f"soak-abort-{uuid.uuid4().hex[:10]}"
        delay = random.uniform(0.1, 2.0)

        def later():
            gevent.sleep(delay)
            requests.post(self.host + "/abort_request", json={"rid": rid}, timeout=10)

        g = gevent.spawn(later)
        with self.client.post("/generate", json=det_body(i, rid), headers=HDR, name="det abort",
                              catch_response=True) as r:
            check_det("abort", i, r)
            r.success()
        g.join(timeout=15)


BAD = [
    ("/generate", "not json", {}, "raw"),
    ("/generate", {"text": 5}, {}, "json"),
    ("/generate", {"input_ids": [[VOCAB + 7]], "sampling_params": {"max_new_tokens": 2}}, {}, "json"),
    ("/generate", {"input_ids": [1, -3], "sampling_params": {"max_new_tokens": 2}}, {}, "json"),
    ("/v1/completions", {"model": "default", "prompt": [VOCAB], "max_tokens": 2}, {}, "json"),
    ("/v1/chat/completions", {"model": "default", "messages": "x"}, {}, "json"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 4, "regex": "[0-9]+"}}, {}, "json"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 4, "regex": "[0-9]+"}}, HDR, "json"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "a"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x", "schema": {"type": "object"}}}},
     {}, "json"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "a"}],
                              "frequency_penalty": 0.5}, HDR, "json"),
    ("/v1/chat/completions", {"model": "default", "messages": [{"role": "user", "content": "a"}],
                              "temperature": 0.9}, HDR, "json"),
    ("/v1/responses", {"model": "default", "input": "a"}, HDR, "json"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": "many"}}, {}, "json"),
]


class BadUser(_User):
    weight = 1

    @task
    def bad(self):
        path, body, headers, how = random.choice(BAD)
        kw = {"data": body, "headers": {**headers, "Content-Type": "application/json"}} if how == "raw" \
            else {"json": body, "headers": headers}
        with self.client.post(path, name="bad " + path, catch_response=True, **kw) as r:
            record("bad", r.status_code, 400 <= r.status_code < 500, f"{path} {str(body)[:80]}: {r.text}")
            r.success()


@events.test_stop.add_listener
def _write(environment, **_kw):
    out = {k: (dict(v) if isinstance(v, Counter) else v) for k, v in STATS.items()}
    with open(os.environ["MG_SOAK_RESULT"], "w") as f:
        json.dump(out, f, indent=1)
