"""The SGLang version and the internal signatures mg relies on, checked at start-up.

mg never edits SGLang; it attaches through `--forward-hooks` (whose factory puts mg's step seam
on the model runner's Sampler, see hook.py), `custom_params` and the KV pool API. Those are
internals, so the server refuses to start when the installed SGLang differs from the one these
seams were written against, naming what changed.
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
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.layers.sampler import Sampler
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_output_processor_mixin import SchedulerOutputProcessorMixin
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor import hook_manager
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    expect = [
        # The seam is a forward pre-hook on the Sampler: it reads these positional args.
        ("Sampler.forward args", _params(Sampler.forward),
         ["self", "logits_output", "sampling_info", "return_logprob", "top_logprobs_nums",
          "token_ids_logprobs", "positions"]),
        ("register_forward_hooks args", _params(hook_manager.register_forward_hooks), ["model", "hook_specs"]),
        ("launch_server first arg", _params(http_server.launch_server)[:1], ["server_args"]),
        ("MHATokenToKVPool.set_kv_buffer args", _params(MHATokenToKVPool.set_kv_buffer)[:5],
         ["self", "layer", "loc", "cache_k", "cache_v"]),
    ]
    for what, got, want in expect:
        if got != want:
            problems.append(f"{what}: expected {want}, found {got}")
    # Source facts the seam relies on: the hook factory runs inside ModelRunner.initialize (its
    # frame gives mg the runner), and the attributes it reads are set where expected.
    sources = [
        ("ModelRunner.initialize", ModelRunner.initialize,
         ("register_forward_hooks(self.model", "self.sampler", "self.req_to_token_pool")),
        ("ModelRunner", ModelRunner, ("self.token_to_kv_pool",)),
        ("Req.__init__", Req.__init__, ("self.origin_input_ids", "self.output_ids", "self.req_pool_idx",
                                        '"__req__": self', "self.sampling_params", "self.grammar",
                                        "self.return_logprob", "self.lora_id", "self.eos_token_ids")),
        # link.end_rules mirrors these end rules of a request (Req.check_finished's token rules)
        ("Req._check_token_based_finish", Req._check_token_based_finish,
         ("self.sampling_params.ignore_eos", "self.sampling_params.stop_token_ids", "self.eos_token_ids",
          "self.tokenizer.eos_token_id", "self.tokenizer.additional_stop_token_ids")),
        ("Req.check_finished", Req.check_finished,
         ("len(self.output_ids) >= self.sampling_params.max_new_tokens", "self._check_str_based_finish()")),
        # reasons.unmodelled reads these to refuse what the verifier does not compute
        ("SamplingParams.__init__", SamplingParams.__init__,
         ("self.frequency_penalty", "self.presence_penalty", "self.repetition_penalty", "self.min_new_tokens",
          "self.logit_bias", "self.stop_strs", "self.stop_regex_strs")),
        ("Sampler.forward", Sampler.forward, ("self._preprocess_logits(logits, sampling_info)",)),
        # --mg-commit lag swaps a corrected token as the scheduler appends it (lagcommit.Outputs)
        ("SchedulerOutputProcessorMixin", SchedulerOutputProcessorMixin,
         ("req.output_ids.append(next_token_id)",)),
        # the seam skips mg's no-op processor for a forward by clearing this flag (hook.py)
        ("Sampler._preprocess_logits", Sampler._preprocess_logits,
         ("if sampling_info.has_custom_logit_processor:", "apply_custom_logit_processor(logits, sampling_info)")),
    ]
    for what, obj, needles in sources:
        try:
            text = inspect.getsource(obj)
        except (OSError, TypeError):
            problems.append(f"{what}: source not available to check")
            continue
        problems += [f"{what} no longer contains {n!r}" for n in needles if n not in text]
    if "next_token_logits" not in {f.name for f in dataclasses.fields(LogitsProcessorOutput)}:
        problems.append("LogitsProcessorOutput has no field 'next_token_logits'")
    info_fields = {f.name for f in dataclasses.fields(SamplingBatchInfo)}
    for name in ("custom_params", "has_custom_logit_processor"):
        if name not in info_fields:
            problems.append(f"SamplingBatchInfo has no field {name!r}")
    server_fields = {f.name for f in dataclasses.fields(ServerArgs)}
    for name in ("forward_hooks", "enable_custom_logit_processor", "speculative_algorithm", "tp_size", "pp_size",
                 "dp_size", "enable_dp_attention", "kv_cache_dtype", "dtype", "enable_hierarchical_cache",
                 "grammar_backend", "mem_fraction_static", "device"):
        if name not in server_fields:
            problems.append(f"ServerArgs has no field {name!r}")
    if not callable(getattr(CustomLogitProcessor, "to_str", None)):
        problems.append("CustomLogitProcessor.to_str is missing")
    from sglang.srt import utils as sglang_utils

    if not callable(getattr(sglang_utils, "get_device_memory_capacity", None)):  # launch.verifier_room's card size
        problems.append("sglang.srt.utils.get_device_memory_capacity is missing")
    if not hasattr(http_server, "app"):
        problems.append("sglang.srt.entrypoints.http_server.app is missing")
    if problems:
        raise SeamMismatch("SGLang seams do not match:\n  - " + "\n  - ".join(problems))
    return version
