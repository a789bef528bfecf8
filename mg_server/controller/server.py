"""The controller process: MarginGate policy, verifier dispatch, audit, counters.

It owns the verifier worker (spawned as its child: controller/worker.py), and watches its beat.
Clients: mg's forward hook in SGLang's scheduler (one-way: `Arrive` as a deterministic request
reaches it, controller/arrivals.py; `Step` per fast-path forward, every protected row; `Finish` as
one ends; and `WindowNews`, `CheckTail` for its window commit) and the HTTP front (`Verdict`);
the verifier's K/V pool is taken in order (controller/pool.py). Every row was committed fast; the policy
only says how soon it is checked (controller/window.py): the pending rows of every request go to
the verifier in one message (it serves them in one batched, batch-invariant forward), each
carrying the tokens the verifier has not seen, so its catch-up audits every token decided so
far; `Finish` audits the tail. A request's verdict is `verified` only when its answer is complete
(it was not aborted) and every emitted token has been checked against the verifier.

Faults: the controller beats and watches its parent from its first moment (wire.liveness).
A verify call gives up as soon as the verifier process exits or stops beating; the rows of that
call fail, later deterministic steps fail at once, plain traffic goes on, and the beat's status
(read by the front's /health) and `mg_verifier_up` say the verifier is down. A verifier that
exited or stays wedged is restarted, the requests it held failed (controller/worker.py). If the
verifier cannot start at first, the controller answers the launcher's hello with the verifier's
own error and exits (code 1); after too many failed restarts it exits with GAVE_UP_EXIT.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from dataclasses import replace

import zmq

from mg_server.controller.arrivals import ArrivalMixin
from mg_server.controller.audit import AuditMixin
from mg_server.controller.catchup import catch_up
from mg_server.controller.correct import AnswerCompletion
from mg_server.controller.pool import Held, PoolMixin
from mg_server.controller.state import ReqState
from mg_server.controller.window import WindowMixin
from mg_server.controller.worker import WorkerMixin
from mg_server.config import ControllerConfig, VerifierConfig
from mg_server.policy import Policy
from mg_server.wire import protocol as P
from mg_server.wire.liveness import Lifeline, Restarts, beat_path, ignore_stop_signals

log = logging.getLogger("mg.controller")

CHECK_ITEMS = VerifierConfig.max_batch_items  # checks per verify call without a verifier config
IDLE_AUDITS = 8  # finished requests' tail audits per idle turn (one verify call; a Step waits at most that long)
START_ERROR_LINGER_S = 30.0  # a verifier that did not start: how long its error waits for the launcher's hello


class Controller(ArrivalMixin, AuditMixin, PoolMixin, WindowMixin, WorkerMixin):
    def __init__(self, cfg: ControllerConfig, lifeline: Lifeline | None = None):
        from mg_server.metrics import controller_metrics

        self.cfg = cfg
        self.lifeline = lifeline  # its status line tells the front whether the verifier is up
        self.policy = Policy(cfg.mode, cfg.tau)
        self.m = controller_metrics()
        self.reqs: dict[str, ReqState] = {}
        # Finished requests whose tail audit waits until no Step is queued (or their verdict is
        # asked for): a Step holds up an SGLang forward, an audit holds up nobody yet.
        self.pending: dict[str, None] = {}
        self.checks: dict[str, list[int]] = {}  # rid -> its low-margin positions to check (window.py)
        self.parked: dict[str, list[int]] = {}  # checks the verifier's pool has no room for yet (pool.py)
        self.arrivals: dict[str, None] = {}  # arrived requests whose prompt is not computed yet, in order
        self._arrivals_swept = 0.0  # monotonic time of the last sweep of stale arrivals
        self._prefilled = False  # the last idle turn computed arrivals (due checks go next)
        # Disagreements the seam has not been told yet (controller/window.py).
        self.rollbacks: dict[str, P.Rollback] = {}
        self.forwards = 0  # Steps so far (a forward each)
        self.window_due: int | None = None  # the forward count at which the window checks are due
        # Missed flips' completions in progress, one slice per verdict ask (audit._verdict).
        self.completing: dict[str, AnswerCompletion] = {}
        self.verifier_proc = None
        self.vclient = None
        self.vinfo: P.HelloReply | None = None
        self.start_error: P.ErrorReply | None = None  # the verifier could not start: told to the launcher
        self.down_reason = ""  # why the verifier is down ("" while it is up), as last reported
        self._beat_checked = 0.0  # monotonic time of the last look at the verifier's beat
        self._verifier_beat = ""  # the verifier's beat file (wire.liveness)
        self._start = None  # a worker start in progress (worker.VerifierStart)
        self._restart_at: float | None = None  # when the next start is due (a lost worker's backoff)
        self._lost_at = 0.0  # when the last worker was lost
        self.restarts = Restarts()
        self.exit_code = 0  # the process's, once serve_forever returns
        self.hellos: list[tuple[bytes, P.ControllerHello]] = []  # hellos waiting for the first start
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("ipc://" + cfg.ipc_path)
        self.running = True

    # ---- messages -----------------------------------------------------------------------
    def handle(self, msg: P.Message) -> P.Message | None:
        if self.start_error is not None:  # the verifier did not start: say why, then stop
            if isinstance(msg, (P.ControllerHello, P.Shutdown)):
                self.running = False
            return P.Error(error=self.start_error)
        if isinstance(msg, P.Arrive):
            self._arrive(msg)  # (one-way, like Step)
            return None
        if isinstance(msg, P.Step):
            self._step(msg.rows)  # (one-way: errors stay in the requests' states, i.e. their verdicts)
            return None
        if isinstance(msg, P.Finish):
            self._finish(msg)  # (one-way, like Step)
            return None
        if isinstance(msg, P.Verdict):
            return self._verdict(msg.rid, msg.correct)
        if isinstance(msg, P.WindowNews):
            rollbacks, self.rollbacks = list(self.rollbacks.values()), {}
            return P.WindowNewsReply(rollbacks=rollbacks, verified=self._window_progress())
        if isinstance(msg, P.CheckTail):
            return self._check_tail(msg.rid)
        if isinstance(msg, P.ControllerHello):
            up, f = self.verifier_up(), self.verifier_facts()
            return P.ControllerInfo(
                protocol_version=P.PROTOCOL_VERSION, mode=self.cfg.mode, tau=self.cfg.tau,
                verifier_up=up,
                kernel_config_id=f.kernel_config_id if f else "", model_id=f.model_id if f else "",
                verifier_device=f.device if f else "",
                verifier_dtype=f.dtype if f else "", verifier_pool_tokens=f.pool_tokens if f else 0,
                verifier_max_requests=f.max_requests if f else 0, verifier_memory_bytes=f.memory_bytes if f else 0,
            )
        if isinstance(msg, P.Shutdown):
            self.running = False
            return P.Ack()
        return P.Error(error=P.ErrorReply(code=P.ErrorCode.BAD_REQUEST, message=f"unexpected {type(msg).__name__}"))

    def _step(self, rows: list[P.StepRow]) -> None:
        if rows:
            self.forwards += 1
        for row in rows:
            st = self._state_for(row)
            if st.finished_at:  # a look-ahead row reported after its request's Finish: never emitted
                self.m.lookahead.inc()
                continue
            if row.epoch != st.epoch and not st.error:  # a timeline cut already
                self.m.stale_steps.inc()
                continue
            if not st.error and row.pos != len(st.tokens) - 1:
                st.error = f"position mismatch: controller holds {len(st.tokens)} tokens, step at position {row.pos}"
            if not st.error and self.cfg.mode != "off" and not self.verifier_up():
                st.error = "deterministic verifier is not running"
            if not st.error:  # committed fast; checked in windows (controller/window.py)
                self._window_step(row, st)
                if st.steps == 1:
                    self._first_token(row.rid, st)

    def _state_for(self, row: P.StepRow) -> ReqState:
        """The request's state; its first step (the one carrying the prompt) creates it."""
        st = self.reqs.get(row.rid)
        if row.prompt and st is not None and st.arrived_at and not st.finished_at:  # its Arrive came first
            if not st.error and st.tokens == list(row.prompt) and (st.temperature, st.seed) == (row.temperature,
                                                                                                 row.seed):
                st.arrived_at = 0.0
                return st
            # another prompt under its id, or its arrival failed: start afresh (the verifier drops what it holds)
            self.arrivals.pop(row.rid, None)
            return self._new_request(row.rid, ReqState.of_prompt(row.prompt, row.temperature, row.seed, rewind=True))
        if not row.prompt:
            if st is None:
                st = self.reqs[row.rid] = ReqState(error="step of a request the controller never saw start")
            return st
        if st is not None and not st.finished_at:
            st.error = st.error or f"request id {row.rid!r} started twice"
            return st
        return self._new_request(row.rid, ReqState.of_prompt(row.prompt, row.temperature, row.seed))

    def _new_request(self, rid: str, st: ReqState) -> ReqState:
        """`st` under `rid`, replacing an earlier request of that id (a finished one's verdict and
        parked checks), as the youngest: new requests enter the verifier's pool oldest first."""
        self.pending.pop(rid, None)
        self.parked.pop(rid, None)
        self.reqs.pop(rid, None)
        self.reqs[rid] = st
        return st

    def _catch_up(self, rid: str, st: ReqState, pos: int) -> str:
        """All but the last chunk of what the verifier has not seen before pos (controller.catchup)."""
        return catch_up(st, pos, self._rows_per_call(), lambda end: self._item(rid, st, end), self._call_verifier,
                        lambda res: self._audit(rid, st, res))

    def _verify(self, items: list[P.VerifyItem], recompute: bool = True) -> list[P.VerifyResult | P.ErrorReply]:
        """The items' results, in as few calls as the verifier accepts (`_calls`)."""
        return [res for part in self._calls(items) for res in self._call_verifier(part, recompute)]

    def _call_verifier(self, items: list[P.VerifyItem], recompute: bool = True) -> list[P.VerifyResult | P.ErrorReply]:
        """One verify call (its items share one batched forward), timed; errors become replies; a
        request the verifier evicted is computed again (not with `recompute` False: pool.py)."""
        from mg_server.verifier.client import VerifierError

        t0 = time.perf_counter()
        self._fresh_deadlines(items)
        try:
            if self.vclient is None:  # lost during this turn (worker.py): no worker to ask
                raise VerifierError(P.ErrorCode.PEER_DOWN, self.down_reason or "no verifier")
            results = self.vclient.verify_many(items)
            self.m.reused_rows.inc(sum(r.reused for r in results if not isinstance(r, P.ErrorReply)))
        except VerifierError as e:
            results = [P.ErrorReply(code=e.code, message=e.message) for _ in items]
            self.verifier_up()  # a verifier that died or stopped is reported down at once (/health, mg_verifier_up)
        self.m.verify_seconds.observe(time.perf_counter() - t0)
        if ok := [r for r in results if not isinstance(r, P.ErrorReply)]:  # one forward served them all
            self.m.verifier_forward_seconds.observe(ok[0].forward_ms / 1e3)
            self.m.verify_rows.observe(ok[0].batch_rows)
        for k, (it, res) in enumerate(zip(items, results)):
            if (recompute and isinstance(res, P.ErrorReply) and res.code == P.ErrorCode.UNKNOWN_REQUEST
                    and it.rid in self.reqs):
                results[k] = self._recompute(it)
        return results

    def _run_checks(self, first: str = "") -> None:
        """Check the requests with steps to check in one call; `first` (the finish barrier's) before
        the others, never deferred; one the verifier's pool has no room for is parked (pool.py)."""
        todo, self.checks = self.checks, {}
        room, waiting, batch = self._pool_room(), False, []  # waiting: a new one is parked (the younger wait)
        held = self._pool_held() if room else None  # what the pool holds, shared prompt blocks once
        call = Held(self._rows_per_call())  # this call's requests, all in the pool at once
        for rid, positions in self._check_order(todo, first):
            st = self.reqs.get(rid)
            if st is None or st.error or st.finished_at or st.mismatches or st.freed:
                continue  # gone, failed, diverged already, finished (its tail audit covers it), or its end checked
            new = rid != first and not self._holds(st)
            if new and room and (waiting and self._waits_parked(st) or not self._may_enter(st, held, room)):
                self._park(rid, positions)  # until a request leaves the pool
                waiting = True
                continue
            if room and batch and call.tokens + call.need(st) > room:
                self.checks[rid] = positions  # next turn: together they would evict each other in the pool
                continue
            for h in (call, held) if held is not None else (call,):
                h.take_new(rid, st) if new else h.take(rid, st, len(st.tokens))
            pos = len(st.tokens) - 2  # up to the latest decided token t_{pos+1}
            if not self.verifier_up():
                st.error = "deterministic verifier is not running"
            else:
                st.error = self._catch_up(rid, st, pos)
            if not st.error and not st.mismatches:
                batch.append((rid, st, pos, positions))
            elif st.mismatches:
                self._diverged(rid, st)
        if not batch:
            return
        results = self._verify([self._item(rid, st, pos) for rid, st, pos, _ in batch], recompute=False)
        for (rid, st, pos, positions), res in zip(batch, results):
            if isinstance(res, P.ErrorReply) and res.code == P.ErrorCode.UNKNOWN_REQUEST:
                if self._evicted(rid, st, positions, first):
                    continue
                res = self._recompute(P.VerifyItem(rid=rid, pos=pos, tokens=[]))
            if isinstance(res, P.ErrorReply):
                st.error = f"verifier: [{res.code}] {res.message}"
                self.m.verify_errors.inc()
                continue
            self.m.verify.inc()
            self._audit_through(rid, st, pos, res, "checked token")
            st.verified.extend(positions)
            if st.mismatches:
                self._diverged(rid, st)
            else:
                st.checked = pos + 2 - st.prompt_len
                self._free_checked_end(rid, st)

    def _fresh_deadlines(self, items: list[P.VerifyItem]) -> None:
        """The verify timeout counts from this call (items of a split check wait for the calls before)."""
        deadline = time.time_ns() + int(self.cfg.verify_timeout_s * 1e9)
        for it in items:
            it.deadline_ns = deadline

    def _calls(self, items: list[P.VerifyItem]) -> list[list[P.VerifyItem]]:
        """Items in verify calls of at most the verifier's items per message (max_batch_items) and, beyond
        one item, at most `_rows_per_call` rows: the verify timeout bounds a call whatever the
        number of requests checked."""
        slots = self.cfg.verifier.max_batch_items if self.cfg.verifier else CHECK_ITEMS
        budget = self._rows_per_call()
        calls: list[list[P.VerifyItem]] = []
        rows = 0
        for it in items:
            if not calls or len(calls[-1]) >= slots or rows + len(it.tokens) > budget:
                calls.append([])
                rows = 0
            calls[-1].append(it)
            rows += len(it.tokens)
        return calls

    def _rows_per_call(self) -> int:
        """Rows of a verify call beyond one item, and of one catch-up chunk: `catchup_chunk` on a CPU
        verifier, 16 x on a GPU one, where such a forward takes ~0.1 s."""
        v = self.cfg.verifier
        return self.cfg.catchup_chunk * (1 if v is None or v.device == "cpu" else 16)

    def _item(self, rid: str, st: ReqState, pos: int) -> P.VerifyItem:
        """Verify position pos after teaching the verifier every token it has not seen yet (after a
        rollback, with VerifyItem.rewind: it drops its positions past the cut first)."""
        rewind, st.rewind = st.rewind, False
        return P.VerifyItem(rid=rid, pos=pos, tokens=st.tokens[st.verifier_len:pos + 1], rewind=rewind,
                            prompt_len=st.prompt_len if st.verifier_len == 0 else 0,
                            temperature=st.temperature, seed=st.seed,
                            deadline_ns=time.time_ns() + int(self.cfg.verify_timeout_s * 1e9))

    # ---- loop -----------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Serve until Shutdown, a verifier that gave up, or (a verifier that did not start)
        until the launcher has heard why (START_ERROR_LINGER_S at most). Orphaning is the
        lifeline's job: it exits the process whatever this loop is doing."""
        failed_at = None  # when the first start's error was known
        while self.running:
            if self.hellos and not self.verifier_starting():  # the first start is over: say how
                for ident, hello in self.hellos:
                    self._reply(ident, hello)
                self.hellos = []
                continue
            if self.start_error is not None:
                failed_at = failed_at or time.monotonic()
                if time.monotonic() - failed_at > START_ERROR_LINGER_S:
                    break
            busy = self._arrivals_ready() or self.pending or self._checks_due()  # idle work waits: no blocking poll
            # (a start in progress is looked at every 50 ms: the launcher's hello waits for it)
            if not self.sock.poll(0 if busy else 50 if self._start is not None else 200):
                self._idle_turn()
                continue
            ident, data = self.sock.recv_multipart()
            try:
                msg = P.decode(data)
            except Exception as e:  # noqa: BLE001 - a bad message gets a typed error
                self.sock.send_multipart([ident, P.encode(P.Error(error=P.ErrorReply(
                    code=P.ErrorCode.BAD_REQUEST, message=str(e))))])
                continue
            if isinstance(msg, P.ControllerHello) and self.verifier_starting():
                self.hellos.append((ident, msg))  # answered once the verifier is up (or did not start)
                continue
            self._reply(ident, msg)

    def _reply(self, ident: bytes, msg: P.Message) -> None:
        try:
            reply = self.handle(msg)
        except Exception as e:  # noqa: BLE001 - the controller survives a bad request
            log.exception("controller error")
            reply = P.Error(error=P.ErrorReply(code=P.ErrorCode.INTERNAL, message=repr(e)))
        if reply is None:  # a one-way report
            return
        reply.msg_id = msg.msg_id
        self.sock.send_multipart([ident, P.encode(reply)])

    def _idle_turn(self) -> None:
        # idle: arrived prompts (a first token waits for them) and due checks take turns, so a
        # stream of long arrivals never holds the running requests' checks back
        prefill = self._arrivals_ready() and not (self._checks_due() and self._prefilled)
        self._prefilled = prefill
        if prefill:
            self._prefill_arrivals()
        elif self._checks_due():  # idle: due checks
            if self.window_due is not None:
                self._all_window_checks()
            self._run_checks()
        elif self.pending:  # idle: run deferred tail audits, a few at a time (a Step may come)
            self._complete(list(self.pending)[:IDLE_AUDITS])
        else:  # idle: notice a dead verifier without traffic (health, metrics), tend its restart
            self.verifier_up()
            self._count_live()
            self._sweep_arrivals()

    def close(self) -> None:
        self.stop_verifier()
        self.sock.close(0)
        self.ctx.term()


def run_controller(cfg: ControllerConfig) -> None:
    from mg_server.wire.channel import set_process_title

    ignore_stop_signals()  # a group's SIGINT/SIGTERM: the main process stops this one
    set_process_title("mg::controller")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = cfg.metrics_dir  # before the first metric exists
    logging.basicConfig(level=logging.INFO, format="[mg-controller %(asctime)s] %(message)s")
    # Orphaned (mg-server killed): exit; the verifier's own lifeline then stops it.
    from mg_server.wire.cleanup import remove_instance  # orphaned (kill -9): nobody else removes its files
    lifeline = Lifeline(beat_path(cfg.ipc_path), cfg.parent_pid, lambda: remove_instance(
        (os.path.dirname(cfg.ipc_path), cfg.metrics_dir)),
        name="mg-controller-life", status=cfg.start_status).start()
    ctl = Controller(cfg, lifeline)
    try:
        ctl.start_verifier()  # in the background: the launcher's hello waits for it (serve_forever)
        ctl.serve_forever()
    finally:
        lifeline.stop()
        ctl.close()
    if ctl.exit_code or ctl.start_error is not None:
        raise SystemExit(ctl.exit_code or 1)


def start_controller(cfg: ControllerConfig) -> mp.Process:
    """Spawn the controller (not a daemon: it spawns the verifier worker itself)."""
    cfg = replace(cfg, parent_pid=os.getpid())
    proc = mp.get_context("spawn").Process(target=run_controller, args=(cfg,), name="mg-controller")
    proc.start()
    return proc
