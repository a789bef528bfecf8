"""Does a running server give every deterministic request its verifier-alone answer?

Client side only (HTTP to a server on loopback); used by the determinism test and benchmark and
later by calibration. The checks:
- alone: each deterministic prompt sent by itself;
- mixed: groups of deterministic prompts sent concurrently with other traffic (other prompts,
  other lengths, `X-Deterministic: 0` and no header);
- prefix: prompts that share a long prefix, sent concurrently after a plain request has put the
  prefix into SGLang's radix cache (deterministic rows start from shared cache slots, which mg
  must never repair), with plain requests of the same prefix alongside.
Each deterministic answer is compared token for token with the verifier-alone reference, and the
tokens of every deterministic answer are summed, so a caller can check that mg saw every step
(`mg_deterministic_steps_total - mg_lookahead_steps_total == det_tokens`).
"""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

import requests


MG_COUNTERS = ("mg_deterministic_steps_total", "mg_verify_total", "mg_repair_total",
               "mg_audit_mismatch_total", "mg_verify_errors_total", "mg_lookahead_steps_total",
               "mg_corrections_total", "mg_rollbacks_total", "mg_stale_steps_total")


@dataclass(frozen=True)
class DeterminismConfig:
    url: str
    max_new: int = 64
    group: int = 4  # deterministic requests per mixed group
    others_per_group: int = 4
    timeout_s: float = 900.0
    phases: tuple[str, ...] = ("alone", "mixed")  # also "prefix"


@dataclass
class Outcome:
    label: str
    prompt_index: int
    match: bool
    first_diff: int  # -1 when equal
    verdict: str = ""
    n_tokens: int = 0  # tokens of the answer


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    det_tokens: int = 0  # tokens of every deterministic answer received (steps mg had to see)
    counters: dict = field(default_factory=dict)  # mg counter deltas over the run
    seconds: float = 0.0

    @property
    def mismatches(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.match]

    def to_json(self) -> dict:
        d = asdict(self)
        d["n_checked"] = len(self.outcomes)
        d["n_mismatch"] = len(self.mismatches)
        return d


def scrape(url: str, names: tuple[str, ...] = MG_COUNTERS, absent: float | None = 0.0) -> dict[str, float | None]:
    """mg's counters `names` (unlabelled samples, `absent` where absent) and its steps by decision."""
    text = requests.get(url + "/metrics", timeout=30).text
    out = {}
    for name in names:
        m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
        out[name] = float(m.group(1)) if m else absent
    for decision in ("fast", "verify"):
        m = re.search(rf'^mg_steps_total{{decision="{decision}"}} ([0-9.e+-]+)$', text, re.M)
        out[f"steps_{decision}"] = float(m.group(1)) if m else 0.0
    return out


def settled(url: str, timeout_s: float = 15.0) -> dict[str, float]:
    """mg's counters once they stop moving: requests sent without the header (batched bodies)
    get no verdict wait, so their end may still reach the controller after the response."""
    last, deadline = scrape(url), time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = scrape(url)
        if now == last:
            break
        last = now
    return last


def generate(url: str, input_ids: list[int], max_new: int, header: str | None,
             timeout_s: float) -> tuple[list[int], str]:
    """Greedy /generate of a token prompt; returns (output token ids, verdict header)."""
    body = {"input_ids": input_ids,
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True, "temperature": 0}}
    headers = {"X-Deterministic": header} if header is not None else {}
    r = requests.post(url + "/generate", json=body, headers=headers, timeout=timeout_s)
    r.raise_for_status()
    return r.json()["output_ids"], r.headers.get("x-mg-verdict", "")


def _compare(label: str, i: int, got: list[int], want: list[int], verdict: str) -> Outcome:
    diff = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), -1)
    if diff < 0 and len(got) != len(want):
        diff = min(len(got), len(want))
    return Outcome(label, i, diff < 0, diff, verdict, len(got))


def run(cfg: DeterminismConfig, det_prompts: list[list[int]], refs: list[list[int]],
        other_prompts: list[list[int]], progress=print,
        prefix_prompts: list[list[int]] = (), prefix_refs: list[list[int]] = ()) -> Report:
    """det_prompts[i]'s answer must equal refs[i] (max_new tokens) in every setting; the same for
    prefix_prompts / prefix_refs in the "prefix" phase."""
    rep = Report()
    before, t0 = settled(cfg.url), time.monotonic()

    if "alone" in cfg.phases:
        _alone(cfg, det_prompts, refs, rep)
        progress(f"alone: {sum(o.match for o in rep.outcomes)}/{len(det_prompts)} equal the reference")
    if "mixed" in cfg.phases:
        _mixed(cfg, det_prompts, refs, other_prompts, rep)
        progress(f"mixed: {sum(o.match for o in rep.outcomes if o.label == 'mixed')}/{len(det_prompts)} equal")
    if "prefix" in cfg.phases and prefix_prompts:
        _prefix(cfg, list(prefix_prompts), list(prefix_refs), rep)
        progress(f"prefix: {sum(o.match for o in rep.outcomes if o.label == 'prefix')}/{len(prefix_prompts)} equal")
    rep.det_tokens = sum(o.n_tokens for o in rep.outcomes)
    after = settled(cfg.url)
    rep.counters = {k: after[k] - before[k] for k in after}
    rep.seconds = time.monotonic() - t0
    return rep


def _alone(cfg, det_prompts, refs, rep: Report) -> None:
    for i, ids in enumerate(det_prompts):
        got, verdict = generate(cfg.url, ids, cfg.max_new, "1", cfg.timeout_s)
        rep.outcomes.append(_compare("alone", i, got, refs[i], verdict))


def _mixed(cfg, det_prompts, refs, other_prompts, rep: Report) -> None:
    for g in range(0, len(det_prompts), cfg.group):
        jobs = [("det", i, det_prompts[i], cfg.max_new, "1") for i in range(g, min(g + cfg.group, len(det_prompts)))]
        for k in range(cfg.others_per_group):
            ids = other_prompts[(g + k) % len(other_prompts)]
            jobs.append(("other", -1, ids, 16 + 24 * k, ("0", None)[k % 2]))
        with ThreadPoolExecutor(len(jobs)) as pool:
            futs = [pool.submit(generate, cfg.url, ids, n, h, cfg.timeout_s) for _, _, ids, n, h in jobs]
            for (kind, i, *_), fut in zip(jobs, futs):
                got, verdict = fut.result()
                if kind == "det":
                    rep.outcomes.append(_compare("mixed", i, got, refs[i], verdict))


def _prefix(cfg, prompts, refs, rep: Report) -> None:
    """Shared-prefix prompts after a plain request has cached the prefix; plain ones alongside."""
    shared = min(len(p) for p in prompts)
    for p in prompts[1:]:
        shared = next((k for k in range(shared) if p[k] != prompts[0][k]), shared)
    generate(cfg.url, prompts[0][:shared], 2, None, cfg.timeout_s)  # the prefix enters the radix cache
    jobs = [(i, p, "1") for i, p in enumerate(prompts)] + [(-1, p, None) for p in prompts[: len(prompts) // 2]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        futs = [pool.submit(generate, cfg.url, p, cfg.max_new, h, cfg.timeout_s) for _, p, h in jobs]
        for (i, _, h), fut in zip(jobs, futs):
            got, verdict = fut.result()
            if h == "1":
                rep.outcomes.append(_compare("prefix", i, got, refs[i], verdict))


@dataclass
class Workload:
    det: list[list[int]]  # deterministic prompts (chat-templated token ids)
    other: list[list[int]]  # other traffic
    refs: list[list[int]]  # verifier-alone answers of det, max_new tokens each
    ref_margins: list[list[float]]


def build_workload(model_path: str, n_prompts: int, max_new: int, n_other: int = 8, seed: int = 0,
                   offset: int = 0, device: str = "cpu") -> Workload:
    """Prompts from the offline sets, chat-templated, and their verifier-alone references
    (`seed`/`offset`: see prompts.mixed_prompts; other values hold out a calibration's prompts).
    `device`: where the references are computed: the served verifier's device, whose kernels
    (and so bits) they must share."""
    import torch
    from transformers import AutoTokenizer

    from mg_server.prompts import chat_ids, mixed_prompts, sharegpt_prompts
    from mg_server.verifier.reference import greedy_reference, load_engine

    tok = AutoTokenizer.from_pretrained(model_path)

    def ids(text: str) -> list[int]:
        return chat_ids(tok, ({"role": "user", "content": text},))

    det = [ids(t) for t in mixed_prompts(n_prompts, seed=seed, offset=offset)]
    other = [ids(t) for t in sharegpt_prompts(n_other, seed=7)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # results do not depend on it; one thread leaves a core to the rest
    try:
        refs = greedy_reference(load_engine(model_path, device=device), det, max_new)
    finally:
        torch.set_num_threads(threads)
    return Workload(det, other, [r.tokens for r in refs], [r.margins for r in refs])


