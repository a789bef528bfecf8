"""One-forward-late control of deterministic rows on CUDA: the fast path never waits for the GPU.

Status: the default on CUDA with the overlap scheduler (`serve --mg-seam sync` turns it off).
Measured on an H100 (README, "On a GPU"): correct under graphs and overlap, cheaper than the
synchronous seam at every configuration measured, nearly free at batch 1 (+3 % on SmolLM2),
but a forward whose gate holds costs a whole verify call (6-11 ms SmolLM2, ~25 ms 8B shape).

Why: the synchronous seam (hook.StepSeam._control) reads every deterministic forward's margins
on the host before sampling. That read waits for the GPU to finish the forward, so the overlap
scheduler cannot prepare the next batch while the GPU works, and every deterministic forward
pays SGLang's whole CPU step on top of its GPU step (+70-290 % measured on an H100, even when
nothing was verified).

Here the decision is split between the device and the host:
- at the sampler (`launch`, no host sync): the device computes each protected row's margin and
  fast token, whether the row is a step (its position equals the one mg expects: the host's
  token count, current because every earlier forward was processed first) and whether the step
  needs the verifier (the policy: margin < tau in fp64, as `Policy.should_verify`, or every step
  in mode always). The step gate (kernels.gate.StepGate: a publish kernel, a stream wait, an
  apply kernel) publishes those values to page-locked host memory and, only if some row needs
  the verifier, holds the stream until the host answers there. After it, every protected row's
  logits are forced to the chosen token: the fast token, or for a row that needed the verifier
  the token the host wrote.
- one forward later (`drain`: from the next sampler call, or from the finish watcher thread
  every 5 ms while the scheduler is busy elsewhere): the host reads those values (by then the
  GPU has the next forward queued, so this wait leaves no bubble), reports fast steps to the
  controller one way, or, for a forward whose gate is holding, asks the controller (which
  verifies) and writes the verified tokens and the K/V repair descriptors; the kernel copies
  the verifier's columns into SGLang's pool itself and acknowledges.

The host's answer is stores to host memory, never a CUDA command: CUDA orders a device or
page-locked memory allocation (SGLang's first batches of a shape make some) after all earlier
work, so a release queued on a stream could wait behind the gate it should open (measured: 15 s
gate timeouts with a side-stream release). With host stores, such an allocation in the
scheduler thread just waits until the watcher thread has answered.

Early verify (experimental, `serve --mg-early-verify on`): the host work above is done for the
scheduler thread, which reaches it only at the next sampler call, one host step later. It pays
only where SGLang's step is host-bound. Measured on the H100 with this host's SGLang (no
sgl_kernel; benchmarks/results/gpu/HISTORY.md, "Early verify"), the step is GPU-bound (94-98 %
busy at batch 1-32). So a held stream costs the whole call whoever starts it, and no gain showed;
hence off. A thread sleeps on a CUDA event recorded between each forward's publish kernel and its
stream wait (a ctypes call: no GIL held); when the values are out and some row needs the verifier, it drains at
once, so the verify call runs while the scheduler thread prepares the next batch, and the
scheduler's own drain finds the forward done. Forwards with only fast steps are left to the
scheduler as before. The process's GIL switch interval is lowered (EARLY_SWITCH_S) so that this
thread gets the GIL within that time of its event, and again of the verifier's answer.

So (in hold mode, the default) a deterministic token is never sampled from a low-margin row before
the verifier decided it, and a forward with only fast steps costs a few small kernels. With
`--mg-commit lag` the fast token of such a row is sampled and swapped later if the verifier
disagrees (lagcommit.py). A gate that nobody answers within
`gate_timeout_s` (the hook's step timeout, which bounds a verify call: at least GATE_TIMEOUT_S)
is opened by the watchdog (the finish watcher thread); the fast tokens are then
sampled, nothing is repaired, and the host fails the rows that needed the verifier. (The
watchdog needs the GIL: a thread blocked in a CUDA call behind the gate while holding it would
stall the stream for good; none was seen since the two fixes in `launch` and StepGate's
construction, but nothing rules it out.)
"""

from __future__ import annotations

import logging
import platform
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch
from torch import Tensor

from mg_server import metrics
from mg_server.kernels.decide import LAZY, MUST, decide, force
from mg_server.kernels.gate import ReferenceStepGate, StepGate
from mg_server.runtime import protocol as P
from mg_server.sglang_ext.hook import pool_row
from mg_server.sglang_ext.lagcommit import LagCommit

log = logging.getLogger(__name__)

# The least time the watchdog leaves a gate unanswered before it opens it (the stream wait has
# no timeout of its own); LaggedControl.gate_timeout_s raises it to the hook's step timeout.
GATE_TIMEOUT_S = 15.0
# The host gives up waiting for a forward's values (or a gate's acknowledgement) after this.
HOST_WAIT_S = GATE_TIMEOUT_S + 15.0
# The scheduler process's GIL switch interval with early verify (CPython's default is 5 ms).
# why: a thread that wakes from a GIL-free wait gets the GIL only after the holder's switch
# interval, which the early thread would pay twice per verify call (its event, the answer).
EARLY_SWITCH_S = 2e-4


@dataclass
class Forward:
    """One deterministic forward whose rows the host has not processed yet."""

    target: int  # this forward's tag in the gate's mailboxes
    rows: list[tuple[int, object, str]]  # (batch row, SGLang Req, instance key)
    seen: float | None = None  # the watchdog's first sight of it published and unanswered
    outs: list[tuple[str, int]] = field(default_factory=list)  # lag: (key, output index) of its BEHIND rows
    ahead: threading.Event | None = None  # --mg-verify-ahead: set once the controller has its rows' answers
    musts: list[tuple[int, str, int]] = field(default_factory=list)  # lag: (row, key, position) of its MUST rows
    answered: dict[str, int] | None = None  # key -> token of the MUST rows answered before it was processed
    answered_checks: list = field(default_factory=list)  # (req, key, slot, gen) of those answers' repairs


def _wait(cond, what: str) -> None:
    """Poll a host-memory condition (no CUDA call: see module doc); sleeping releases the GIL."""
    t0 = time.monotonic()
    while not cond():
        waited = time.monotonic() - t0
        if waited > HOST_WAIT_S:
            raise TimeoutError(f"mg: no {what} after {waited:.0f} s")
        time.sleep(0 if waited < 1e-4 else 2e-5)


class LaggedControl(LagCommit):
    """The seam's control path on CUDA (see module doc). `seam` is the hook's StepSeam; on a CPU
    device (unit tests) the gate is kernels.gate.ReferenceStepGate."""

    def __init__(self, seam, device: torch.device, early: bool = False, lag: bool = False, inline: bool = False,
                 ahead: bool = False):
        self.seam = seam
        self.link = seam.link
        # --mg-verify-ahead (runtime/controller/ahead.py): at each launch the hosted controller's
        # client sends the protected rows' coming steps to the verifier from a thread of its own
        self.ahead = self.link.client.verify_ahead if ahead else None
        self.device = device
        runner = seam.runner
        pool, r2t = runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token
        self.capacity = r2t.shape[0]  # rows of one forward <= requests SGLang can hold
        slots = getattr(self.link.slots, "data", None)  # [n, L, 2, Hkv, D] the verifier's columns
        if device.type == "cuda":
            if slots is None or not slots.is_cuda:
                raise RuntimeError("mg's lagged commit needs the verifier's K/V slots in CUDA memory")
            self.gate = StepGate(self.capacity, pool.k_buffer, pool.v_buffer, slots, r2t)
        else:
            self.gate = ReferenceStepGate(self.capacity, pool.k_buffer, pool.v_buffer, slots, r2t)
        pinned = device.type == "cuda"
        # [3 * cap] int64: n batch rows, n expected positions, n row modes (contiguous for n < cap);
        # page-locked on CUDA: kernels.decide reads it through UVA (no copy op), before the forward's
        # publish, i.e. before the host may rewrite it for the next forward (drain waits for that)
        self.meta_host = torch.zeros(3 * self.capacity, dtype=torch.int64, pin_memory=pinned)
        self.tau_host = torch.zeros(1, dtype=torch.float64, pin_memory=pinned)  # [1] the policy's tau
        cap = self.capacity
        self.margin = torch.zeros(cap, dtype=torch.float32, device=device)  # [cap] top1 - top2
        self.fast = torch.zeros(cap, dtype=torch.int64, device=device)  # [cap] argmax tokens
        self.pos = torch.zeros(cap, dtype=torch.int64, device=device)  # [cap] positions
        self.need = torch.zeros(cap, dtype=torch.int32, device=device)  # [cap] 1: decided now, 2: behind
        self.rows = torch.zeros(cap, dtype=torch.int64, device=device)  # [cap] batch rows (for force)
        self.chosen = torch.zeros(cap, dtype=torch.int64, device=device)  # [cap] the gate's tokens
        self._meta_np, self._tau_np = self.meta_host.numpy(), self.tau_host.numpy()  # host views of both
        self._views: dict[int, tuple[Tensor, ...]] = {}  # n -> the buffers' [:n] views
        if device.type == "cuda":  # compile and load decide/force now (StepGate's construction says why)
            lg = torch.zeros(1, 16, dtype=torch.float32, device=device)  # SGLang's logits are fp32
            decide(lg, self.pos[:1], self.meta_host, self.tau_host, seam.link.policy.mode == "always",
                   self.margin[:1], self.fast[:1], self.pos[:1], self.need[:1], self.rows[:1])
            force(lg, self.rows[:1], self.chosen[:1])
            torch.cuda.synchronize(device)
        self.last_target = 0
        # the watchdog's limit: a holding gate waits for one verify call, which the hook's
        # controller client allows step_timeout_s (launch: >= every catch-up chunk's verify timeout)
        self.gate_timeout_s = max(GATE_TIMEOUT_S, float(getattr(seam.config, "step_timeout_s", 0.0)))
        self.timeouts = metrics.gate_timeouts()  # gates that did not wait for mg's answer
        self.pending: deque[Forward] = deque()
        self.lock = threading.Lock()  # processing order; taken before the link's locks
        self.inline = inline  # CPU server (tests): the reference gate answers a holding forward before force
        self.init_lag(lag)  # --mg-commit lag (lagcommit.py)
        self.early = early  # a thread drains each holding forward as soon as it is published
        self._armed = 0  # the last forward whose gate is enqueued (the early thread's next wait)
        self._armed_cv = threading.Condition()
        if early:
            self.gate.watch_publish()
            threading.Thread(target=self._early_loop, name="mg-early-verify", daemon=True).start()

    def fits(self, rows) -> bool:
        return len(rows) <= self.capacity

    def expected(self, req, key: str) -> int:
        """The position of the request's next step (-2: none; caller holds link.lock)."""
        t = self.link.tracked.get(key)
        if t is None:
            return len(req.origin_input_ids) - 1
        return -2 if (t.failed or t.req is not req) else len(t.tokens) - 1

    def launch(self, logits: Tensor, positions: Tensor, rows: list[tuple[int, object, str]]) -> None:
        """At the sampler: enqueue this forward's decision and gate; no host sync (module doc).
        The caller drained every earlier forward first, so `expected` and the reused buffers
        (meta_host, chosen, the gate's mailboxes) are free."""
        link, n = self.link, len(rows)
        if self.inline and self.seam.config.fault_missed_flip >= 0:
            self.inject_fault(logits, positions, rows)
        with link.lock:
            expected = [self.expected(req, key) for _, req, key in rows]
            # (an untracked key is its request's first step: the controller has no state for it yet)
            known = [key in link.tracked for _, _, key in rows] if self.ahead is not None else []
        modes = [self.mode(req, key) for _, req, key in rows]
        ahead = None
        if self.ahead is not None:  # first: the verifier's forward then runs beside this one
            todo = [P.AheadRow(rid=key, pos=e, must=m == MUST)
                    for (_, _, key), e, k, m in zip(rows, expected, known, modes) if e >= 0 and k and m != LAZY]
            ahead = self.ahead(todo) if todo else None
        mh = self._meta_np
        mh[:n], mh[n:2 * n], mh[2 * n:3 * n] = [i for i, _, _ in rows], expected, modes
        self._tau_np[0] = link.policy.tau
        views = self._views.get(n)
        if views is None:  # (a slice costs ~2-4 us of host time: made once per row count)
            views = self._views[n] = tuple(t[:n] for t in (self.margin, self.fast, self.pos, self.need, self.rows,
                                                           self.chosen))
        margin, fast, pos, need, rows_dev, chosen = views
        # one kernel: each row's margin and argmax, its position, whether it is the step mg expects
        # (the row's mode: a resumable row never holds, a lag row is verified behind) and the policy (fp64 as
        # Policy.should_verify compares; NaN margins are verified); kernels.decide says more
        decide(logits, positions.to(logits.device), self.meta_host, self.tau_host, link.policy.mode == "always",
               margin, fast, pos, need, rows_dev)
        self.last_target += 1
        f = Forward(self.last_target, rows, ahead=ahead,
                    musts=[(k, key, e) for k, ((_, _, key), e, m) in enumerate(zip(rows, expected, modes))
                           if m == MUST and e >= 0])
        if self.lag:
            self.track_outputs(f, expected, modes)
        # pending first: once the gate is enqueued, this thread's next CUDA call may block until
        # the gate opens (a lazy module load, an allocation: implicit synchronization), and only
        # a forward in `pending` is answered by the watcher (measured: a deadlock on the H100)
        with self.lock:
            self.pending.append(f)
        try:
            self.gate.launch(margin, fast, pos, need, chosen, f.target)
        except BaseException:
            self.gate.open(f.target)  # whatever part of the gate was enqueued must not hold
            with self.lock:
                self.pending.remove(f)
            for k in f.outs:
                self.unsettled.pop(k, None)
            raise
        if self.inline and self.gate.holding(f.target, n):  # (CPU reference gate: see __init__)
            self.drain(wait=True)
        force(logits, rows_dev, chosen)  # every protected row samples its chosen token
        if self.early:
            with self._armed_cv:
                self._armed = f.target
                self._armed_cv.notify()

    def _early_loop(self) -> None:
        """The early-verify thread (module doc): wait for each launched forward's publish, then
        drain if its gate holds. A failure to wait ends the thread (the scheduler still drains)."""
        sys.setswitchinterval(min(sys.getswitchinterval(), EARLY_SWITCH_S))
        done = 0
        try:
            self.gate.bind_thread()
            while True:
                with self._armed_cv:
                    self._armed_cv.wait_for(lambda: self._armed > done)
                    done = self._armed
                self.gate.wait_published()  # this launch's values, or a later one's (then `done` is stale: fine)
                try:
                    f = self.pending[0]
                except IndexError:  # the scheduler or the watcher got there first
                    continue
                if self.gate.holding(f.target, len(f.rows)):
                    self.drain(wait=False)  # (drain's own errors fail the rows and open the gate)
        except Exception:  # noqa: BLE001 - e.g. a driver error: verify calls wait for the scheduler again
            log.exception("mg: the early-verify thread stopped; holding forwards are drained by the scheduler")

    def drain(self, wait: bool, upto: int | None = None) -> None:
        """Process pending forwards in order; wait=False stops at the first whose values are not
        published yet. A forward's values never depend on a host action (its gate comes after
        them), so waiting here never deadlocks. A forward leaves `pending` only once processed:
        the scheduler's drain before a launch must also wait for one the watcher is processing."""
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
                except Exception as e:  # noqa: BLE001 - fail loudly, never leave the stream held
                    self.gate.open(f.target)  # unanswered: status 2, fast tokens (no-op once answered)
                    if not isinstance(e, TimeoutError):
                        log.exception("mg: the lagged control path failed on a forward")
                    self._fail_rows(f.rows, f"mg's control path: {e}")
                finally:
                    self.pending.popleft()
                    if self.lag:
                        self.settled(f)

    def watchdog(self) -> None:
        """From the finish watcher, without the lock (a long verify may hold it): open the oldest
        forward's gate if it has stayed published and unanswered for gate_timeout_s. Its rows
        that needed the verifier then fail when the host gets to it (ack status 2)."""
        try:
            f = self.pending[0]
        except IndexError:
            return
        if self.gate.acked(f.target) is not None or not self.gate.published(f.target, len(f.rows)):
            return
        now = time.monotonic()
        if f.seen is None:
            f.seen = now
        elif now - f.seen > self.gate_timeout_s:
            self.gate.open(f.target)

    def _fail_rows(self, rows, why: str) -> None:
        self.seam.fail([(req, key, why) for _, req, key in rows])

    def _process(self, f: Forward) -> None:
        seam, link, gate = self.seam, self.link, self.gate
        values = gate.values(len(f.rows))
        steps = [(i, req, int(p), m, int(tok), key) for (i, req, key), (m, tok, p, _) in zip(f.rows, values)]
        need = {i: int(n) for (i, _, _), (*_, n) in zip(f.rows, values)}  # 0, 1 (decided now), 2 (behind)
        if f.ahead is not None and (any(need.values()) or f.outs):  # the verdicts asked for were started at launch
            f.ahead.wait(HOST_WAIT_S)  # (if not done by then, the Step verifies them itself)
            if f.outs:
                self.promote_ahead(f, steps, need)
        need_of = {key: need[i] for i, _, key in f.rows}
        gated = 1 in need.values()
        tokens = [int(tok) for _, tok, _, _ in values]  # what the gate lets through unless replaced
        slot_of = {i: k for k, (i, _, _) in enumerate(f.rows)}
        key_of = {id(req): key for _, req, key in f.rows}
        repairs: list[tuple[int, int, int]] = []  # (slot's first element, req_pool_idx, position)
        checks: list[tuple[object, str, int, int]] = []  # (req, key, slot, gen) to re-check after the copy
        with link.lock:
            live, fails = seam._classify(steps)
        seam._count(live)
        answered = f.answered or {}  # (answer_ahead: its deferred repairs are written already)
        must = {key for i, *_, key in live if need[i] == 1 and (key in self.fixups or key in answered)}
        behind = {key for i, *_, key in live if need[i] == 2}
        decisions = seam.decide(live, any(need[i] for i, *_ in live), must, behind)
        for (i, _, _, _, tok, _, _), d in zip(live, decisions):
            if not d.error and not need[i] and d.token != tok:
                d.error = "mg's control path disagreed with the device's policy"  # never expected

        def repair(req, pos: int, d: P.StepDecision) -> None:
            key = key_of[id(req)]
            if need_of[key] == 2:  # verified behind: its fast token went through (lagcommit.py)
                self.correct(req, key, pos, d)
                return
            if pool_row(req) is None:
                # SGLang already released the request: this was the overlap scheduler's
                # look-ahead step after its last token (dropped at Finish), whose column the
                # request never reads. (Not None: the kernel reads req_to_token in stream
                # order, i.e. as this forward saw it, even if the row is freed meanwhile.)
                return
            if int(link.slots.gens[d.slot]) != d.gen:
                raise RuntimeError(f"verifier slot {d.slot} no longer holds generation {d.gen}")
            for p, slot, gen in [(pos, d.slot, d.gen), *(self.take_deferred(key) if key in must else [])]:
                repairs.append((slot * gate.slot_numel, int(pool_row(req)), p))
                checks.append((req, key, slot, gen))

        for (_, _, _, _, _, _, key), d in zip(live, decisions):
            if key in answered and not d.error and d.token != answered[key]:  # never expected: the same result
                d.error = "mg's answer ahead differs from the controller's decision"
        committed = seam.commit(live, decisions, fails, repair)
        for i, d in committed:
            tokens[slot_of[i]] = d.token
        if gated:  # (if anything above raised, drain opens the gate unanswered and fails the rows)
            if f.answered is None:
                gate.release(f.target, tokens, repairs)
            self._settle(f, need, checks + f.answered_checks)

    def _settle(self, f: Forward, need: dict[int, int], checks) -> None:
        """After answering a holding gate: wait for its acknowledgement (the copy is done), then
        fail what it could not do: a gate the watchdog opened first sampled the fast tokens and
        repaired nothing; a slot the verifier reused during the copy gave a torn column (seqlock)."""
        gate = self.gate
        try:
            _wait(lambda: gate.acked(f.target) is not None, "acknowledgement from the step gate")
            status = gate.acked(f.target)
        except TimeoutError:
            status = 2
        if status != 1:  # 2: opened by the watchdog; 0 would be a gate that never held (a bug)
            self.timeouts.inc()
            held = [r for r in f.rows if need[r[0]] == 1]
            self._fail_rows(held, f"the step gate did not wait for mg (status {status})")
            return
        gens = self.link.slots.gens
        torn = [(req, key) for req, key, slot, gen in checks if int(gens[slot]) != gen]
        if torn:
            self._fail_rows([(None, req, key) for req, key in torn], "verifier slot reused during a K/V repair")


def attach(seam, config, runner) -> LaggedControl | None:
    """The seam's lagged control path, or None where it does not apply (then the synchronous seam
    decides every deterministic row; the reason is logged)."""
    # Without the overlap scheduler the lagged path gains nothing (SGLang reads each forward's
    # tokens before preparing the next one) and only the watcher thread could open a gate.
    overlap = not getattr(getattr(runner, "server_args", None), "disable_overlap_schedule", True)
    cuda = str(getattr(runner, "device", "cpu")).startswith("cuda")
    lagged = None
    # x86-64 only: the host's answer relies on its stores reaching the device in program order
    if config.lagged_commit and overlap and platform.machine() == "x86_64" and (cuda or config.lagged_on_cpu):
        try:
            dev = torch.device("cuda", int(getattr(runner, "gpu_id", 0) or 0)) if cuda else torch.device("cpu")
            lagged = LaggedControl(seam, dev, early=config.early_verify, lag=config.lag_commit, inline=not cuda,
                                   ahead=config.verify_ahead)
        except Exception as e:  # noqa: BLE001 - e.g. a driver without stream memory operations
            log.warning("mg: lagged commit unavailable (%s: %s); deterministic rows use the synchronous seam",
                        type(e).__name__, e)
    if lagged is None:
        if config.lag_commit:
            log.warning("mg: --mg-commit lag needs the lagged seam, which is off here; low-margin steps hold")
        if config.verify_ahead:
            log.warning("mg: --mg-verify-ahead needs the lagged seam, which is off here; steps are verified when asked")
        return None
    seam.link.before_finish = lagged.drain
    seam.link.gate_watchdog = lagged.watchdog
    log.warning("mg: lagged commit on (step gate capacity %d rows, early verify %s, lag %s, verify ahead %s)",
                lagged.capacity, "on" if config.early_verify else "off", config.lag_commit,
                "on" if config.verify_ahead else "off")
    return lagged


__all__ = ["LaggedControl", "attach", "GATE_TIMEOUT_S"]
