"""The controller as part of SGLang's scheduler process (`serve --mg-controller-in scheduler`, the
default (`auto`) whenever the verifier is there too: `--mg-verifier-in scheduler`).

Why: with the verifier a thread of the scheduler process and the controller a process of its
own, a forward whose rows need the verifier waits for seam -> controller -> verifier ->
controller -> seam, four socket hops around the verifier's ~1.5 ms forward, and a py-spy profile
on an H100 found SGLang's scheduler thread blocked in that call 34 % of its time at batch 8
(benchmarks/results/gpu/HISTORY.md, "Where a lag step's time goes"). Here the seam's steps call
the controller, and the controller its verifier, as functions in the caller's thread: the same
Controller object, the same messages and verifier, no socket and no thread hand-over on that path.

Measured on H100s: in the fifth session the controller's verify call went from 2.00 to 1.76-1.93
ms and the bs-8 step's overhead did not move (+17 % against +17 %, +18 % against +17 %, two A/B
sweeps). In the sixth, a CUDA-event timeline found every verify step waiting for the seam's call
(the call 3.05 ms through the sockets, 2.15 ms direct), and the overhead fell from +37 to +22 %
(that timeline) and from +46 to +31 % (a sweep) with the controller here ("Fused prologue
matmuls, and what one verify call costs a bs-8 step"). Never slower: hence the default.

What stays as it was: the controller's socket, served by a thread of this process, for every
other client (the front's verdicts, the seam's Finish and Stops, the launcher's Shutdown), so a
Finish still wakes the loop that runs its tail audit; its beat file (the front's /health); its
idle work. One lock (Controller.lock) serialises the direct calls and that thread.
"""

from __future__ import annotations

import logging
import queue
import threading

from mg_server.runtime import protocol as P
from mg_server.runtime.channel import RpcError
from mg_server.runtime.controller.client import ControllerClient
from mg_server.runtime.controller.server import Controller, ControllerConfig
from mg_server.runtime.liveness import Lifeline, beat_path

log = logging.getLogger(__name__)


class ControllerHost:
    """Runs a Controller in this process: its socket loop in a daemon thread, its verifier the
    in-process worker (`worker`: a VerifierThread started without its socket thread)."""

    def __init__(self, cfg: ControllerConfig, worker):
        from mg_server.runtime.verifier.thread import DirectVerifierClient

        self.lifeline = Lifeline(beat_path(cfg.ipc_path), 0, name="mg-controller-life")  # lives with this process
        self.controller = Controller(cfg, self.lifeline)
        self.controller.direct_verifier = DirectVerifierClient(worker)
        self.lifeline.start()
        self.controller.start_verifier()  # (spawn_verifier False: it connects at the first verifier_up)
        self.thread = threading.Thread(target=self._serve, name="mg-controller", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            self.controller.serve_forever()
        finally:
            self.lifeline.stop()

    def client(self, timeout_s: float, client_name: str = "hook") -> "DirectControllerClient":
        return DirectControllerClient(self.controller, timeout_s, client_name)


class DirectControllerClient:
    """The part of ControllerClient's interface the seam's link uses (under its rpc_lock): `step`
    and `report` call the controller in the caller's thread; `hello` and `finish` go through the
    socket (module doc), whose replies are not on a forward's path."""

    def __init__(self, controller: Controller, timeout_s: float, client_name: str):
        self.controller = controller
        self.sock = ControllerClient(controller.cfg.ipc_path, timeout_s=timeout_s, client_name=client_name)
        self._ahead: queue.SimpleQueue | None = None  # verify_ahead's jobs (rows, done), started at its first

    def _direct(self, msg: P.Message) -> P.Message | None:
        with self.controller.lock:
            reply = self.controller.handle(msg)
        if isinstance(reply, P.Error):
            raise RpcError.of(reply.error)
        return reply

    def step(self, rows: list[P.StepRow], timeout_s: float | None = None) -> list[P.StepDecision]:
        return self._direct(P.Step(rows=rows)).decisions

    def report(self, rows: list[P.StepRow]) -> None:
        self._direct(P.Step(rows=rows, reply=False))

    def verify_ahead(self, rows: list[P.AheadRow]) -> threading.Event:
        """`--mg-verify-ahead` (controller/ahead.py): send the rows to the controller from a thread
        of this client's, in order; the event is set once the controller has handled them (or
        failed to: then the Step verifies those rows itself)."""
        if self._ahead is None:
            self._ahead = queue.SimpleQueue()
            threading.Thread(target=self._ahead_loop, name="mg-verify-ahead", daemon=True).start()
        done = threading.Event()
        self._ahead.put((rows, done))
        return done

    def ahead_answer(self, rid: str, pos: int) -> P.VerifyResult | None:
        """The answer kept for the request's step at pos (verified ahead or chained), if any; it
        stays kept for that step's Step (lagcommit.answer_ahead writes it to a gate first)."""
        with self.controller.lock:
            res = self.controller.chained.get(rid)
        return res if res is not None and res.pos == pos else None

    def _ahead_loop(self) -> None:
        failing = False
        while True:
            rows, done = self._ahead.get()
            try:
                self._direct(P.VerifyAhead(rows=rows))
                failing = False
            except Exception as e:  # noqa: BLE001 - the Steps verify these rows themselves
                if not failing:
                    log.warning("mg: a verify-ahead call failed (%s: %s); the steps verify themselves",
                                type(e).__name__, e)
                failing = True
            finally:
                done.set()

    def hello(self, timeout_s: float | None = None) -> P.ControllerInfo:
        return self.sock.hello(timeout_s)

    def finish(self, msg: P.Finish, timeout_s: float | None = None) -> None:
        self.sock.finish(msg, timeout_s)
