"""Start SGLang's own HTTP server with mg attached (runs in the main process).

Order matters: CPU fixes and environment before SGLang is imported, the seam check before
anything is attached, the middleware before the app serves its first request.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
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


def sglang_argv(cfg: ServeConfig) -> list[str]:
    """SGLang server flags: mg's defaults first so the user's pass-through flags win."""
    for flag in OWNED_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in cfg.sglang_args):
            raise ValueError(f"{flag} is set by mg-server itself and cannot be passed through")
    argv = ["--model-path", cfg.model_path, "--host", cfg.host, "--port", str(cfg.port)]
    if cfg.cpu:
        argv += CPU_ENGINE_ARGS
    argv += list(cfg.sglang_args)
    argv += ["--enable-custom-logit-processor",
             "--forward-hooks", json.dumps(hook_spec(HookConfig(metrics_dir=cfg.metrics_dir)))]
    return argv


def _fresh_metrics_dir(path: str) -> None:
    # prometheus multiprocess files from an earlier run would be summed into this one's.
    shutil.rmtree(path, ignore_errors=True)
    Path(path).mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # before any process creates a metric


def serve(cfg: ServeConfig) -> None:
    if cfg.cpu:
        from mg_server.sglang_ext import cpu_compat

        log.info("CPU compatibility: %s", cpu_compat.install().summary())
    _fresh_metrics_dir(cfg.metrics_dir)

    from mg_server.sglang_ext import seams

    version = seams.check()
    from sglang.srt.entrypoints.http_server import app, launch_server
    from sglang.srt.server_args import ServerArgs

    from mg_server.front.middleware import DeterministicMiddleware
    from mg_server.sglang_ext.processor import serialized

    parser = argparse.ArgumentParser(prog="mg-server serve (SGLang flags)")
    ServerArgs.add_cli_args(parser)
    server_args = ServerArgs.from_cli_args(parser.parse_args(sglang_argv(cfg)))
    app.add_middleware(
        DeterministicMiddleware,
        config=FrontConfig(noop_processor=serialized(), metrics_dir=cfg.metrics_dir),
    )
    log.info("mg-server: SGLang %s, model %s, http://%s:%d", version, cfg.model_path, cfg.host, cfg.port)
    launch_server(server_args)
