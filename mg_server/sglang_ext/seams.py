"""The SGLang version and the internal signatures mg relies on, checked at start-up.

mg never edits SGLang; it attaches through `--forward-hooks`, `custom_params` and the KV pool
API. Those are internals, so the server refuses to start when the installed SGLang differs from
the one these seams were written against, naming what changed.
"""

from __future__ import annotations

import dataclasses
import inspect

SUPPORTED_SGLANG = "0.5.10.post1"


class SeamMismatch(RuntimeError):
    pass


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def check() -> str:
    """Raise SeamMismatch unless every seam is as expected; returns the SGLang version."""
    import sglang

    version = getattr(sglang, "__version__", "?")
    problems: list[str] = []
    if version != SUPPORTED_SGLANG:
        problems.append(f"SGLang {version} is installed; mg_server supports {SUPPORTED_SGLANG}")

    from sglang.srt.entrypoints import http_server
    from sglang.srt.layers.logits_processor import LogitsProcessor, LogitsProcessorOutput
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor import hook_manager
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor
    from sglang.srt.server_args import ServerArgs

    expect = [
        # The forward hook receives LogitsProcessor.forward's positional args; the 4th is the batch.
        ("LogitsProcessor.forward args", _params(LogitsProcessor.forward)[:5],
         ["self", "input_ids", "hidden_states", "lm_head", "logits_metadata"]),
        ("register_forward_hooks args", _params(hook_manager.register_forward_hooks), ["model", "hook_specs"]),
        ("launch_server first arg", _params(http_server.launch_server)[:1], ["server_args"]),
        ("MHATokenToKVPool.set_kv_buffer args", _params(MHATokenToKVPool.set_kv_buffer)[:5],
         ["self", "layer", "loc", "cache_k", "cache_v"]),
    ]
    for what, got, want in expect:
        if got != want:
            problems.append(f"{what}: expected {want}, found {got}")
    fields = {f.name for f in dataclasses.fields(ForwardBatch)}
    for name in ("forward_mode", "req_pool_indices", "seq_lens", "out_cache_loc", "sampling_info",
                 "req_to_token_pool", "token_to_kv_pool", "rids"):
        if name not in fields:
            problems.append(f"ForwardBatch has no field {name!r}")
    if "next_token_logits" not in {f.name for f in dataclasses.fields(LogitsProcessorOutput)}:
        problems.append("LogitsProcessorOutput has no field 'next_token_logits'")
    server_fields = {f.name for f in dataclasses.fields(ServerArgs)}
    for name in ("forward_hooks", "enable_custom_logit_processor"):
        if name not in server_fields:
            problems.append(f"ServerArgs has no field {name!r}")
    if not callable(getattr(CustomLogitProcessor, "to_str", None)):
        problems.append("CustomLogitProcessor.to_str is missing")
    if not hasattr(http_server, "app"):
        problems.append("sglang.srt.entrypoints.http_server.app is missing")
    if problems:
        raise SeamMismatch("SGLang seams do not match:\n  - " + "\n  - ".join(problems))
    return version
