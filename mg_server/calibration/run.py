"""`mg-server calibrate`: references, the fast path's server, measurements, profile and plot.

Every expensive result is cached under OUT/cache/ with a key over everything it depends on
(the model's identity, mg_server.checkpoint, prompt tokens, max_tokens, device, kernel configuration, SGLang version and
flags), one file per prompt set for the references and one per set and batch size for the fast
path, so an interrupted run resumes and a rerun with a changed batch-size list measures only the
new sizes. The fast path's server runs with the radix cache off: each batch then computes its
own prompts, so a measurement does not depend on which batches ran before it (nor on the cache).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from importlib import metadata
from pathlib import Path

from mg_server.calibration import fastpath, plot, profile
from mg_server.calibration.sweep import SetData
from mg_server.checkpoint import Checkpoint, read_checkpoint
from mg_server.config import FP32_LOGITS_ARGS, CalibrationConfig

log = logging.getLogger("mg.calibrate")

REF_CHUNK = 32  # prompts per reference decode (the verifier engine holds at most 64 requests)
SERVER_FLAGS = ("--mg-mode", "off", "--disable-radix-cache")  # plain SGLang: the fast path itself
# ... with the logits mg's fast path takes on the device (mg passes them only where SGLang's fp32
# LM head is free, as in every tested SGLang version: launch/sglang_facts.fp32_logits_in_place)
DEVICE_FLAGS = {"cpu": (), "cuda": FP32_LOGITS_ARGS}


def calibrate(cfg: CalibrationConfig) -> dict:
    """Run (or resume) a calibration; returns the profile written to OUT/profile.json."""
    from transformers import AutoTokenizer

    from mg_server.prompts import chat_ids, load_prompt_set

    t0 = time.monotonic()
    out = Path(cfg.out_dir)
    (out / "cache").mkdir(parents=True, exist_ok=True)
    sets = [load_prompt_set(spec, cfg.limit) for spec in cfg.prompt_sets]  # bad names fail before any work
    if len({s.name for s in sets}) != len(sets):
        raise ValueError(f"prompt sets must have distinct names: {[s.name for s in sets]}")
    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    model = read_checkpoint(cfg.model_path)  # the one model identity keys the caches and names the profile
    model.require_spec()
    model_key = model.identity
    kernel_id = _kernel_config_id(cfg.device)
    data = []
    for s in sets:
        prompts = [chat_ids(tok, c) for c in s.chats]
        refs, margins = _references(cfg, model, s.name, prompts, kernel_id, out / "cache")
        data.append(SetData(s.name, s.source, prompts, refs, margins, {}))

    serving = _measure_all(cfg, data, model, out)
    prof = profile.build(cfg, serving=serving, kernel_config_id=kernel_id, sets=data, model_id=model_key)
    problems = profile.check(prof)
    if problems:  # a bug here, not a property of the data: refuse to write a profile that lies
        raise RuntimeError("inconsistent profile: " + "; ".join(problems))
    (out / "profile.json").write_text(json.dumps(prof, indent=1, allow_nan=False) + "\n")
    plot.write(prof, out / "calibration.png")
    log.info("calibration done in %.0f s: tau %.4g -> %s, %s", time.monotonic() - t0, prof["tau"],
             out / "profile.json", out / "calibration.png")
    return prof


def _references(cfg, model: Checkpoint, name, prompts, kernel_id, cache: Path):
    key = _key("ref", model.identity, kernel_id, cfg.device, cfg.max_tokens, prompts)
    path = cache / f"reference-{name}.json"
    hit = _load(path, key)
    if hit is not None:
        log.info("%s: references from %s", name, path)
        return hit["tokens"], hit["margins"]
    from tqdm import tqdm

    from mg_server.verifier.reference import greedy_reference, load_engine

    bar = tqdm(total=len(prompts) * cfg.max_tokens, desc=f"{name}: reference (verifier alone)", unit="tok")
    chunks = [prompts[i:i + REF_CHUNK] for i in range(0, len(prompts), REF_CHUNK)]
    pool = max(32768, max(sum(len(p) + cfg.max_tokens for p in c) for c in chunks))
    engine = load_engine(model, device=cfg.device, pool_tokens=pool,
                         max_seq_len=max(len(p) for p in prompts) + cfg.max_tokens + 1)
    tokens, margins = [], []
    try:
        for c in chunks:
            for r in greedy_reference(engine, c, cfg.max_tokens, rid_prefix=f"cal-{name}", progress=bar.update):
                tokens.append(r.tokens)
                margins.append(r.margins)
    finally:
        bar.close()
        del engine
        _free_device(cfg.device)
    _save(path, key, {"tokens": tokens, "margins": margins})
    return tokens, margins


def _measure_all(cfg: CalibrationConfig, data: list[SetData], model: Checkpoint, out: Path) -> dict:
    """Fill every set's traces (cache first); start the server only if something is missing.
    Returns the serving facts (SGLang version and flags) the measurements were made with."""
    from tqdm import tqdm

    sglang_version = metadata.version("sglang")
    todo = []
    serving = None
    for d in data:
        for bs in cfg.batch_sizes:
            key = _key("fast", model.identity, cfg.device, sglang_version, cfg.server_args, _server_flags(cfg),
                       cfg.max_tokens, bs, d.prompts, d.refs)
            path = out / "cache" / f"fast-{d.name}-bs{bs}.json"
            hit = _load(path, key)
            if hit is None:
                todo.append((d, bs, key, path))
            else:
                d.traces[bs] = [fastpath.Trace.from_json(t) for t in hit["traces"]]
                serving = serving or hit["serving"]
                log.info("%s bs %d: fast path from %s", d.name, bs, path)
    if not todo:
        return serving
    from mg_server.evaluation.server_process import ServerProcess

    args = ["--model", cfg.model_path, "--device", cfg.device, *_server_flags(cfg), *cfg.server_args]
    srv = ServerProcess(args, out / "server.log")
    try:
        log.info("starting the fast path's server (mg off): log in %s", out / "server.log")
        log.info("server ready in %.0f s", srv.wait_ready())
        serving = _serving_facts(srv.url, cfg, model)
        first = data[0].prompts
        rows = [first[i % len(first)] for i in range(max(cfg.batch_sizes))]
        serving["logprobs_check"] = fastpath.logprobs_neutral(srv.url, rows, cfg.max_tokens, cfg.request_timeout_s)
        log.info("asking for logprobs leaves the tokens unchanged (%d rows x %d tokens)", len(rows), cfg.max_tokens)
        for d, bs, key, path in todo:
            bar = tqdm(total=len(d.prompts) * cfg.max_tokens, desc=f"{d.name}: fast path bs {bs}", unit="step")
            t = time.monotonic()
            try:
                d.traces[bs] = fastpath.measure(srv.url, d.prompts, d.refs, bs, cfg.max_tokens,
                                                cfg.request_timeout_s, progress=bar.update)
            finally:
                bar.close()
            flips = sum(sum(tr.flips) for tr in d.traces[bs])
            log.info("%s bs %d: %d flips in %d steps, %.0f s", d.name, bs, flips, len(d.prompts) * cfg.max_tokens,
                     time.monotonic() - t)
            _save(path, key, {"serving": serving, "traces": [tr.to_json() for tr in d.traces[bs]]})
    except Exception:
        log.error("server log tail:\n%s", srv.log_tail(30))
        raise
    finally:
        srv.stop()
    return serving


def _serving_facts(url: str, cfg: CalibrationConfig, model: Checkpoint) -> dict:
    import requests

    info = requests.get(url + "/server_info", timeout=60).json()
    dtype = info.get("dtype", "auto")
    if dtype == "auto":  # SGLang serves the checkpoint's dtype
        dtype = model.dtype or "auto"
    keys = ("device", "attention_backend", "sampling_backend", "disable_radix_cache", "disable_overlap_schedule",
            "disable_cuda_graph", "chunked_prefill_size", "max_running_requests")
    return {"sglang_version": info.get("version", ""), "dtype": dtype,
            "flags": [*_server_flags(cfg), *cfg.server_args], **{k: info.get(k) for k in keys}}


def _server_flags(cfg: CalibrationConfig) -> tuple[str, ...]:
    return (*SERVER_FLAGS, *DEVICE_FLAGS[cfg.device])


def _kernel_config_id(device: str) -> str:
    from mg_server.verifier.kernels.config import kernel_config_id

    return kernel_config_id(device)


def _free_device(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()  # the server sizes its K/V pool from the memory left


def _key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _load(path: Path, key: str) -> dict | None:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if d.get("key") == key else None


def _save(path: Path, key: str, payload: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"key": key, **payload}))
    tmp.replace(path)  # never a half-written cache file
