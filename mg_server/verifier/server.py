"""The verifier worker process: zmq ROUTER on an ipc:// path.

Entry point: `run_verifier(cfg)` (in the child) or `start_verifier(cfg)` (spawns it). The worker
binds before it loads, so a client's hello simply waits in the queue; if loading fails, the
worker stays up and answers every message with a typed error (`load_failed`, naming the cause)
instead of vanishing. From its first moment it beats and watches the process that started it
(wire.liveness): if that one dies, the worker exits.

On CUDA it starts in two stages, because it computes on SGLang's weights, which SGLang loads
after it: (1) its K/V pool (verifier.budget) is allocated and its first hello answered (`ready`
false) before SGLang starts, so SGLang sizes its own K/V around it; (2) it waits for the weights
SGLang's scheduler shares (wire.weights), builds its model on them and warms its kernels up;
every message that came meanwhile waits, and later hellos say `ready`. On a CPU it loads the
checkpoint itself (a copy is small there) and is ready at its first hello.
Messages are served in arrival order; consecutive Verify messages are coalesced into one batched
step (batch-invariant kernels make that safe); control messages flush pending verifies first.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import threading
import time
import traceback
from dataclasses import replace

import torch
import zmq

from mg_server.config import VerifierConfig
from mg_server.verifier import ranks
from mg_server.wire import protocol as P

__all__ = ["VerifierConfig", "VerifierServer", "run_verifier", "start_verifier"]


def _err(code: str, message: str, msg_id: int = 0) -> P.Error:
    return P.Error(msg_id=msg_id, error=P.ErrorReply(code=code, message=message))


class VerifierServer:
    def __init__(self, cfg: VerifierConfig):
        self.cfg = cfg
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(cfg.endpoint)
        self.engine = None
        self.leader = None  # tensor parallelism: rank 0's followers (verifier/ranks.py)
        self.spec = None  # the model's (verifier.model.ModelSpec), known from stage 1
        self.pool = None  # CUDA: the K/V pool allocated in stage 1, the engine's once it exists
        self.load_error = ""
        self._allocs = 0  # trace_calls: the device's CUDA allocation count after the last call
        self._gc_t0 = 0.0  # trace_calls: when the running collection started
        self.served = self.errors = 0
        self.greeted = False  # a hello was answered (stage 2 begins only then: the launcher waits for it)
        self.running = True

    @property
    def ready(self) -> bool:
        return self.engine is not None

    def reserve(self) -> None:
        """Stage 1 (module doc): on a CPU the whole load; on CUDA the facts and the K/V pool."""
        from mg_server.checkpoint import read_checkpoint
        from mg_server.verifier import budget, ops
        from mg_server.verifier.model import KVPool

        cfg = self.cfg
        try:
            if cfg.num_threads > 0:
                torch.set_num_threads(cfg.num_threads)
            dtype, device = getattr(torch, cfg.dtype), torch.device(cfg.device)
            # the launcher's reading of the checkpoint (its identity: system_fingerprint), else read here
            self.checkpoint = cfg.model if cfg.model is not None and cfg.model.identity else \
                read_checkpoint(cfg.model_path)
            self.spec = self.checkpoint.require_spec()
            self.model_id = self.checkpoint.identity
            # the backend that serves the device; under TP also the degree: its reductions are other sums
            self.kernel_config_id = ops.config_id(device) + (f"-tp{cfg.tp}" if cfg.tp > 1 else "")
            if device.type != "cuda":
                return self._build(None)
            device = torch.device("cuda", device.index or 0)  # (set_device and mem_get_info need an index)
            torch.cuda.set_device(device)
            free, _ = torch.cuda.mem_get_info(device)
            tokens = cfg.pool_tokens or budget.pool_tokens(self.spec, free, cfg.sglang_fraction, cfg.weights_bytes,
                                                           cfg.kv_budget_gb, dtype_bytes=dtype.itemsize)
            self.pool = KVPool(self.spec, tokens, dtype, device)
            self.memory_bytes = torch.cuda.memory_reserved(device)
        except Exception as e:  # noqa: BLE001 - reported to every client, see module doc
            self._load_failed(e)

    def _load_failed(self, e: Exception) -> None:
        self.load_error = f"verifier failed to load {self.cfg.model_path!r}: {type(e).__name__}: {e}"
        traceback.print_exc()

    def finish(self) -> None:
        """Stage 2 on CUDA (module doc): SGLang's weights, the model on them, the kernels warmed up."""
        from mg_server.wire.weights import wait_shared

        try:
            t0 = time.monotonic()
            tensors = wait_shared(os.path.dirname(self.cfg.ipc_path), self.cfg.weights_timeout_s)
            print(f"[mg-verifier] SGLang's weights mapped after {time.monotonic() - t0:.1f}s of waiting", flush=True)
            self._build(tensors)
        except Exception as e:  # noqa: BLE001 - reported to every client, see module doc
            self._load_failed(e)

    def _build(self, shared: dict | None) -> None:
        """The model (on SGLang's tensors, or loaded from the checkpoint) and its engine."""
        from mg_server.verifier.model import VerifierModel

        cfg = self.cfg
        if shared is not None:
            model = VerifierModel.shared(self.spec, shared, getattr(torch, cfg.dtype), cfg.max_seq_len)
        else:
            if cfg.tp > 1:
                self.leader = ranks.Leader(cfg)
            model = ranks.load_model(cfg, self.leader.ranks if self.leader else None, self.checkpoint)
        self.engine = ranks.build_engine(cfg, model, self.pool)
        self.pool = self.engine.pool
        if model.device.type == "cuda":
            self._warm_up()
        if cfg.trace_calls:
            print(f"[mg-verifier] gc: {len(gc.get_objects())} objects tracked, {gc.get_freeze_count()} frozen, "
                  f"thresholds {gc.get_threshold()}", flush=True)
            gc.callbacks.append(self._trace_gc)
        # What the worker holds now (K/V pool, workspace; SGLang's weights are SGLang's): CUDA only
        self.memory_bytes = torch.cuda.memory_reserved(model.device) if model.device.type == "cuda" else 0

    def _warm_up(self) -> None:
        """Compile and load every kernel a verify call launches, now: compiled on a first request,
        they would take it past its deadline."""
        from mg_server.wire import zerocopy

        t0 = time.perf_counter()
        # A short prompt and a step; then several long prompts in one call (chunked graph replays)
        # and a step of each, so the caching allocator holds blocks for the buffers a step
        # allocates on this stream; a seeded request's rows.
        eng = self.engine
        if eng.model.device.type == "cuda":
            zerocopy.warm_up(eng.model.device)
        rids = [f"mg-warm-up-{k}" for k in range(min(8, eng.max_requests))]
        n = max(18, min(150, eng.max_seq_len - 1, (eng.pool.n_tokens - 64) // len(rids)))  # a long prompt that fits
        calls = [[P.VerifyItem(rid=rids[0], pos=16, tokens=[1] * 17)], [P.VerifyItem(rid=rids[0], pos=17, tokens=[1])],
                 # (distinct tokens: alike prompts of one call would be computed once, verifier/prefix.py)
                 [P.VerifyItem(rid=r, pos=n - 2, tokens=[k + 2] * (n - 1)) for k, r in enumerate(rids[1:])],
                 [P.VerifyItem(rid=r, pos=n - 1 if k else 18, tokens=[1]) for k, r in enumerate(rids)],
                 [P.VerifyItem(rid="mg-warm-up-s", pos=16, tokens=[1] * 17, temperature=0.7, seed=1)],
                 [P.VerifyItem(rid="mg-warm-up-s", pos=17, tokens=[1], temperature=0.7, seed=1)]]
        for items in calls:
            for res in self.engine.step(items):
                if isinstance(res, P.ErrorReply):
                    raise RuntimeError(f"warm-up forward failed: [{res.code}] {res.message}")
        for r in [*rids, "mg-warm-up-s"]:
            self.engine.release(r)
        self.engine.drop_cache()  # (the warm-up's blocks are nobody's prefix)
        print(f"[mg-verifier] kernels warmed up in {time.perf_counter() - t0:.1f}s", flush=True)

    # ---- handlers -----------------------------------------------------------------------
    def _hello(self, m: P.Hello) -> P.Message:
        if m.protocol_version != P.PROTOCOL_VERSION:
            return _err(P.ErrorCode.PROTOCOL_MISMATCH,
                        f"server speaks {P.PROTOCOL_VERSION}, client {m.protocol_version}", m.msg_id)
        if m.expect_model_id and m.expect_model_id != self.model_id:
            return _err(P.ErrorCode.MODEL_MISMATCH, f"model {self.model_id} != expected {m.expect_model_id}",
                        m.msg_id)
        if m.expect_kernel_config_id and m.expect_kernel_config_id != self.kernel_config_id:
            return _err(P.ErrorCode.MODEL_MISMATCH,
                        f"kernel config {self.kernel_config_id} != expected {m.expect_kernel_config_id}", m.msg_id)
        s, cfg = self.spec, self.cfg
        self.greeted = True
        return P.HelloReply(
            msg_id=m.msg_id, protocol_version=P.PROTOCOL_VERSION, model_id=self.model_id,
            kernel_config_id=self.kernel_config_id, family=s.family,
            n_layers=s.n_layers, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim, vocab=s.vocab, dtype=cfg.dtype,
            device=str(torch.device(cfg.device)), max_seq_len=cfg.max_seq_len, max_requests=cfg.max_requests,
            pool_tokens=self.pool.n_tokens, memory_bytes=self.memory_bytes, ready=self.ready,
            shared_weights=torch.device(cfg.device).type == "cuda")

    def _verify(self, batch: list[tuple[bytes, P.Verify]]) -> None:
        items, owners = [], []
        now = time.time_ns()
        late: dict[int, P.ErrorReply] = {}
        for k, (_, m) in enumerate(batch):
            for it in m.items:
                if it.deadline_ns and now > it.deadline_ns:
                    late[len(owners)] = P.ErrorReply(code=P.ErrorCode.DEADLINE, rid=it.rid,
                                                     message="deadline passed before the verifier started")
                else:
                    items.append(it)
                owners.append(k)
        trace = self.cfg.trace_calls > 0 and self.engine.model.device.type == "cuda"
        t = [time.perf_counter()]
        allocs = self._alloc_count() if trace else -1
        outs = iter(self._step(items)) if items else iter(())
        t.append(time.perf_counter())
        replies: list[list] = [[] for _ in batch]
        for n, k in enumerate(owners):
            res = late[n] if n in late else next(outs)
            if isinstance(res, P.ErrorReply):
                self.errors += 1
                replies[k].append(res)
                continue
            it = batch[k][1].items[len(replies[k])]
            replies[k].append(self._result(res, it.want_digest))
            self.served += 1
        t.append(time.perf_counter())
        for (ident, m), results in zip(batch, replies):
            self._send(ident, P.VerifyReply(msg_id=m.msg_id, results=results))
        if trace:
            self._trace(items, now, t + [time.perf_counter()], allocs)

    def _step(self, items: list[P.VerifyItem]) -> list:
        """One engine step; under TP every follower makes it first (verifier/ranks.py), at this
        rank's clock. A failed TP step may have left the ranks apart: the worker then stops
        (after these replies), and the controller starts a new one."""
        now = time.monotonic()
        if self.leader is None:
            return self.engine.step(items, now)
        try:
            self.leader.send(ranks.STEP, items, now)
            out = self.engine.step(items, now)
        except Exception:
            self.running = False
            raise
        if any(isinstance(r, P.ErrorReply) and r.code == P.ErrorCode.INTERNAL for r in out):
            print("[mg-verifier] a tensor-parallel step failed; stopping (the controller starts a new worker)",
                  flush=True)
            self.running = False
        return out

    def _alloc_count(self) -> int:  # (-1: not counted; memory_stats builds a big dict, its garbage feeds gc)
        if self.cfg.trace_calls < 2:
            return -1
        return torch.cuda.memory_stats(self.engine.model.device).get("num_device_alloc", 0)

    def _trace_gc(self, phase: str, info: dict) -> None:
        """cfg.trace_calls: log each garbage collection of this process that takes over 5 ms."""
        if phase == "start":
            self._gc_t0 = time.perf_counter()
        elif (ms := 1e3 * (time.perf_counter() - self._gc_t0)) > 5:
            print(f"[mg-verifier] {time.time():.3f} gc of generation {info['generation']} took {ms:.1f} ms "
                  f"({info['collected']} collected, {gc.get_freeze_count()} objects frozen) in thread "
                  f"{threading.current_thread().name}", flush=True)

    def _trace(self, items: list[P.VerifyItem], now_ns: int, t: list[float], before: int) -> None:
        """cfg.trace_calls: one line per call. Why the deadline: the controller stamps each item's
        deadline as its send time + verify_timeout_s, so the time left says how long the call
        waited before this worker took it."""
        after = self._alloc_count()
        left = min((it.deadline_ns - now_ns) / 1e6 for it in items) if items else 0.0
        ms = [1e3 * (b - a) for a, b in zip(t, t[1:])]
        print(f"[mg-verifier] {time.time():.3f} call of {len(items)} items, {sum(len(it.tokens) for it in items)} "
              f"rows: step {ms[0]:.2f} ms, results {ms[1]:.2f} ms, send {ms[2]:.2f} ms; deadline in "
              f"{left:.1f} ms at the start" + (f"; CUDA allocations {before - self._allocs} since the last call, "
                                                f"{after - before} during it" if after >= 0 else ""), flush=True)
        self._allocs = after

    def _result(self, res, digest: bool) -> P.VerifyResult:
        """The wire form of an engine result."""
        return P.VerifyResult(
            rid=res.rid, pos=res.pos, token=res.token, margin=res.margin,
            audit_tokens=res.audit_tokens, audit_margins=res.audit_margins,
            first_mismatch=res.first_mismatch, digest=res.digest if digest else b"", reused=res.reused,
            batch_rows=res.batch_rows, batch_requests=res.batch_requests, forward_ms=res.forward_ms)

    def _control(self, m: P.Message) -> P.Message:
        if isinstance(m, P.Hello):
            return self._hello(m)
        if isinstance(m, P.Release):
            if self.leader is not None:
                self.leader.send(ranks.RELEASE, list(m.rids))
            return P.Ack(msg_id=m.msg_id, n=sum(self.engine.release(r) for r in m.rids))
        if isinstance(m, P.Stats):
            e = self.engine
            return P.StatsReply(msg_id=m.msg_id, requests=len(e.seqs), pool_tokens_used=e.pool_used,
                                pool_tokens=e.pool.n_tokens, served_items=self.served,
                                forwards=e.forwards, errors=self.errors, cached_tokens=e.cache.idle_slots,
                                reused_rows=e.cache.hits)
        if isinstance(m, P.Shutdown):
            self.running = False
            return P.Ack(msg_id=m.msg_id)
        return _err(P.ErrorCode.BAD_REQUEST, f"unexpected message {type(m).__name__}", m.msg_id)

    # ---- loop ---------------------------------------------------------------------------
    def _send(self, ident: bytes, msg: P.Message) -> None:
        self.sock.send_multipart([ident, P.encode(msg)])

    def _handle_batch(self, frames: list[list[bytes]]) -> None:
        pending: list[tuple[bytes, P.Verify]] = []

        def flush():
            if pending:
                try:
                    self._verify(pending)
                except Exception as e:  # noqa: BLE001 - the worker survives; callers get an error
                    traceback.print_exc()
                    for ident, m in pending:
                        self._send(ident, _err(P.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", m.msg_id))
                pending.clear()

        for fr in frames:
            ident = fr[0]
            try:
                m = P.decode(fr[-1])
            except Exception as e:  # noqa: BLE001 - malformed bytes
                self.errors += 1
                self._send(ident, _err(P.ErrorCode.BAD_REQUEST, f"undecodable message: {e}"))
                continue
            if self.load_error and not isinstance(m, P.Shutdown):
                self._send(ident, _err(P.ErrorCode.LOAD_FAILED, self.load_error, m.msg_id))
                continue
            if not self.ready and not self.load_error and not isinstance(m, (P.Hello, P.Shutdown)):
                self._finish_now()  # (stage 2: this message waits for it, as do the rest)
            if isinstance(m, P.Verify):
                if not 0 < len(m.items) <= self.cfg.max_batch_items:
                    n = self.cfg.max_batch_items
                    self._send(ident, _err(P.ErrorCode.BAD_REQUEST, f"{len(m.items)} items; 1..{n} per message",
                                           m.msg_id))
                    continue
                pending.append((ident, m))
                if sum(len(x.items) for _, x in pending) >= self.cfg.max_batch_items:
                    flush()
                continue
            flush()
            try:
                reply = self._control(m)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                reply = _err(P.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}", m.msg_id)
            self._send(ident, reply)
        flush()

    def _finish_now(self) -> None:
        self.finish()
        if self.load_error:
            print(f"[mg-verifier] {self.load_error}", flush=True)

    def serve_forever(self) -> None:
        try:
            while self.running:
                if self.greeted and not self.ready and not self.load_error and not self.sock.poll(0):
                    self._finish_now()  # stage 2 once the first hellos are answered (module doc)
                    continue
                if not self.sock.poll(self.cfg.poll_ms):
                    if self.leader is not None:
                        self.leader.keep()  # (a follower's wait for the next call has a timeout)
                    continue
                frames = []
                while len(frames) < self.cfg.max_batch_items:  # drain what is queued: one batch
                    try:
                        frames.append(self.sock.recv_multipart(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                self._handle_batch(frames)
        finally:
            self.close()

    def close(self) -> None:
        if self.leader is not None:
            self.leader.stop()
        self.sock.close(0)
        self.ctx.term()


def run_verifier(cfg: VerifierConfig) -> None:
    """Process entry point: bind, load, serve until a Shutdown message (or the parent is gone)."""
    from mg_server.wire.channel import set_process_title
    from mg_server.wire.liveness import Lifeline, beat_path, ignore_stop_signals

    ignore_stop_signals()  # a group's SIGINT/SIGTERM: the controller stops this one
    set_process_title("mg::verifier")
    server = VerifierServer(cfg)
    lifeline = Lifeline(beat_path(cfg.ipc_path), cfg.parent_pid, lambda: None, "mg-verifier-life")
    lifeline.start()
    try:
        server.reserve()
        server.serve_forever()
    finally:
        lifeline.stop()


def start_verifier(cfg: VerifierConfig) -> mp.Process:
    """Spawn a worker process (spawn start method: no forked torch/zmq state) that stops once
    this process is gone."""
    cfg = replace(cfg, parent_pid=os.getpid())
    proc = mp.get_context("spawn").Process(target=run_verifier, args=(cfg,), name="mg-verifier", daemon=True)
    proc.start()
    return proc
