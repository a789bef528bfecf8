"""mg's clean-up on SGLang's own stops, and a bound on SIGTERM's drain (main process only).

SGLang ends its server with `kill_process_tree(own pid)`: SIGKILL to every child, then to
itself, so no atexit handler runs (after SIGTERM's drain, after SIGQUIT, which a crashing child
sends, and on launch failures). mg wraps that function where SGLang's modules hold it: for the
server's own pid it first kills the children (the controller and verifier among them), then runs
mg's clean-up, then lets SGLang finish. SIGTERM's drain waits until no request id is left in the
tokenizer manager, and some requests never leave it (a context-length 400, an `n > 1` request
in this SGLang), so mg bounds the drain: `drain_timeout_s` after SIGTERM the server stops anyway.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Callable

log = logging.getLogger(__name__)

# Modules that imported `kill_process_tree` by name (their calls go through their own global).
_HOLDERS = ("sglang.srt.managers.tokenizer_manager", "sglang.srt.entrypoints.http_server",
            "sglang.srt.entrypoints.engine")


def install(cleanup: Callable[[], None], drain_timeout_s: float) -> None:
    import importlib

    from sglang.srt.managers.tokenizer_manager import SignalHandler
    from sglang.srt.utils import common

    original = common.kill_process_tree
    me = os.getpid()

    def kill_process_tree(parent_pid, include_parent: bool = True, **kwargs):  # (skip_pid, wait_timeout, ...)
        if parent_pid is None or parent_pid == me:
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

    sigterm = SignalHandler.sigterm_handler

    def bounded_sigterm(self, signum=None, frame=None):
        sigterm(self, signum, frame)

        def stop_after_drain() -> None:
            time.sleep(drain_timeout_s)
            log.warning("mg: requests still draining %.0fs after SIGTERM; stopping now", drain_timeout_s)
            kill_process_tree(me, include_parent=True)

        threading.Thread(target=stop_after_drain, name="mg-drain-bound", daemon=True).start()

    SignalHandler.sigterm_handler = bounded_sigterm
