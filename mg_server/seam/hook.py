"""mg's per-step seam in SGLang's scheduler process: a forward pre-hook on the runner's Sampler.

Why the sampler and not a module of the model: on the GPU, decode runs as a replayed CUDA graph
that holds the whole model, `logits_processor` included, so a module hook inside the model runs
only while the graph is captured. SGLang's `Sampler` runs after every forward that samples
(graph replay, eager decode, prefill, piecewise graphs) and outside any graph, and it receives
the pre-sampling logits, the batch's sampling info (`custom_params`: mg's flag and SGLang's
`Req`) and each row's position from the forward batch (decode: the input token's position;
prefill: the last position of the row's chunk).

How mg gets there: SGLang loads mg through `--forward-hooks`. The factory runs in
`finalize_cuda_graph_capture(model_runner)` (scheduler process, after the K/V pool exists and the
CUDA graphs are captured), takes that model runner from its caller's frame (the one reference
SGLang's hook API gives a factory) and registers the pre-hook on `runner.sampler`; it returns no
module hook.

Positions come from the forward batch, never from `req.output_ids`: under the overlap scheduler
the forward being sampled is one step ahead of the request's output list (the previous step's
token is still on the GPU). mg does not need that list: every token of a protected request is
chosen here (the row's logits are forced to mg's decision, fast or verified), so this module
keeps each request's token list itself: t_0 .. t_{n-1} = prompt, then the tokens it decided.
A row is a step iff its position is n - 1; a smaller position is a non-final prefill chunk
(SGLang drops that token); a larger one means mg missed a step, and the request fails.

Seeded sampling (temperature > 0 and a seed in custom_params, set by the front): the row's fast
token and margin are those of the perturbed scores logits / T + Gumbel(seed, position)
(`mg_server.verifier.sampling.sampled_pairs`, the function the verifier applies to its own fp32 rows, so
the noise is bit-identical: elementwise integer and IEEE ops only, on the same device type).
SGLang itself decodes such a request greedily (the front pins its temperature to 0) over the
logits mg forces to the decided token.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from http import HTTPStatus

import torch
from torch import Tensor

from mg_server import env, metrics
from mg_server.config import (INSTANCE_PARAM, SEED_PARAM, TEMPERATURE_PARAM, HookConfig,
                              instance_key)
from mg_server.seam import guard
from mg_server.verifier.sampling import choice_of_pair, sampled_pairs, warm_up_sampling
from mg_server.seam import rollback
from mg_server.seam.link import ControllerLink, StepDecision, Tracked
from mg_server.seam.reasons import OVER_BUDGET, over_budget, public_reason, unmodelled
from mg_server.seam.news import WindowSeam
from mg_server.seam.ranks import RankSeam, SeamRanks, sglang_ranks
from mg_server.seam.rows import force_tokens, only_mg_processors, protected_rows, top2
from mg_server.wire import protocol as P

log = logging.getLogger(__name__)


def sampling_rule(req) -> tuple[float, int]:
    """(temperature, seed) of a protected request: (0.0, 0) is greedy (see module doc)."""
    params = req.sampling_params.custom_params or {}
    temperature = params.get(TEMPERATURE_PARAM) or 0.0
    return (float(temperature), int(params.get(SEED_PARAM) or 0)) if temperature > 0 else (0.0, 0)


def find_model_runner():
    """The ModelRunner whose model SGLang is registering forward hooks on right now: a local of
    register_forward_hooks' caller (see module doc)."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_name != "register_forward_hooks":
        frame = frame.f_back
    if frame is not None and frame.f_back is not None:
        model = frame.f_locals.get("model")
        for runner in frame.f_back.f_locals.values():
            if isinstance(runner, ModelRunner) and runner.model is model:
                return runner
    raise RuntimeError("mg: SGLang's hook factory was not called with its model runner in reach; this "
                       "SGLang attaches forward hooks differently from the supported versions")


class StepSeam(WindowSeam, RankSeam):
    """The forward pre-hook on SGLang's Sampler (see module doc)."""

    def __init__(self, config: HookConfig, runner, ranks=None):
        self.config = config
        self.mark = env.request_mark()  # the front's mark of deterministic requests (guard.py)
        self.runner = runner
        self.steps, self.margin, self.control = metrics.hook_metrics(config.margin_buckets)
        # Under TP rank 0 decides and the other ranks follow it (ranks.py): a follower has no link.
        self.ranks = ranks if ranks is not None else SeamRanks()  # (make_hook passes SGLang's)
        self.follower = bool(config.controller_ipc) and not self.ranks.leader
        self.plan = None  # rank 0 under TP: the forward's decisions being recorded (ranks.Plan)
        self.link = ControllerLink(config) if config.controller_ipc and not self.follower else None
        self.lagged = None  # CUDA: the one-forward-late control path (lagged.py)
        self._released_first: set[str] = set()  # first rows released early (news.py)
        if config.controller_ipc:
            rollback.install()
        if config.controller_ipc and self.ranks.size > 1:  # (a CPU: make_hook refuses CUDA; no lagged path)
            rollback.ranks = self.ranks  # the finish rules agree too
        elif self.link is not None:
            from mg_server.seam.lagged import attach

            self.lagged = attach(self, config, runner)
        if str(getattr(runner, "device", "cpu")).startswith("cuda"):
            # compiled now, not in the scheduler thread at the first seeded request (seconds)
            warm_up_sampling(torch.device("cuda", int(getattr(runner, "gpu_id", 0) or 0)))

    def __call__(self, module, args):
        # Sampler.forward(logits_output, sampling_info, return_logprob, top_logprobs_nums,
        #                 token_ids_logprobs, positions); checked by sglang_facts.check().
        if self.ranks.size > 1 and self.config.controller_ipc:
            return self._tp_call(args)  # (ranks.py: its own error handling, on every rank alike)
        try:
            return self._forward(args)
        except Exception as e:  # noqa: BLE001 - why: a raise here would stop SGLang's scheduler, every request with it
            self._seam_error(protected_rows(args[1], self.mark), e)
            return None

    def _seam_error(self, rows, e: Exception) -> None:
        """An error inside the seam: this forward's deterministic requests fail, SGLang goes on."""
        log.exception("mg: step seam error; this forward's deterministic requests fail")
        if self.link is not None and rows:
            self.fail([(req, key, f"mg step seam error: {e!r}") for _, req, key in rows])

    def _forward(self, args, rows=None):
        """`rows`: the forward's protected rows, where the caller has them (ranks.py)."""
        if self.lagged is not None:
            self.lagged.drain(wait=True)  # earlier forwards first: their tokens set this one's positions
        if rows is None:
            rows = protected_rows(args[1], self.mark)
        if self.lagged is not None:
            rollback.note_forward(args[0].next_token_logits.shape[0], rows)
        if not rows:
            return None
        # The lagged path needs a sampler that does not wait for the gated stream: only mg's
        # processor may be in the batch (a user's could read the logits on the host); a forward
        # that carries a due rollback (news.py) takes the synchronous path.
        rules = [sampling_rule(req) for _, req, _ in rows]
        if self.lagged is not None and only_mg_processors(args[1]) and self._lag_ok() and self.lagged.fits(
                rows) and not self._rollback_due(rows):
            t0 = time.perf_counter()
            self.lagged.launch(args[0].next_token_logits, args[5], rows, rules)
            self.control.observe(time.perf_counter() - t0)
            return None
        t0 = time.perf_counter()
        logits = args[0].next_token_logits  # [bs, vocab] on the model's device, pre-sampling
        idx = torch.tensor([i for i, _, _ in rows], dtype=torch.int64, device=logits.device)
        sub = logits.index_select(0, idx)  # [rows, vocab], the protected rows' logits
        margin, fast = top2(sub)  # [rows] fp32, [rows] int64
        pos = args[5].to(logits.device).index_select(0, idx)  # [rows] positions from the forward batch
        # One device-to-host copy for all three; fp64 holds every token id and position exactly.
        packed = torch.stack([margin.double(), fast.double(), pos.double()], dim=1).tolist()
        steps = [(i, req, int(p), m, int(f), key) for (i, req, key), (m, f, p) in zip(rows, packed)]
        if seeded_k := [k for k, (t, _) in enumerate(rules) if t > 0]:  # the perturbed scores decide (module doc)
            temps, seeds = [rules[k][0] for k in seeded_k], [rules[k][1] for k in seeded_k]
            pairs = sampled_pairs(sub[torch.tensor(seeded_k, device=sub.device)], temps, seeds,
                                  [steps[k][2] for k in seeded_k]).tolist()  # [S, 2]: one more host copy
            for k, t, pair in zip(seeded_k, temps, pairs):
                i, req, p, _, _, key = steps[k]
                tok, m = choice_of_pair(pair, t)
                steps[k] = (i, req, p, m, tok, key)
        if self.link is None:
            # Mode off: count, and leave greedy rows' logits alone. Without mg's own token list, a
            # row is a step once its position reaches the prompt's last.
            self._count([s for s in steps if s[2] >= len(s[1].origin_input_ids) - 1])
            # Seeded rows still sample by mg's rule (SGLang decodes them greedily), unverified.
            if seeded_k:
                force_tokens(logits, [steps[k][0] for k in seeded_k], [steps[k][4] for k in seeded_k])
            return None
        if not self._control(logits, steps):
            self.control.observe(time.perf_counter() - t0)
        return None  # the logits were edited in place

    def _lag_ok(self) -> bool:
        return True  # (seam/faults.py: a faulted seam on a GPU takes the synchronous path)

    def _count(self, steps) -> None:
        self.steps.inc(len(steps))
        for s in steps:
            self.margin.observe(s[3])

    def _classify(self, steps):
        """Split rows into steps for the controller and failures (caller holds the lock)."""
        live, fails = [], []
        for i, req, pos, margin, fast, key in steps:
            t = self.link.tracked.get(key)
            if t is not None and t.req is not req:
                fails.append((req, key, f"request id {req.rid!r} is already in use"))
                continue
            if t is not None and (t.failed or t.ended):
                continue
            if t is not None and t.hold is not None and t.hold.retracted:  # (rollback.py's module doc)
                fails.append((req, key, "SGLang retracted the request under memory pressure; it cannot resume "
                                        "from unverified tokens"))
                continue
            n = len(t.tokens) if t is not None else len(req.origin_input_ids)
            if pos < n - 1:
                continue  # a non-final prefill chunk: SGLang discards this row's token
            why = (unmodelled(req) or over_budget(req, self.link.info.verifier_pool_tokens)) if t is None else ""
            if why:
                fails.append((req, key, why))
                continue
            if pos > n - 1:
                fails.append((req, key, f"mg missed a step: position {pos}, but it holds {n} tokens"))
                continue
            live.append((i, req, pos, margin, fast, t is None, key))
        return live, fails

    def _control(self, logits: Tensor, steps) -> bool:
        """Apply due rollbacks, commit every other step row fast and report it to the controller,
        force each decided token. True if any row was rolled back (its token is the verifier's)."""
        link = self.link
        with link.lock:
            live, fails = self._classify(steps)
            rolled = self._roll_back(live, fails)
        self._count(live)
        done = self.commit(live, self.report(live), fails) + rolled
        if done:
            force_tokens(logits, [i for i, _ in done], [d.token for _, d in done])
            if self.plan is not None:  # (TP: the followers force the same, ranks.py)
                for i, d in done:
                    self.plan.at(i).token = d.token
        return any(d.verified for _, d in done)

    def report(self, live) -> list[StepDecision]:
        """Report classified step rows to the controller, one way: every row is committed with its
        fast token and checked behind (controller/window.py). An unreachable controller fails them."""
        link = self.link
        if not live:
            return []
        rows = self.step_rows(live)
        self.mark_window_rows(rows, live)
        try:
            with link.rpc_lock:
                link.client.report(rows)
            return [StepDecision(rid=r.rid, token=r.fast_token) for r in rows]
        except Exception as e:  # noqa: BLE001 - controller unreachable: fail these requests loudly
            return [StepDecision(rid=r.rid, error=f"mg controller unavailable: {e}") for r in rows]

    def commit(self, live, decisions: list[StepDecision], fails: list) -> list[tuple[int, StepDecision]]:
        """Apply the decisions to mg's token lists, and the failures (`fails` plus errors here:
        marked in mg's state, the requests aborted). Returns (batch row, decision) of every
        committed row."""
        link, done = self.link, []
        with link.lock:
            for (i, req, pos, *_, key), d in zip(live, decisions):
                t = link.tracked.get(key)
                if t is None:  # (not setdefault: a new Tracked copies the prompt, at every step of every row)
                    t = link.tracked[key] = self.new_tracked(req)
                if d.error:
                    fails.append((req, key, d.error))
                    continue
                t.tokens.append(d.token)
                done.append((i, d))
        self.fail(fails)
        return done

    def fail(self, fails: list) -> None:
        """Fail (req, key, why) rows: marked in mg's state (later forwards are not steps), the
        requests aborted with a reason the client may see."""
        link = self.link
        with link.lock:
            for req, key, _ in fails:
                t = link.tracked.get(key)
                if t is not None and t.req is req:
                    t.failed = True
        for req, _, why in fails:
            self._fail(req, why)
            if self.plan is not None and not self.plan.of(req).fail:  # (TP: the followers fail it too)
                self.plan.of(req).fail = why

    def arrived(self, req) -> None:
        """A deterministic request reached the scheduler (guard.py's on_admit, in its Req's
        constructor): its prompt goes to the controller now (protocol Arrive), ahead of its first
        step on the same socket. Never raises: without it the first check computes the prompt."""
        try:
            key = instance_key(req.rid, (req.sampling_params.custom_params or {}).get(INSTANCE_PARAM))
            temperature, seed = sampling_rule(req)
            msg = P.Arrive(rid=key, prompt=list(req.origin_input_ids), temperature=temperature, seed=seed)
            with self.link.rpc_lock:
                self.link.client.arrive(msg)
        except Exception as e:  # noqa: BLE001 - an optimisation only (docstring)
            log.warning("mg: the arrival of %s was not reported: %s", getattr(req, "rid", "?"), e)

    def new_tracked(self, req) -> Tracked:
        t = Tracked(req, list(req.origin_input_ids))
        self.hold(req, t)
        return t

    @staticmethod
    def step_rows(live) -> list[P.StepRow]:
        """The controller's rows for classified step rows (the prompt and rule on a first step)."""
        rows = []
        for _, req, pos, margin, fast, first, key in live:
            r = P.StepRow(rid=key, pos=pos, prompt=list(req.origin_input_ids) if first else [],
                          margin=margin, fast_token=fast)
            if first:  # the decoding rule travels with the prompt
                r.temperature, r.seed = sampling_rule(req)
            rows.append(r)
        return rows

    @staticmethod
    def _fail(req, why: str) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        log.error("mg: deterministic request %s failed: %s", req.rid, why)
        # The client learns what it can act on (a parameter, its request id); mg's internal
        # state (positions, token counts, controller and verifier errors) stays in the log.
        public = public_reason(why)
        if req.to_finish is None:  # the first reason is the one the client gets
            bad = public.startswith(OVER_BUDGET)  # the client's to fix: a 400
            req.to_finish = FINISH_ABORT(f"deterministic decoding failed: {public}",
                                         HTTPStatus.BAD_REQUEST if bad else HTTPStatus.SERVICE_UNAVAILABLE,
                                         "BadRequest" if bad else "ServiceUnavailable")


def check_runner(runner) -> None:
    """Refuse, at start-up, model runners whose K/V layout mg cannot repair."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = runner.token_to_kv_pool
    if not isinstance(pool, MHATokenToKVPool):
        raise RuntimeError(f"mg supports SGLang's MHATokenToKVPool K/V layout; this model uses "
                           f"{type(pool).__name__} (serve it with --mg-mode off)")
    # why: mg's repairs address a position's K/V as one row [kv_heads, head_dim] of each layer
    layout = getattr(pool, "kv_cache_layout", "nhd")
    if layout != "nhd":
        raise RuntimeError(f"mg repairs SGLang's token-major ('nhd') K/V layout; this pool is {layout!r} "
                           "(serve it with --mg-mode off)")


def check_dtype(runner, verifier_dtype: str) -> None:
    """Refuse, at start-up, a K/V pool whose dtype is not the verifier's (no silent cast)."""
    pool_dtype = str(runner.token_to_kv_pool.k_buffer[0].dtype).removeprefix("torch.")
    if pool_dtype != verifier_dtype:
        raise RuntimeError(f"mg: SGLang's K/V cache is {pool_dtype} but the verifier's is {verifier_dtype}; "
                           f"serve with --dtype {verifier_dtype} (or --mg-mode off)")


def make_hook(config: dict):
    """Factory named in SGLang's --forward-hooks spec: attaches the seam, registers no module hook."""
    runner = find_model_runner()
    check_runner(runner)
    cfg = HookConfig.from_json_dict(config)
    ranks = sglang_ranks()
    if cfg.controller_ipc and ranks.size != cfg.tp:
        raise RuntimeError(f"mg: SGLang runs {ranks.size} tensor-parallel ranks, mg's verifier {cfg.tp}")
    cuda = str(runner.device).startswith("cuda")
    if cfg.controller_ipc and cuda and ranks.size > 1:  # (the launcher refuses it first)
        raise RuntimeError("mg under tensor parallelism runs on a CPU only for now (seam/ranks.py)")
    if cfg.controller_ipc and cuda:  # before the link's hello, which waits for it
        from mg_server.seam.export import export

        export(runner.model, os.path.dirname(cfg.controller_ipc))
    seam = StepSeam(cfg, runner, ranks)
    if env.faults().active:  # test-only (seam/faults.py)
        from mg_server.seam import faults

        faults.install(seam)
    guard.install(seam.mark, seam.arrived if seam.link is not None else None)  # before the scheduler's first request
    if seam.link is not None and seam.link.info.verifier_dtype:
        check_dtype(runner, seam.link.info.verifier_dtype)
    runner.sampler.register_forward_pre_hook(seam)
    log.info("mg: step seam attached to %s.sampler (controller: %s); no module hook is needed",
             type(runner).__name__, config.get("controller_ipc") or "none")
    return None
