"""mg's clean-up on SGLang's own stops, and a bound on SIGTERM's drain (main process only).

SGLang ends its server with `kill_process_tree(own pid)`: SIGKILL to every child, then to
itself, so no atexit handler runs (after SIGTERM's drain, after SIGQUIT, which a crashing child
sends, and on launch failures). mg wraps that function where SGLang's modules hold it: for the
server's own pid it first kills the children (the controller and verifier among them), then runs
mg's clean-up, then lets SGLang finish.

SIGTERM: mg's front admits no more deterministic requests (the queued ones get a 503), and its
running ones are answered before SGLang hears the signal. Why first: SGLang's drain ends when
its own requests are gone and then stops the controller, but a deterministic answer leaves only
after its verdict, which needs the controller. Then SGLang's drain (it waits until no request
id is left in the tokenizer manager). Some requests never leave it (a context-length 400, an
`n > 1` request in this SGLang), so the drain is bounded: `drain_timeout_s` after SIGTERM the
deterministic requests still running are answered with a 503 (or an error event ending their
stream) and the server stops. SIGINT to the main process is the same stop (it becomes SIGTERM).

Ctrl-C in a terminal and a signal to the process group reach every process of the server: all but
the main one ignore SIGINT and SIGTERM (SGLang's scheduler and detokenizer through `sglang_children`,
mg's controller and verifier themselves), so the main process's stop above is the only one.

How a stop ended (`failure()`): a stop that was asked for (SIGTERM, SIGINT) is clean, exit code 0;
SGLang's own stop (SIGQUIT from a crashing child or its watchdog, a failed launch) and a stop mg
asked for after a failure (`fail`: its runtime gave up) exit 1 with the reason.
"""

from __future__ import annotations

import atexit
import functools
import inspect
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

# Modules that imported `kill_process_tree` by name (their calls go through their own global).
_HOLDERS = ("sglang.srt.managers.tokenizer_manager", "sglang.srt.entrypoints.http_server",
            "sglang.srt.entrypoints.engine")


# launch_server's parameters naming SGLang's child-process entry points (scheduler, detokenizer).
CHILD_ENTRIES = ("run_scheduler_process_func", "run_detokenizer_process_func")

# After the drain's bound: the cut answers' last bytes leave before the processes stop.
CUT_FLUSH_S = 1.0
# Set once a stop began (SIGTERM, or SGLang's own stop): children that exit now are expected.
STOPPING = threading.Event()
REQUESTED = threading.Event()  # set by SIGTERM/SIGINT: a stop that was asked for
_failures: list[str] = []  # why the stop is a failure, the first reason first


def fail(reason: str) -> None:
    """The stop about to begin (or under way) is a failure: the server exits 1 with `reason`."""
    _failures.append(reason)


def failure() -> str:
    """Why the stop is a failure ("" for a requested stop that met none)."""
    if _failures:
        return _failures[0]
    return "" if REQUESTED.is_set() else "SGLang stopped the server (its log above says why)"


def install(cleanup: Callable[[], None], drain_timeout_s: float, front: tuple[Callable, Callable, Callable]) -> None:
    """`front`: the HTTP front's (stop admitting, drained?, cut the running) for SIGTERM."""
    import importlib

    from sglang.srt.managers.tokenizer_manager import SignalHandler
    from sglang.srt.utils import common

    original = common.kill_process_tree
    me = os.getpid()

    def kill_process_tree(parent_pid, include_parent: bool = True, **kwargs):  # (skip_pid, wait_timeout, ...)
        if parent_pid is None or parent_pid == me:
            STOPPING.set()
            original(me, include_parent=False, **kwargs)  # children first: nothing writes any more
            try:
                cleanup()
            except Exception:  # noqa: BLE001 - never keep SGLang from stopping
                log.exception("mg clean-up failed")
        return original(parent_pid, include_parent, **kwargs)

    for name in _HOLDERS:
        mod = importlib.import_module(name)
        if getattr(mod, "kill_process_tree", None) is not original:
            raise RuntimeError(f"mg: {name} no longer holds sglang's kill_process_tree; "
                               "mg's shutdown clean-up would not run")
        mod.kill_process_tree = kill_process_tree

    sigquit = getattr(SignalHandler, "running_phase_sigquit_handler", None)
    if sigquit is not None:  # (SGLang's name for it; without it the stop's reason is the generic one)
        def sigquit_fails(self, signum=None, frame=None):
            fail(f"SGLang stopped the server after SIGQUIT: {_dead_children(self)}")
            return sigquit(self, signum, frame)

        SignalHandler.running_phase_sigquit_handler = sigquit_fails

    sigterm = SignalHandler.sigterm_handler

    stop_admitting, drained, cut = front
    started: list[float] = []

    def bounded_sigterm(self, signum=None, frame=None):
        if started:  # a second SIGTERM: the drain runs already
            return
        started.append(time.monotonic())
        REQUESTED.set()
        STOPPING.set()
        log.warning("mg: SIGTERM: draining (at most %.0fs); no new deterministic requests", drain_timeout_s)
        stop_admitting()
        deadline = started[0] + drain_timeout_s

        def drain() -> None:
            while not drained() and time.monotonic() < deadline:
                time.sleep(0.05)
            sigterm(self, signum, frame)  # SGLang's own drain (its watchdog then stops the server)
            while time.monotonic() < deadline:
                time.sleep(0.1)
            n = cut()
            log.warning("mg: requests still draining %.0fs after SIGTERM; %d deterministic answer(s) cut with a 503, "
                        "stopping now", drain_timeout_s, n)
            if n:
                time.sleep(CUT_FLUSH_S)
            kill_process_tree(me, include_parent=True)

        threading.Thread(target=drain, name="mg-drain", daemon=True).start()

    SignalHandler.sigterm_handler = bounded_sigterm

    # Ctrl-C (SIGINT, which uvicorn's server takes while it serves) stops the server as SIGTERM
    # does; a second one goes to uvicorn (its forced exit).
    import uvicorn

    handle_exit = getattr(uvicorn.Server, "handle_exit", None)
    if not callable(handle_exit):
        raise RuntimeError("mg: uvicorn.Server has no handle_exit; Ctrl-C would not drain the server")

    def sigint_drains(self, sig, frame) -> None:
        if sig == signal.SIGINT and not started:
            os.kill(me, signal.SIGTERM)
            return
        handle_exit(self, sig, frame)

    uvicorn.Server.handle_exit = sigint_drains


def _dead_children(handler) -> str:
    """What SGLang's subprocess watchdog (0.5.23) saw die, for the stop's reason."""
    dog = getattr(getattr(handler, "tokenizer_manager", None), "_subprocess_watchdog", None)
    dead = [f"its {name} process exited (code {p.exitcode})"
            for p, name in zip(getattr(dog, "_processes", ()), getattr(dog, "_names", ()))
            if p.exitcode not in (None, 0)]
    return ", ".join(dead) or "a child process reported a failure (or the signal was sent to it)"


def sglang_children(launch_server: Callable) -> dict[str, Callable]:
    """launch_server's keyword arguments that run SGLang's own child entry points (its defaults)
    through `_sglang_child` (picklable: SGLang spawns them)."""
    params = inspect.signature(launch_server).parameters
    return {name: functools.partial(_sglang_child, params[name].default) for name in CHILD_ENTRIES}


def _sglang_child(entry: Callable, *args, **kwargs) -> None:
    """One of SGLang's child processes. Why: a group's SIGINT/SIGTERM killed them before the main
    process could drain (SGLang then reported a crashed child); the main process stops them."""
    from mg_server.wire.liveness import ignore_stop_signals

    ignore_stop_signals()
    ended: list[bool] = []
    atexit.register(_end_quietly, ended)  # runs after the exit handlers registered while it runs
    entry(*args, **kwargs)
    ended.append(True)


def _end_quietly(ended: list[bool]) -> None:
    """After a normal end (the scheduler's, at SGLang's stop) and the exit handlers: exit 0 before
    the interpreter's finalization, whose only output is Triton's nanobind "leaked" report (~30 lines)."""
    if ended:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (AttributeError, OSError, ValueError):  # (none, or closed)
                pass
        os._exit(0)
