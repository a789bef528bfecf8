"""One-forward-late reading of deterministic rows on CUDA: the fast path never waits for the GPU.

Status: the one path on CUDA with the overlap scheduler (x86-64); a start where it cannot attach
fails with the reason (`attach`).

Why: the synchronous seam (hook.StepSeam._control) reads every deterministic forward's margins
on the host before sampling. That read waits for the GPU to finish the forward, so the overlap
scheduler cannot prepare the next batch while the GPU works, and every deterministic forward
pays SGLang's whole CPU step on top of its GPU step (+70-290 % measured on an H100).

Here the work is split between the device and the host:
- at the sampler (`launch`, no host sync): the device computes each protected row's margin and
  fast token and whether the row is a step (its position equals the one mg expects: the host's
  token count, current because every earlier forward was processed first). The step publisher
  (seam.publish: one kernel) writes those values to page-locked host memory. Every row is a
  window row (seam.decide's mode LAZY: committed fast, checked behind), so no row needs the
  verifier before sampling; every protected row's logits are forced to its fast token. A seeded
  row's logits are first replaced by its perturbed scores (`_perturb`), so its fast token and
  margin are seeded sampling's, as on the synchronous seam.
- one forward later (`drain`: from the next sampler call, or from the finish watcher thread
  every 5 ms while the scheduler is busy elsewhere): the host reads those values (by then the
  GPU has the next forward queued, so this wait leaves no bubble) and reports the steps to the
  controller one way.
A forward that carries a request with a due rollback takes the synchronous seam instead
(hook.StepSeam.__call__), which applies it in place (news.py, rollback.py).

Measured on an H100 (docs/reference.md, "On a GPU"): correct under graphs and overlap, cheaper than the
synchronous seam at every configuration measured.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from mg_server import env
from mg_server.seam.decide import LAZY, decide, force
from mg_server.seam.publish import ReferencePublisher, StepPublisher

log = logging.getLogger(__name__)

# The host gives up waiting for a forward's values after this.
HOST_WAIT_S = 30.0


@dataclass
class Forward:
    """One deterministic forward whose rows the host has not processed yet."""

    target: int  # this forward's tag in the gate's mailboxes
    rows: list[tuple[int, object, str]]  # (batch row, SGLang Req, instance key)
    temps: list[float]  # per row: its seeded temperature, 0.0 for a greedy row


def _wait(cond, what: str) -> None:
    """Poll a host-memory condition (no CUDA call); sleeping releases the GIL."""
    t0 = time.monotonic()
    while not cond():
        waited = time.monotonic() - t0
        if waited > HOST_WAIT_S:
            raise TimeoutError(f"mg: no {what} after {waited:.0f} s")
        time.sleep(0 if waited < 1e-4 else 2e-5)


class LaggedControl:
    """The seam's control path on CUDA (see module doc). `seam` is the hook's StepSeam; on a CPU
    device (unit tests) the publisher is seam.publish.ReferencePublisher."""

    def __init__(self, seam, device: torch.device, inline: bool = False):
        self.seam = seam
        self.link = seam.link
        self.device = device
        r2t = seam.runner.req_to_token_pool.req_to_token
        self.capacity = r2t.shape[0]  # rows of one forward <= requests SGLang can hold
        self.gate = StepPublisher(self.capacity, device) if device.type == "cuda" else ReferencePublisher(self.capacity)
        pinned = device.type == "cuda"
        # [3 * cap] int64: n batch rows, n expected positions, n row modes (contiguous for n < cap);
        # page-locked on CUDA: seam.decide reads it through UVA (no copy op), before the forward's
        # publish, i.e. before the host may rewrite it for the next forward (drain waits for that)
        self.meta_host = torch.zeros(3 * self.capacity, dtype=torch.int64, pin_memory=pinned)
        self.tau_host = torch.zeros(1, dtype=torch.float64, pin_memory=pinned)  # [1] the policy's tau
        cap = self.capacity
        self.margin = torch.zeros(cap, dtype=torch.float32, device=device)  # [cap] top1 - top2
        self.fast = torch.zeros(cap, dtype=torch.int64, device=device)  # [cap] argmax tokens
        self.pos = torch.zeros(cap, dtype=torch.int64, device=device)  # [cap] positions
        self.need = torch.zeros(cap, dtype=torch.int32, device=device)  # [cap] 0: every row is a window row
        self.rows = torch.zeros(cap, dtype=torch.int64, device=device)  # [cap] batch rows (for force)
        self._meta_np, self._tau_np = self.meta_host.numpy(), self.tau_host.numpy()  # host views of both
        self._views: dict[int, tuple[Tensor, ...]] = {}  # n -> the buffers' [:n] views
        if device.type == "cuda":  # compile and load decide/force now (not at a first serving forward)
            lg = torch.zeros(1, 16, dtype=torch.float32, device=device)  # SGLang's logits are fp32
            decide(lg, self.pos[:1], self.meta_host, self.tau_host, seam.link.policy.mode == "always",
                   self.margin[:1], self.fast[:1], self.pos[:1], self.need[:1], self.rows[:1])
            force(lg, self.rows[:1], self.fast[:1])
            torch.cuda.synchronize(device)
        self.last_target = 0  # the publisher's tag of the last forward launched
        self.pending: deque[Forward] = deque()
        self.lock = threading.Lock()  # processing order; taken before the link's locks
        self.inline = inline  # a CPU server (tests: MG_LAGGED_ON_CPU)

    def fits(self, rows) -> bool:
        return len(rows) <= self.capacity

    def expected(self, req, key: str) -> int:
        """The position of the request's next step (-2: none; caller holds link.lock)."""
        t = self.link.tracked.get(key)
        if t is None:
            return len(req.origin_input_ids) - 1
        return -2 if (t.failed or t.req is not req) else len(t.tokens) - 1

    def launch(self, logits: Tensor, positions: Tensor, rows: list[tuple[int, object, str]],
               rules: list[tuple[float, int]]) -> None:
        """At the sampler: enqueue this forward's decision and gate; no host sync (module doc).
        rules[k]: row k's (temperature, seed), hook.sampling_rule. The caller drained every
        earlier forward first, so `expected` and the reused buffers (meta_host, the publisher's
        mailbox) are free."""
        link, n = self.link, len(rows)
        with link.lock:
            expected = [self.expected(req, key) for _, req, key in rows]
        if seeded := [k for k, (t, _) in enumerate(rules) if t > 0]:
            _perturb(logits, [rows[k][0] for k in seeded], [rules[k] for k in seeded],
                     [max(0, expected[k]) for k in seeded])
        mh = self._meta_np
        mh[:n], mh[n:2 * n], mh[2 * n:3 * n] = [i for i, _, _ in rows], expected, LAZY
        self._tau_np[0] = link.policy.tau
        views = self._views.get(n)
        if views is None:  # (a slice costs ~2-4 us of host time: made once per row count)
            views = self._views[n] = tuple(t[:n] for t in (self.margin, self.fast, self.pos, self.need, self.rows))
        margin, fast, pos, need, rows_dev = views
        # one kernel: each row's margin and argmax, its position, whether it is the step mg expects
        # (seam.decide says more)
        decide(logits, positions.to(logits.device), self.meta_host, self.tau_host, link.policy.mode == "always",
               margin, fast, pos, need, rows_dev)
        self.last_target += 1
        f = Forward(self.last_target, rows, [t for t, _ in rules])
        # pending first: only a forward in `pending` is processed by the watcher
        with self.lock:
            self.pending.append(f)
        try:
            self.gate.launch(margin, fast, pos, need, f.target)
        except BaseException:
            with self.lock:
                self.pending.remove(f)
            raise
        force(logits, rows_dev, fast)  # every protected row samples its fast token

    def drain(self, wait: bool, upto: int | None = None) -> None:
        """Process pending forwards in order; wait=False stops at the first whose values are not
        published yet. A forward's values never depend on a host action, so waiting here never
        deadlocks. A forward leaves `pending` only once processed: the scheduler's drain before a
        launch must also wait for one the watcher is processing."""
        if not self.pending:
            return
        with self.lock:
            while self.pending:
                f = self.pending[0]
                if upto is not None and f.target > upto:
                    return
                if not wait and not self.gate.published(f.target, len(f.rows)):
                    return
                try:
                    _wait(lambda: self.gate.published(f.target, len(f.rows)), "step values from the device")
                    self._process(f)
                except Exception as e:  # noqa: BLE001 - fail loudly
                    if not isinstance(e, TimeoutError):
                        log.exception("mg: the lagged control path failed on a forward")
                    self._fail_rows(f.rows, f"mg's control path: {e}")
                finally:
                    self.pending.popleft()

    def _fail_rows(self, rows, why: str) -> None:
        self.seam.fail([(req, key, why) for _, req, key in rows])

    def _process(self, f: Forward) -> None:
        """Report the forward's steps to the controller and commit their fast tokens."""
        seam, link = self.seam, self.link
        values = self.gate.values(len(f.rows))
        # a seeded row's margin is in score units (its logits were the scores): T * it in logit units,
        # as sampling.choice_of_pair has it
        steps = [(i, req, int(p), m * t if t > 0 else m, int(tok), key)
                 for (i, req, key), t, (m, tok, p, _) in zip(f.rows, f.temps, values)]
        with link.lock:
            live, fails = seam._classify(steps)
        seam._count(live)
        seam.commit(live, seam.report(live), fails)


def _perturb(logits: Tensor, batch_rows: list[int], rules: list[tuple[float, int]], positions: list[int]) -> None:
    """Seeded rows: logits[row] = its perturbed scores at the position mg expects (in place, no
    host wait), so that decide's top-2 and argmax are seeded sampling's (hook module doc). A row
    whose position is not the expected one is no step: its token is dropped or the request fails."""
    from mg_server.verifier.sampling import host_to_device, sampled_scores_rows

    idx = host_to_device(torch.tensor(batch_rows, dtype=torch.int64), logits.device)
    scores = sampled_scores_rows(logits.index_select(0, idx), [t for t, _ in rules], [s for _, s in rules],
                                 positions)  # [S, V] fp32
    logits.index_copy_(0, idx, scores.to(logits.dtype))


def attach(seam, config, runner) -> LaggedControl | None:
    """The seam's lagged control path, or None where it does not apply by design (then the
    synchronous seam decides every deterministic row; logged with why). Where it applies, a
    LaggedControl that cannot be built stops the start (no silent fallback to a path 70-290 %
    slower on a GPU)."""
    # Without the overlap scheduler the lagged path gains nothing (SGLang reads each forward's
    # tokens before preparing the next one).
    overlap = not getattr(getattr(runner, "server_args", None), "disable_overlap_schedule", True)
    cuda = str(getattr(runner, "device", "cpu")).startswith("cuda")
    # x86-64 only: the host's reads rely on the device's stores reaching it in program order
    why_not = ("a CPU device" if not (cuda or env.faults().lagged_on_cpu) else
               "--disable-overlap-schedule" if not overlap else
               f"a {platform.machine()} host (x86-64 only)" if platform.machine() != "x86_64" else "")
    if why_not:
        log.info("mg: the synchronous seam decides deterministic rows (%s)", why_not)
        return None
    dev = torch.device("cuda", int(getattr(runner, "gpu_id", 0) or 0)) if cuda else torch.device("cpu")
    try:
        lagged = LaggedControl(seam, dev, inline=not cuda)
    except Exception as e:
        raise RuntimeError(f"mg: the lagged seam could not attach ({type(e).__name__}: {e}); serve with "
                           "--disable-overlap-schedule for the synchronous seam, or --mg-mode off") from e
    seam.link.before_finish = lagged.drain
    # held ends (rollback.py): a request's end is checked beside SGLang's forwards, not blocking them
    from mg_server.seam import rollback

    r2t = runner.req_to_token_pool.req_to_token  # [requests, max tokens a request may hold]
    pool = getattr(runner, "effective_logical_max_total_num_tokens", None)  # SGLang's max_req_len bound
    rollback.seq_limit = min(int(r2t.shape[1]), int(runner.model_config.context_len), int(pool or r2t.shape[1]))
    rollback.hold_ends = True
    log.warning("mg: lagged commit on (step publisher capacity %d rows)", lagged.capacity)
    return lagged


__all__ = ["LaggedControl", "attach", "HOST_WAIT_S"]
