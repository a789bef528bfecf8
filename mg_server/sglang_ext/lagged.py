"""One-forward-late control of deterministic rows on CUDA: the fast path never waits for the GPU.

Status: experimental, off by default (`serve --mg-lagged-commit`). Measured on an H100: correct
once warm, but a page-locked or device memory allocation anywhere in this process while a gate
holds (SGLang's first batches of a shape allocate) is ordered by CUDA after the gated forward,
so the release queued on the side stream waits for it and the gate times out (the request then
fails; it is never called verified). The fix is a release that issues no CUDA command: the gate
polling a host-mapped flag and copying the tokens and the repair column itself.

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
  in mode always). It copies those to pinned host memory without waiting, then enqueues the
  stream gate (kernels.gate): a no-op unless some row needs the verifier, in which case the
  stream holds there. After the gate, every protected row's logits are forced to its token: the
  fast token, or for a row that needed the verifier the token the host wrote before releasing.
- one forward later (`drain`, from the next sampler call, or from the finish watcher thread
  while the scheduler waits elsewhere): the host reads those values (by then the GPU has the
  next forward queued, so this wait leaves no bubble), reports fast steps to the controller one
  way, or, for a forward whose gate is holding, asks the controller (which verifies), writes the
  K/V repairs and the verified tokens on a side stream and raises the gate's flag.

So a deterministic token is never sampled from a low-margin row before the verifier decided it,
and a forward with only fast steps costs a few small kernels. A gate that nobody releases (a
lost host thread) times out on the device after GATE_TIMEOUT_S; the fast token is then
sampled, and the controller's end-of-request check against its own decisions fails the request.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from dataclasses import dataclass

import torch
from torch import Tensor

from mg_server.kernels import gate as device_gate
from mg_server.runtime import protocol as P
from mg_server.sglang_ext.hook import top2


# A holding gate opens by itself after this long (the device has no other way out if the host
# never answers); a verify step, prompt catch-up included, takes well under a second on a GPU.
GATE_TIMEOUT_S = 15.0


@dataclass
class Forward:
    """One deterministic forward whose rows the host has not processed yet."""

    target: int  # the flag value that releases this forward's gate
    rows: list[tuple[int, object, str]]  # (batch row, SGLang Req, instance key)
    host: Tensor  # [rows, 4] fp64 pinned: margin, fast token, position, needs the verifier (0/1)
    ready: object  # torch.cuda.Event: `host` holds the values
    override: Tensor  # [rows] int64 cuda: tokens the host writes before releasing the gate
    staged: Tensor  # [rows] int64 pinned: the host's tokens, copied into `override` on the side stream


class _Done:
    """A CPU stand-in for a recorded CUDA event (unit tests run this path on CPU tensors, where
    every op has finished when it returns; `gate` is then the test's)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class LaggedControl:
    """The seam's control path on CUDA (see module doc). `seam` is the hook's StepSeam."""

    def __init__(self, seam, device: torch.device):
        self.seam = seam
        self.link = seam.link
        self.device = device
        self.cuda = device.type == "cuda"
        # repairs and releases go on a side stream: it never waits for the gated one
        self.side = torch.cuda.Stream(device) if self.cuda else None
        self.flag = torch.zeros(1, dtype=torch.int64, device=device)  # [1] raised by the host only
        self.status = torch.zeros(1, dtype=torch.int32, device=device)  # [1] last gate's outcome
        self.timeout_ns = int(GATE_TIMEOUT_S * 1e9)
        self.last_target = 0
        self.pending: deque[Forward] = deque()
        self.lock = threading.Lock()  # processing order; taken before the link's locks
        # While a gate holds, the host must not allocate device or page-locked memory: CUDA
        # orders such an allocation after all earlier work of every stream (implicit
        # synchronization), the gated forward included, so the release behind it would never run.
        # Hence everything the release path writes is allocated before any gate exists.
        spec = getattr(self.link.slots, "spec", None)
        self.column = (torch.empty(spec.shape[1:], dtype=getattr(torch, spec.dtype), device=device)
                       if spec is not None and self.cuda else None)  # [L, 2, Hkv, D]: a repair's column
        if self.cuda:
            self._warm_side_stream(seam.runner)

    def _warm_side_stream(self, runner) -> None:
        """Run one repair's ops on the side stream at start-up (into SGLang's padding slot 0,
        which padded rows overwrite anyway), so their memory is cached there before any gate."""
        pool, col = runner.token_to_kv_pool, self.column
        with torch.cuda.stream(self.side):
            loc = torch.zeros(1, dtype=torch.int64, device=self.device)
            if col is not None and col.shape[0] == len(pool.k_buffer):
                col.zero_()
                for layer in range(len(pool.k_buffer)):
                    pool.set_kv_buffer(None, loc, col[layer, 0][None], col[layer, 1][None], layer_id_override=layer)
            self.flag.fill_(0)
        self.side.synchronize()

    def expected(self, req, key: str) -> int:
        """The position of the request's next step (-2: none; caller holds link.lock)."""
        t = self.link.tracked.get(key)
        if t is None:
            return len(req.origin_input_ids) - 1
        return -2 if (t.failed or t.req is not req) else len(t.tokens) - 1

    def launch(self, logits: Tensor, positions: Tensor, rows: list[tuple[int, object, str]]) -> None:
        """At the sampler: enqueue this forward's decision and gate; no host sync (module doc).
        The caller drained every earlier forward first, so `expected` is current."""
        link, dev = self.link, logits.device
        with link.lock:
            expected = [self.expected(req, key) for _, req, key in rows]
        meta = torch.tensor([[i for i, _, _ in rows], expected], dtype=torch.int64, pin_memory=self.cuda)
        meta = meta.to(dev, non_blocking=True)  # [2, rows]: batch row, expected position
        idx, exp = meta[0], meta[1]
        sub = logits.index_select(0, idx)  # [rows, vocab]
        margin, fast = top2(sub)  # [rows] fp32, int64 (the synchronous seam's own function)
        pos = positions.index_select(0, idx).to(torch.int64)  # [rows]
        step = pos == exp
        if link.policy.mode == "always":
            need = step
        else:  # fp64 as Policy.should_verify compares the margin; NaN margins are verified
            need = step & ~(margin.double() >= link.policy.tau)
        # the host's tokens, written on the side stream before the gate opens; the fast tokens
        # until then (a timed-out gate must still index the vocabulary). Before `ready`: the
        # host writes only after that event, so this copy can never land over its tokens.
        override = fast.clone()
        staged = torch.empty(len(rows), dtype=torch.int64, pin_memory=self.cuda)  # before the gate: see __init__
        packed = torch.stack([margin.double(), fast.double(), pos.double(), need.double()], dim=1)
        host = torch.empty(packed.shape, dtype=torch.float64, pin_memory=self.cuda)
        host.copy_(packed, non_blocking=True)
        ready = torch.cuda.Event() if self.cuda else _Done()
        if self.cuda:
            ready.record()
        self.last_target += 1
        need_any = need.any().to(torch.int32).reshape(1)  # [1] int32 cuda
        device_gate.gate(self.flag, need_any, self.last_target, self.timeout_ns, self.status)
        chosen = torch.where(need, override, fast)  # read after the gate
        logits.index_fill_(0, idx, float("-inf"))
        logits.index_put_((idx, chosen), torch.zeros((), dtype=logits.dtype, device=dev))
        with self.lock:
            self.pending.append(Forward(self.last_target, rows, host, ready, override, staged))

    def drain(self, wait: bool) -> None:
        """Process pending forwards in order; wait=False stops at the first whose values are not
        on the host yet. A pending forward depends on no host action before its values are ready
        (its gate comes after the copy), so waiting here never deadlocks."""
        if not self.pending:
            return
        with self.lock, torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext():
            while self.pending:
                f = self.pending[0]
                if not wait and not f.ready.query():
                    return
                f.ready.synchronize()
                self.pending.popleft()
                self._process(f)

    def _process(self, f: Forward) -> None:
        seam, link = self.seam, self.link
        values = f.host.tolist()
        steps = [(i, req, int(p), m, int(tok), key) for (i, req, key), (m, tok, p, _) in zip(f.rows, values)]
        need = {i: bool(n) for (i, _, _), (*_, n) in zip(f.rows, values)}
        gated = any(need.values())
        # what the gate lets through: the fast token unless a decision replaces it
        tokens = {i: int(tok) for (i, _, _), (_, tok, _, _) in zip(f.rows, values)}
        try:
            with link.lock:
                live, fails = seam._classify(steps)
            seam._count(live)
            decisions = seam.decide(live, any(need[i] for i, *_ in live))
            for (i, _, _, _, tok, _, _), d in zip(live, decisions):
                if not d.error and not need[i] and d.token != tok:
                    d.error = "mg's control path disagreed with the device's policy"  # never expected

            def repair(req, pos: int, d: P.StepDecision) -> None:
                with torch.cuda.stream(self.side):
                    seam.repair(req, pos, d, out=self.column)

            for i, d in seam.commit(live, decisions, fails, repair):
                tokens[i] = d.token
        finally:
            if gated:  # always open a holding gate, with fast tokens if anything above failed
                for k, (i, _, _) in enumerate(f.rows):
                    f.staged[k] = tokens[i]
                with torch.cuda.stream(self.side):
                    f.override.copy_(f.staged, non_blocking=True)
                    device_gate.release(self.flag, f.target)
                if self.cuda:
                    self.side.synchronize()  # `staged` and the repair column are free again
