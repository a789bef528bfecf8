"""Start SGLang's own HTTP server with mg attached (runs in the main process).

Order matters: CPU fixes and environment before SGLang is imported, the seam check before
anything is attached, the middleware before the app serves its first request.
"""

from __future__ import annotations

import argparse
import atexit
import json
import logging
import os
import shutil
import signal
import threading
from pathlib import Path

from mg_server.config import FrontConfig, HookConfig, ServeConfig

log = logging.getLogger(__name__)

# SGLang on a CPU host (ENVIRONMENT.md): the torch_native attention and pytorch sampling
# backends are the CPU paths; CUDA graphs and the overlap scheduler are CUDA-only. The KV pool
# is capped: sized from host RAM by default, it took 13 GB of a 24 GB machine for SmolLM2.
CPU_ENGINE_ARGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-cuda-graph",
    "--disable-overlap-schedule",
    "--max-total-tokens", "65536",
)
OWNED_FLAGS = ("--forward-hooks", "--enable-custom-logit-processor")


def hook_spec(config: HookConfig) -> list[dict]:
    return [{
        "name": "mg",
        "target_modules": ["logits_processor"],
        "hook_factory": "mg_server.sglang_ext.hook:make_hook",
        "config": config.to_json_dict(),
    }]


def sglang_argv(cfg: ServeConfig, hook: HookConfig | None = None) -> list[str]:
    """SGLang server flags: mg's defaults first so the user's pass-through flags win."""
    for flag in OWNED_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in cfg.sglang_args):
            raise ValueError(f"{flag} is set by mg-server itself and cannot be passed through")
    argv = ["--model-path", cfg.model_path, "--host", cfg.host, "--port", str(cfg.port)]
    if cfg.cpu:
        argv += CPU_ENGINE_ARGS
    argv += list(cfg.sglang_args)
    hook = hook or HookConfig(metrics_dir=cfg.metrics_dir)
    argv += ["--enable-custom-logit-processor", "--forward-hooks", json.dumps(hook_spec(hook))]
    return argv


def _fresh_metrics_dir(path: str) -> None:
    # prometheus multiprocess files from an earlier run would be summed into this one's.
    shutil.rmtree(path, ignore_errors=True)
    Path(path).mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # before any process creates a metric


def start_runtime(cfg: ServeConfig):
    """Start the controller (which starts the verifier) and wait until both report ready.

    Returns (controller ipc path, ControllerInfo), or ("", None) in mode "off".
    """
    if cfg.mg_mode == "off":
        return "", None
    from mg_server.runtime.controller.client import ControllerClient
    from mg_server.runtime.controller.server import ControllerConfig, start_controller
    from mg_server.runtime.policy import resolve_tau
    from mg_server.runtime.verifier.server import VerifierConfig

    tau, source = resolve_tau(cfg.model_path, cfg.mg_tau)
    verifier = VerifierConfig(
        model_path=cfg.model_path, ipc_path=str(Path(cfg.run_dir) / "verifier.sock"),
        device="cpu" if cfg.cpu else "cuda", num_threads=1 if cfg.cpu else 0,
    )
    ccfg = ControllerConfig(ipc_path=str(Path(cfg.run_dir) / "controller.sock"), mode=cfg.mg_mode, tau=tau,
                            metrics_dir=cfg.metrics_dir, verifier=verifier)
    proc = start_controller(ccfg)
    try:
        with ControllerClient(ccfg.ipc_path, timeout_s=ccfg.start_timeout_s, client_name="launcher") as client:
            info = client.hello()
        if not info.verifier_up:
            raise RuntimeError("the deterministic verifier did not start")
    except BaseException:
        proc.kill()  # a live non-daemon child would keep this process from exiting
        raise
    log.info("mg: mode %s, tau %.3g (%s), verifier kernels %s", cfg.mg_mode, tau, source, info.kernel_config_id)
    atexit.register(_stop_runtime, proc, ccfg.ipc_path)
    threading.Thread(target=_watch_runtime, args=(proc,), name="mg-runtime-watch", daemon=True).start()
    return ccfg.ipc_path, info


def _stop_runtime(proc, ipc_path: str) -> None:
    from mg_server.runtime.controller.client import ControllerClient

    if proc.is_alive():
        try:
            with ControllerClient(ipc_path, timeout_s=5, client_name="launcher") as client:
                client.shutdown()
        except Exception:  # noqa: BLE001 - it is killed below
            pass
        proc.join(10)
    if proc.is_alive():
        proc.kill()


def _watch_runtime(proc) -> None:
    """If the controller dies, stop the whole server: deterministic requests have no home."""
    proc.join()
    log.error("mg controller exited (code %s); shutting the server down", proc.exitcode)
    os.kill(os.getpid(), signal.SIGTERM)


def serve(cfg: ServeConfig) -> None:
    if cfg.cpu:
        from mg_server.sglang_ext import cpu_compat

        log.info("CPU compatibility: %s", cpu_compat.install().summary())
    _fresh_metrics_dir(cfg.metrics_dir)

    from mg_server.sglang_ext import seams

    version = seams.check()
    controller_ipc, info = start_runtime(cfg)
    from sglang.srt.entrypoints.http_server import app, launch_server
    from sglang.srt.server_args import ServerArgs

    from mg_server.front.middleware import DeterministicMiddleware
    from mg_server.sglang_ext.processor import serialized

    parser = argparse.ArgumentParser(prog="mg-server serve (SGLang flags)")
    ServerArgs.add_cli_args(parser)
    hook = HookConfig(metrics_dir=cfg.metrics_dir, controller_ipc=controller_ipc)
    server_args = ServerArgs.from_cli_args(parser.parse_args(sglang_argv(cfg, hook)))
    app.add_middleware(
        DeterministicMiddleware,
        config=FrontConfig(noop_processor=serialized(), metrics_dir=cfg.metrics_dir, controller_ipc=controller_ipc,
                           kernel_config_id=info.kernel_config_id if info else ""),
    )
    log.info("mg-server: SGLang %s, model %s, http://%s:%d", version, cfg.model_path, cfg.host, cfg.port)
    launch_server(server_args)
