"""mg's runtime processes from the main process: the controller (which starts the verifier) is
spawned, then SGLang starts while they load, and the front joins SGLang's app once they report
ready. Why in parallel: each start took ~15 s (CPU) before SGLang's own ~20 s began.

Ordering without a race: the seam asks the controller its hello from SGLang's scheduler while the
scheduler starts (seam.link), so SGLang is never ready before the controller; and the app builds its
middleware stack at its first call (uvicorn's start-up), which waits here until the front is added.
A runtime that fails to start stops SGLang's processes, says why, and exits 1.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mg_server import env
from mg_server.config import ServeConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Runtime:
    proc: object  # the controller's multiprocessing.Process
    ipc_path: str  # the controller's socket
    tau: float
    tau_source: str  # where tau came from (flag, profile file, shipped profile)
    start_timeout_s: float


def verifier_pool_tokens(context_len: int) -> int:
    """The verifier's K/V pool (tokens) when no memory budget sizes it: two longest sequences."""
    return max(16384, 2 * context_len)


def spawn(cfg: ServeConfig, context_len: int = 4096) -> Runtime | None:
    """Spawn the controller (it starts the verifier) and return at once; None in mode "off". The
    verifier accepts sequences as long as SGLang's (`context_len`), its pool holds two of them."""
    if cfg.mg_mode == "off":
        return None
    from mg_server.controller.server import ControllerConfig, start_controller
    from mg_server.policy import resolve_tau
    from mg_server.verifier.server import VerifierConfig
    from mg_server.wire.cleanup import shm_base

    tau, source = resolve_tau(cfg.model_path, cfg.mg_tau, cfg.mg_mode, cfg.tau_profile, "cpu" if cfg.cpu else "cuda")
    verifier = VerifierConfig(
        model_path=cfg.model_path, ipc_path=str(Path(cfg.run_dir) / "verifier.sock"),
        shm_name=shm_base(os.getpid(), str(Path(cfg.run_dir) / "verifier.sock")),
        device="cpu" if cfg.cpu else "cuda", num_threads=1 if cfg.cpu else 0,
        memory_gb=cfg.verifier_memory_gb or 0.0, max_seq_len=context_len, pool_tokens=verifier_pool_tokens(context_len),
        trace_calls=env.trace_calls(),
    )
    ccfg = ControllerConfig(ipc_path=str(Path(cfg.run_dir) / "controller.sock"), mode=cfg.mg_mode, tau=tau,
                            metrics_dir=cfg.metrics_dir, verifier=verifier, verify_timeout_s=cfg.verify_timeout_s,
                            catchup_chunk=cfg.catchup_chunk, window=cfg.window)
    proc = start_controller(ccfg)
    # atexit runs last-registered first: the runtime stops before the instance's files go
    atexit.register(_stop, proc, ccfg.ipc_path)
    return Runtime(proc, ccfg.ipc_path, tau, source, ccfg.start_timeout_s)


def wait_ready(rt: Runtime, cfg: ServeConfig):
    """The controller's hello once it and its verifier are ready (-> ControllerInfo); raises
    RuntimeError with the child's own error if either fails to start."""
    from mg_server.controller.client import ControllerClient
    from mg_server.wire.channel import RpcError
    from mg_server.wire.liveness import beat_path, stale_reason

    proc = rt.proc

    def controller_gone() -> str:  # a dead or stopped controller fails the start now, not after start_timeout_s
        if not proc.is_alive():
            return f"the mg controller exited during start-up (code {proc.exitcode})"
        return stale_reason(beat_path(rt.ipc_path))

    try:
        with ControllerClient(rt.ipc_path, timeout_s=rt.start_timeout_s, client_name="launcher",
                              peer_check=controller_gone) as client:
            info = client.hello()
        if not info.verifier_up:
            raise RuntimeError("the deterministic verifier did not start")
    except BaseException as e:
        # a controller that answered (its verifier failed) exits by itself, stopping the verifier
        proc.join(10 if isinstance(e, RpcError) else 0)
        if proc.is_alive():
            proc.kill()
        if isinstance(e, RpcError):
            raise RuntimeError(e.message) from None
        raise
    log.info("mg: mode %s, tau %.3g (%s), verifier kernels %s, window %d", cfg.mg_mode, rt.tau, rt.tau_source,
             info.kernel_config_id, cfg.window)
    log.info("mg verifier: device %s, K/V pool %d tokens, %s", info.verifier_device, info.verifier_pool_tokens,
             f"{info.verifier_memory_bytes / (1 << 30):.2f} GB of device memory held"
             + (f" (budget {cfg.verifier_memory_gb:g} GB)" if cfg.verifier_memory_gb else "")
             if info.verifier_memory_bytes else "host memory")
    threading.Thread(target=_watch, args=(proc,), name="mg-runtime-watch", daemon=True).start()
    return info


def front_when_ready(app, rt: Runtime | None, cfg: ServeConfig, add_front: Callable[[object], None],
                     cleanup: Callable[[], None]) -> None:
    """`add_front(info)` (None in mode off) before SGLang's app serves: at once without a runtime,
    else from a thread once the runtime is ready, the app's first call waiting for it."""
    if rt is None:
        add_front(None)
        return
    ready = threading.Event()
    # where the front goes in the stack: inside what SGLang adds from now on (its API-key check),
    # outside what its app already has, whenever the runtime is ready (Starlette puts the latest
    # addition outermost)
    below = len(app.user_middleware)
    build = app.build_middleware_stack

    def build_when_ready():  # Starlette builds the stack at the app's first call
        ready.wait()
        return build()

    app.build_middleware_stack = build_when_ready

    def start() -> None:
        try:
            add_front(wait_ready(rt, cfg))
            front = app.user_middleware.pop(0)
            app.user_middleware.insert(len(app.user_middleware) - below, front)
        except BaseException as e:  # noqa: BLE001 - SGLang is starting in this process: stop it here
            _fail_start(e, cleanup)
        ready.set()

    threading.Thread(target=start, name="mg-runtime-start", daemon=True).start()


def _fail_start(e: BaseException, cleanup: Callable[[], None]) -> None:
    """What the command line does for a start that fails before SGLang starts (the error, exit 1),
    SGLang's starting processes stopped first, so the error is the log's last word."""
    import psutil

    children = psutil.Process().children(recursive=True)
    for c in children:
        try:
            c.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=10)
    try:
        cleanup()
    finally:
        log.error("mg-server could not start", exc_info=e)
        print(f"mg-server: could not start: {e}", file=sys.stderr, flush=True)
        logging.shutdown()
        os._exit(1)


def _stop(proc, ipc_path: str) -> None:
    from mg_server.controller.client import ControllerClient

    if proc.is_alive():
        try:
            with ControllerClient(ipc_path, timeout_s=5, client_name="launcher") as client:
                client.shutdown()
        except Exception:  # noqa: BLE001 - it is killed below
            pass
        proc.join(10)
    if proc.is_alive():
        proc.kill()


def _watch(proc) -> None:
    """If the controller dies, stop the whole server: deterministic requests have no home."""
    from mg_server.launch.shutdown import STOPPING

    proc.join()
    if STOPPING.is_set():  # a stop in progress ends it: not news
        return
    log.error("mg controller exited (code %s); shutting the server down", proc.exitcode)
    os.kill(os.getpid(), signal.SIGTERM)
