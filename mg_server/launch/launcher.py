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
import secrets
import shutil
import threading
from pathlib import Path

from mg_server import env
from mg_server.checkpoint import Checkpoint
from mg_server.config import FP32_LOGITS_ARGS, ControllerConfig, FrontConfig, HookConfig, ServeConfig, VerifierConfig

log = logging.getLogger(__name__)

# SGLang on a CPU host (ENVIRONMENT.md): the torch_native attention and pytorch sampling
# backends are the CPU paths; CUDA graphs are CUDA-only. The KV pool is capped: sized from host
# RAM by default, it took 13 GB of a 24 GB machine for SmolLM2. The overlap scheduler stays on,
# as on a GPU: it was no slower here (decode 59.6 / 85.3 ms per step at batch 1 / 8 with it,
# 69.0 / 100.7 without, two servers sharing 2 cores), and it makes CPU runs take the scheduling
# path GPUs take (a request's output list one step behind the forward being sampled, a
# look-ahead forward after its last token). No grammar backend: SGLang's default, xgrammar,
# applies its token masks with GPU kernels only, and on a CPU its first grammar request raised
# in the scheduler and took the whole server down; with none, SGLang answers such requests 400.
# Sleep on idle: an idle scheduler otherwise polls its sockets in a loop, a whole core of a CPU
# host (10.5 s of CPU in 10 s idle, measured), which a 2-core machine's other processes need; it
# then blocks in a socket poll and wakes when a request comes.
CPU_ENGINE_ARGS = (
    "--device", "cpu",
    "--sleep-on-idle",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--grammar-backend", "none",
    "--cuda-graph-backend-decode", "disabled",
    "--cuda-graph-backend-prefill", "disabled",
    "--max-total-tokens", "65536",
)
# A CUDA host without sgl_kernel/flashinfer (compat profile "cuda-bare"): SGLang's triton
# attention and pytorch sampling need neither; no grammar backend (xgrammar's masks need its
# CUDA kernels); no prefill CUDA graphs (their capture compiles paths that call sgl_kernel).
# Decode keeps its CUDA graphs.
BARE_CUDA_ENGINE_ARGS = (
    "--attention-backend", "triton",
    "--sampling-backend", "pytorch",
    "--grammar-backend", "none",
    "--disable-prefill-cuda-graph",
)
ENGINE_ARGS = {"cpu": CPU_ENGINE_ARGS, "cuda-bare": BARE_CUDA_ENGINE_ARGS, "cuda": ()}
OWNED_FLAGS = ("--forward-hooks", "--enable-custom-logit-processor")
# SGLang's parallel widths (each 1, or unset, for a single scheduler process)
PARALLEL_SIZES = ("tp_size", "pp_size", "dp_size", "attn_dp_size", "attn_cp_size", "dcp_size")


def hook_spec(config: HookConfig) -> list[dict]:
    # SGLang calls the factory inside ModelRunner.initialize; it attaches mg to the sampler and
    # registers no module hook (see hook.py), so the target pattern only has to match a module.
    return [{
        "name": "mg",
        "target_modules": ["logits_processor"],
        "hook_factory": "mg_server.seam.hook:make_hook",
        "config": config.to_json_dict(),
    }]


def sglang_argv(cfg: ServeConfig, hook: HookConfig | None = None, fp32_logits: bool = False) -> list[str]:
    """SGLang server flags: mg's defaults first so the user's pass-through flags win (but for
    switches without an off form, as `--enable-fp32-lm-head`)."""
    for flag in OWNED_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in cfg.sglang_args):
            raise ValueError(f"{flag} is set by mg-server itself and cannot be passed through")
    argv = ["--model-path", cfg.model_path, "--host", cfg.host, "--port", str(cfg.port)]
    argv += ENGINE_ARGS[cfg.profile]
    argv += FP32_LOGITS_ARGS if fp32_logits else ()
    argv += list(cfg.sglang_args)
    hook = hook or HookConfig(metrics_dir=cfg.metrics_dir)
    argv += ["--enable-custom-logit-processor", "--forward-hooks", json.dumps(hook_spec(hook))]
    return argv


def wants_fp32_logits(cfg: ServeConfig) -> bool:
    """FP32_LOGITS_ARGS for this server: mg on, a CUDA host, and an SGLang whose fp32 LM head
    is free (logged either way on CUDA)."""
    if cfg.mg_mode == "off" or cfg.cpu:
        return False
    from mg_server.launch import sglang_facts

    free = sglang_facts.fp32_logits_in_place()
    log.info("mg: fast path logits %s", "fp32 (--enable-fp32-lm-head)" if free else
             "bf16 (this SGLang's --enable-fp32-lm-head is not the fp32-output GEMM mg checks for)")
    return free


def refuse_unsupported(server_args, mode: str, cpu: bool = False) -> None:
    """Configurations in which mg could not see or repair every step: refused at start-up."""
    if mode == "off":
        return
    a = server_args
    problems = []
    if a.speculative_algorithm:
        problems.append(f"--speculative-algorithm {a.speculative_algorithm}: speculative decoding emits "
                        "tokens that mg's per-step seam does not decide")
    if a.enable_dp_attention or any((getattr(a, n) or 1) > 1 for n in PARALLEL_SIZES if n != "tp_size"):
        problems.append("pipeline/data/context parallelism: mg's seam agrees across tensor-parallel ranks only")
    if (a.tp_size or 1) > 1 and not cpu:
        problems.append(f"--tp {a.tp_size} on a GPU: mg's tensor-parallel verifier runs on a CPU only for now (its "
                        "per-rank weights on CUDA are not built)")
    if a.kv_cache_dtype not in ("auto", "bfloat16"):
        problems.append(f"--kv-cache-dtype {a.kv_cache_dtype}: the τ profiles are measured on bfloat16 K/V")
    if a.dtype not in ("auto", "bfloat16"):
        problems.append(f"--dtype {a.dtype}: the verifier runs the model in bfloat16")
    if a.enable_hierarchical_cache:
        problems.append("--enable-hierarchical-cache: mg's rollbacks are built and tested on device-resident K/V only")
    # the verifier computes on SGLang's weight tensors where SGLang keeps them (seam/export.py)
    shared = {"--startup-weight-load-mode": a.startup_weight_load_mode != "serial",
              "--enable-memory-saver": a.enable_memory_saver, "--weight-cache-mode": a.weight_cache_mode != "off",
              "--cpu-offload-gb": bool(a.cpu_offload_gb), "--quantization": bool(a.quantization),
              "--enable-lora / --lora-paths": bool(a.enable_lora or a.lora_paths)}
    problems += [f"{flag}: the verifier computes on SGLang's own weight tensors, which this moves, frees or "
                 "changes" for flag, on in shared.items() if on]
    if problems:
        raise ValueError("unsupported with --mg-mode " + mode + " (serve with --mg-mode off, or drop the flag):\n  - "
                         + "\n  - ".join(problems))


def refuse_dtype_mismatch(server_args, mode: str, model: Checkpoint | None,
                          verifier_dtype: str = VerifierConfig.dtype) -> None:
    """The dtype SGLang will run the model in (its own rule for --dtype auto: the config's dtype,
    float32 configs downcast) must be the verifier's: mg never casts K/V columns or compares
    logits across dtypes silently."""
    if mode == "off" or model is None:  # (no local checkpoint: the seam checks the runner's pool at start-up)
        return
    from sglang.srt.configs.model_config import _get_and_verify_dtype

    conf = {"dtype": model.dtype or None, "model_type": model.model_type}  # the fields SGLang's rule reads
    served = str(_get_and_verify_dtype(conf, server_args.dtype)).removeprefix("torch.")
    if served != verifier_dtype:
        raise ValueError(f"SGLang would run this model in {served} (--dtype {server_args.dtype}, the model's config "
                         f"says {model.dtype or None}); mg's verifier runs {verifier_dtype}: "
                         f"pass --dtype {verifier_dtype}, or serve with --mg-mode off")


def refuse_on_host(server_args, profile: str) -> None:
    """Configurations that would let one request stop the server on this host (any mg mode)."""
    if profile == "cpu" and server_args.grammar_backend == "xgrammar":
        raise ValueError("--grammar-backend xgrammar does not run on a CPU host (its token masks are GPU "
                         "kernels: the first grammar request would stop the server); use --grammar-backend none")


def _fresh_metrics_dir(path: str) -> None:
    # prometheus multiprocess files from an earlier run would be summed into this one's.
    shutil.rmtree(path, ignore_errors=True)
    Path(path).mkdir(parents=True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = path  # before any process creates a metric


def served_context(server_args, model: Checkpoint | None) -> int:
    """The longest sequence SGLang serves: --context-length, else the model's own limit (else the
    verifier's default)."""
    if server_args.context_length:
        return int(server_args.context_length)
    return (model.max_positions if model else 0) or VerifierConfig.max_seq_len


def verifier_pool_tokens(context_len: int) -> int:
    """A CPU verifier's K/V pool (tokens): two longest sequences (host memory; on CUDA the pool
    is sized to the deterministic load, verifier.budget)."""
    return max(16384, 2 * context_len)


def start_runtime(cfg: ServeConfig, context_len: int = VerifierConfig.max_seq_len,
                  sglang_fraction: float | None = None, tp: int = 1):
    """Start the controller (which starts the verifier), wait until the verifier is up (CPU) or has
    allocated its K/V pool (CUDA: it then waits for SGLang's weights), then supervise it
    (launch.runtime: restarts). The verifier accepts sequences as long as SGLang's (`context_len`).

    Returns (controller ipc path, ControllerInfo), or ("", None) in mode "off".
    """
    if cfg.mg_mode == "off":
        return "", None
    from mg_server.launch.runtime import Runtime
    from mg_server.policy import resolve_tau

    model = cfg.model  # read and identified by the command line (cli._checkpoint)
    if model is None or model.spec is None:
        raise ValueError(f"--model {cfg.model_path}: mg's verifier needs a local checkpoint folder of a model it "
                         "computes (or serve with --mg-mode off)")
    tau, source = resolve_tau(model.identity, cfg.mg_tau, cfg.mg_mode, cfg.tau_profile, "cpu" if cfg.cpu else "cuda",
                              profile=cfg.tau_profile_doc)
    verifier = VerifierConfig(
        model_path=cfg.model_path, model=model, ipc_path=str(Path(cfg.run_dir) / "verifier.sock"),
        device="cpu" if cfg.cpu else "cuda", num_threads=1 if cfg.cpu else 0, max_seq_len=context_len,
        pool_tokens=verifier_pool_tokens(context_len) if cfg.cpu else 0, kv_budget_gb=cfg.kv_budget_gb or 0.0,
        sglang_fraction=sglang_fraction or VerifierConfig.sglang_fraction,
        weights_bytes=0 if cfg.cpu else model.spec.weight_bytes(),
        trace_calls=env.trace_calls(), tp=tp,  # a verifier rank per SGLang rank (verifier/ranks.py)
    )
    ccfg = ControllerConfig(ipc_path=str(Path(cfg.run_dir) / "controller.sock"), mode=cfg.mg_mode, tau=tau,
                            metrics_dir=cfg.metrics_dir, verifier=verifier, verify_timeout_s=cfg.verify_timeout_s,
                            catchup_chunk=cfg.catchup_chunk, window=cfg.window)
    runtime = Runtime(ccfg)
    info = runtime.start()
    log.info("mg: mode %s, tau %.3g (%s), verifier kernels %s, window %d", cfg.mg_mode, tau, source,
             info.kernel_config_id, cfg.window)
    log.info("mg: model %s (%s), identity %s", cfg.model_path, model.architecture or model.model_type, model.identity)
    log.info("mg verifier: device %s, K/V pool %d tokens, %s", info.verifier_device, info.verifier_pool_tokens,
             f"{info.verifier_memory_bytes / (1 << 30):.2f} GB of device memory held (SGLang's weights are shared)"
             + (f" (budget {cfg.kv_budget_gb:g} GB)" if cfg.kv_budget_gb else "")
             if info.verifier_memory_bytes else "host memory")
    # atexit runs last-registered first: the runtime stops, then its files go
    atexit.register(runtime.stop)
    threading.Thread(target=runtime.watch, name="mg-runtime-watch", daemon=True).start()
    return ccfg.ipc_path, info


def _instance_files(cfg: ServeConfig) -> tuple[str, ...]:
    """The folders this server instance owns (wire.cleanup)."""
    return cfg.run_dir, cfg.metrics_dir


class _SGLangFlags(argparse.ArgumentParser):
    """SGLang's flags: an unknown or bad one is one line naming it (argparse's own error first
    prints SGLang's whole usage, 500+ lines)."""

    def error(self, message: str):
        self.exit(2, f"mg-server serve: error: {message}\n(`mg-server serve --help` lists mg's flags; SGLang's "
                     "are those of `python -m sglang.launch_server --help`)\n")


def outermost(app, wrap) -> None:
    """Make `wrap(stack)` the outermost layer of the Starlette `app`, outside every middleware,
    SGLang's API-key check included (it adds that one at launch, after mg could add its own):
    the front sees every request first, and its refusals carry the verdict headers."""
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: wrap(build())


def serve(cfg: ServeConfig) -> None:
    from mg_server.launch import compat, leftovers
    from mg_server.wire.cleanup import remove_instance

    def cleanup() -> None:
        from mg_server.launch.shutdown import STOPPING, failure

        remove_instance(_instance_files(cfg))
        leftovers.remove()  # SGLang's own sockets and slot file of this instance
        if STOPPING.is_set():  # a stop, every child gone: say whether it was asked for, and end here
            why = failure()  # (SGLang's own crash-stop, or a runtime that gave up: never "cleanly")
            if why:
                log.error("mg-server stopped after a failure: %s", why)
            else:
                log.info("mg-server stopped cleanly")
            logging.shutdown()
            # why os._exit: every child is gone and every file removed; the interpreter's own
            # finalization adds only third-party noise (Triton's nanobind reports ~50 "leaked" lines)
            os._exit(1 if why else 0)

    atexit.register(cleanup)  # registered first, so it runs after the runtime has stopped
    # /health answers from mg's runtime state and SGLang's status at once; SGLang's one-token probe
    # stays on /health_generate. Why: the probe waits at least 1 s and up to 20 s for the scheduler,
    # which mg's finish barrier can hold that long on a CPU, and a probe that times out marks the
    # server unhealthy, which makes SGLang skip its SIGTERM drain (a user's own setting is kept)
    os.environ.setdefault("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false")
    log.info("SGLang compatibility: %s", compat.install(cfg.profile).summary())
    _fresh_metrics_dir(cfg.metrics_dir)

    from mg_server.launch import sglang_facts

    version = sglang_facts.check(cfg.allow_sglang)
    if cfg.mg_mode != "off":
        sglang_facts.check_window()
    fp32_logits = wants_fp32_logits(cfg)
    if version not in sglang_facts.TESTED:
        log.warning("mg: SGLang %s is not a tested version (%s); starting because --mg-allow-sglang names it",
                    version, sglang_facts.RANGE)
    from mg_server import metrics

    metrics.sglang_version(version, version in sglang_facts.TESTED)
    from sglang.srt.entrypoints.http_server import app, launch_server
    from sglang.srt.server_args import ServerArgs

    parser = _SGLangFlags(prog="mg-server serve")
    ServerArgs.add_cli_args(parser)
    # Parsed once, before mg's processes start, to refuse what mg cannot serve; the namespace holds
    # ServerArgs' fields by their names. The hook's config is set in it once the controller is up.
    ns = parser.parse_args(sglang_argv(cfg, fp32_logits=fp32_logits))
    refuse_on_host(ns, cfg.profile)
    refuse_unsupported(ns, cfg.mg_mode, cfg.cpu)
    refuse_dtype_mismatch(ns, cfg.mg_mode, cfg.model)
    context_len = served_context(ns, cfg.model)
    from mg_server.front import admission
    from mg_server.launch import shutdown

    shutdown.install(cleanup, cfg.drain_timeout_s, (admission.stop, admission.drained, admission.cut))
    leftovers.track(cfg.run_dir)
    controller_ipc, info = start_runtime(cfg, context_len, ns.mem_fraction_static, ns.tp_size or 1)

    from mg_server.front.middleware import DeterministicMiddleware
    from mg_server.seam import guard
    from mg_server.seam.processor import serialized
    from mg_server.wire.fingerprint import system_fingerprint

    # this start's mark of deterministic requests: the front sets it, SGLang's scheduler (which
    # inherits the environment) runs mg's processor and the seam protects a row only with it
    mark = secrets.token_hex(16)
    os.environ[env.MARK_VAR] = mark
    guard.install(mark)  # this process's SGLang too (its tokenizer manager deserializes processors)

    # The finish barrier may wait for a whole context's catch-up, one verify timeout per chunk (a dead or
    # stopped controller is noticed from its beat within seconds, whatever this bound).
    chunks = -(-context_len // cfg.catchup_chunk) + 1
    hook = HookConfig(metrics_dir=cfg.metrics_dir, controller_ipc=controller_ipc, tp=ns.tp_size or 1,
                      step_timeout_s=max(HookConfig.step_timeout_s, chunks * cfg.verify_timeout_s))
    ns.forward_hooks = hook_spec(hook)  # (sglang_argv's --forward-hooks, parsed: its JSON list)
    server_args = ServerArgs.from_cli_args(ns)
    front = FrontConfig(noop_processor=serialized(), metrics_dir=cfg.metrics_dir, controller_ipc=controller_ipc,
                        kernel_config_id=info.kernel_config_id if info else "", model_path=cfg.model_path,
                        system_fingerprint=system_fingerprint(info.model_id, info.kernel_config_id)
                        if info else "", api_key=server_args.api_key or "",
                        verdict_wait_s=cfg.verdict_wait_s, vocab_size=cfg.model.vocab_size if cfg.model else 0,
                        max_deterministic=info.verifier_max_requests if info else 0, queue_size=cfg.queue_size,
                        request_mark=mark, served_models=tuple(dict.fromkeys(
                            [server_args.served_model_name or cfg.model_path, cfg.model_path])),
                        any_model=bool(server_args.enable_lora or server_args.lora_paths))
    outermost(app, lambda inner: DeterministicMiddleware(inner, front))
    from mg_server.launch import http_guard

    http_guard.install()  # a request head arrives within a bound (the front bounds its body)
    # SGLang's own 20 kB server_args line is at debug (mg_server.logs): the settings mg's determinism
    # depends on, as SGLang resolved them, in one line
    log.info("mg-server: SGLang %s, model %s, http://%s:%d; cuda graph %s, overlap scheduler %s, attention %s",
             version, cfg.model_path, cfg.host, cfg.port, "off" if server_args.disable_cuda_graph else "on",
             "off" if server_args.disable_overlap_schedule else "on", server_args.attention_backend)
    # SGLang's scheduler and detokenizer ignore a signal to the process group (shutdown.py)
    launch_server(server_args, **shutdown.sglang_children(launch_server))
