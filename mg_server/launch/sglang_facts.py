"""The SGLang versions mg supports and the internals it relies on, checked at start-up.

mg never edits SGLang; it attaches through `--forward-hooks` (whose factory puts mg's step seam
on the model runner's Sampler, see hook.py), `custom_params` and the KV pool API. Those are
internals, so the server refuses to start unless the installed SGLang is one of the versions
these seams were tested against (`TESTED`), naming the range, and unless every signature and
source fact below holds. `--mg-allow-sglang VERSION` lets one named untested version start (the
log and /metrics record it); its facts are still checked (where a fact's text differs between
tested versions, any of those texts passes).

docs/sglang-internals.md lists each fact with the version that changed it.
"""

from __future__ import annotations

import dataclasses
import inspect
import re

# Versions the seams check and the test suite ran against (CPU; the GPU device too: README).
TESTED = ("0.5.22", "0.5.23")
DEFAULT = "0.5.23"  # what `make serve` installs and the Docker image is built on
RANGE = f"{TESTED[0]} to {TESTED[-1]}"

# Source facts whose text changed inside the tested range: {version: text}; a version without an
# entry (an allowed untested one) may hold any of them (the seam handles each).
REQ_PARAM = {"0.5.22": '"__req__": self', "0.5.23": '"__req__": weakref.proxy(self)'}


class SeamMismatch(RuntimeError):
    pass


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _positional(fn) -> list[str]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [n for n, p in inspect.signature(fn).parameters.items() if p.kind in kinds]


def _code(text: str) -> str:
    """Source without comments and whitespace, so a fact survives reformatting."""
    return re.sub(r"\s+", "", re.sub(r"#[^\n]*", "", text))


def _missing(sources) -> list[str]:
    """The (what, object, needles) source facts that do not hold (a needle tuple: any one text)."""
    problems = []
    for what, obj, needles in sources:
        try:
            text = _code(inspect.getsource(obj))
        except (OSError, TypeError):
            problems.append(f"{what}: source not available to check")
            continue
        for n in needles:
            alts = n if isinstance(n, tuple) else (n,)
            if not any(_code(a) in text for a in alts):
                problems.append(f"{what} no longer contains {' or '.join(map(repr, alts))}")
    return problems


def check_window() -> None:
    """The facts rollback.py (the window commit) relies on: how a decode step adds a token and
    ends a request, how the next decode batch grows its lengths and slots, and how output reaches
    the detokenizer. Raise SeamMismatch unless they hold."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.managers.scheduler_components import batch_result_processor, output_streamer
    from sglang.srt.mem_cache import allocation, common
    from sglang.srt.model_executor.model_runner import ModelRunner

    problems = _missing([
        ("batch_result_processor", batch_result_processor,
         ("req.output_ids.extend(next_token_id)new_accept_len=len(next_token_id)",
          "req.update_finish_state(new_accept_len)", "req.finished()orreq.is_retracted")),
        ("ScheduleBatch.prepare_for_decode", ScheduleBatch.prepare_for_decode,
         ("self.out_cache_loc=alloc_for_decode(self,token_per_req=1)", "self.seq_lens=self.seq_lens+1",
          "self.seq_lens_cpu=self.seq_lens_cpu+1", "self.orig_seq_lens=self.orig_seq_lens+1")),
        ("alloc_for_decode_default", allocation.alloc_for_decode_default,
         ("req.kv.kv_allocated_len+=token_per_req", "req.kv.kv_committed_len+=token_per_req")),
        ("_GenerationStreamAccumulator.accept", output_streamer._GenerationStreamAccumulator.accept,
         ("defaccept(self,*,req:Req)", "output_ids_=req.output_ids_through_stop",
          "req.send_token_offset=len(output_ids_)")),
        ("Req.next_output_finishes_by_length", Req.next_output_finishes_by_length, ("len(self.output_ids)",)),
        ("Req.reset_for_retract", Req.reset_for_retract, ("self.is_retracted=True",)),
        # a running request's admission reserve: what a held end may still decode is added there
        ("PrefillAdder.__init__", PrefillAdder.__init__,
         ("self._get_running_request_total_token_offset(r)forrinrunning_batch.reqs",)),
        ("PrefillAdder._get_running_request_total_token_offset", PrefillAdder._get_running_request_total_token_offset,
         ("def_get_running_request_total_token_offset(self,req:Req)",
          "req.sampling_params.max_new_tokens-len(req.output_ids)")),
        # a held end finishes like a speculative overshoot: the answer through finished_len, the
        # K/V past it freed, and an update of a finished request changes nothing
        ("Req.output_ids_through_stop", Req.output_ids_through_stop.fget,
         ("returnself.output_ids[:self.finished_len]",)),
        ("Req.owned_kv_len", Req.owned_kv_len, ("ifself.finished_lenisNone:", "len(self.output_ids_through_stop)")),
        ("Req.update_finish_state", Req.update_finish_state, ("ifself.finished():return",)),
        ("release_kv_cache", common.release_kv_cache, ("owned_kv_len=req.owned_kv_len()",)),
        ("ModelRunner.__init__", ModelRunner.__init__, ("self.model_config=model_config",)),
    ])
    if problems:
        raise SeamMismatch("SGLang seams of the window commit do not match:\n  - " + "\n  - ".join(problems))


def fp32_logits_in_place() -> bool:
    """Whether SGLang's `--enable-fp32-lm-head` on CUDA is an unquantized bf16 LM head's GEMM with
    an fp32 output (no extra weight read) rather than an fp32 copy of the LM head at every forward.
    False where the source is not that (or not found): the fast path then keeps bf16 logits."""
    try:
        from sglang.srt.layers.logits_processor import LogitsProcessor
    except ImportError:
        return False
    fn = getattr(LogitsProcessor, "_compute_lm_head", None)
    same_dtype = "use_mm_out_dtype=(hidden_states.is_cudaandhidden_states.dtype==lm_head.weight.dtype"
    mm = "torch.mm(hidden_states,lm_head.weight.T,out_dtype=torch.float32"
    return fn is not None and not _missing([("LogitsProcessor._compute_lm_head", fn, (same_dtype, mm))])


def version_problem(version: str, allow: str = "") -> str:
    """Why this SGLang version may not start ("" if it may)."""
    if version in TESTED or (allow and version == allow):
        return ""
    return (f"SGLang {version} is installed; mg_server supports SGLang {RANGE} ({', '.join(TESTED)}). "
            f"Install sglang=={DEFAULT}, or pass --mg-allow-sglang {version} to start on this version anyway "
            "(its internals are still checked)")


def check(allow: str = "") -> str:
    """Raise SeamMismatch unless the version may start and every seam is as expected; returns
    the SGLang version. `allow`: one untested version the user accepts (--mg-allow-sglang)."""
    import sglang

    version = getattr(sglang, "__version__", "?")
    problems = [p for p in [version_problem(version, allow)] if p]

    from sglang.srt.arg_groups.arg_utils import record_fields
    from sglang.srt.entrypoints import http_server
    from sglang.srt.layers.logits_processor import LogitsProcessorOutput
    from sglang.srt.layers.sampler import Sampler
    from sglang.srt.managers.schedule_batch import Req, ReqKvInfo
    from sglang.srt.managers.scheduler_components import batch_result_processor
    from sglang.srt.model_executor import hook_manager
    from sglang.srt.sampling import custom_logit_processor as clp
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.model_executor.model_runner_components import cuda_graph_setup
    from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    expect = [
        # The seam is a forward pre-hook on the Sampler: it reads these positional args.
        ("Sampler.forward positional args", _positional(Sampler.forward),
         ["self", "logits_output", "sampling_info", "return_logprob", "top_logprobs_nums",
          "token_ids_logprobs", "positions"]),
        ("register_forward_hooks args", _params(hook_manager.register_forward_hooks), ["model", "hook_specs"]),
        ("launch_server first arg", _params(http_server.launch_server)[:1], ["server_args"]),
    ]
    expect.append(("Req.__init__ first args", _positional(Req.__init__)[:5],
                   ["self", "rid", "origin_input_text", "origin_input_ids", "sampling_params"]))
    for what, got, want in expect:
        if got != want:
            problems.append(f"{what}: expected {want}, found {got}")
    req_param = (REQ_PARAM[version],) if version in REQ_PARAM else tuple(REQ_PARAM.values())
    sources = [
        # the sampler gets every forward's logits, sampling info and positions positionally
        ("ModelRunner.sample", ModelRunner.sample,
         ("self.sampler(logits_output,forward_batch.sampling_info,forward_batch.return_logprob,"
          "forward_batch.top_logprobs_nums,forward_batch.token_ids_logprobs,",)),
        # the hook factory runs after the graphs are captured, with the runner in its caller's
        # frame (hook.find_model_runner), whose attributes the seam uses
        ("finalize_cuda_graph_capture", cuda_graph_setup.finalize_cuda_graph_capture,
         ("register_forward_hooks(model_runner.model,",)),
        ("ModelRunner.initialize", ModelRunner.initialize, ("self.sampler=",)),
        ("ModelRunner", ModelRunner, ("self.token_to_kv_pool=", "self.req_to_token_pool=")),
        ("Req.__init__", Req.__init__, ("self.origin_input_ids=", "self.output_ids=array(", "self.kv=ReqKvInfo()",
                                        req_param, "self.sampling_params=", "self.grammar:",
                                        "self.return_logprob=", "self.lora_id=", "self.eos_token_ids=",
                                        "self.to_finish:", "self.finished_reason:")),
        # link.end_rules mirrors these end rules of a request (its token rules and length)
        ("Req._check_token_based_finish", Req._check_token_based_finish,
         ("self.sampling_params.ignore_eos", "self.sampling_params.stop_token_ids", "self.eos_token_ids",
          "self.tokenizer.eos_token_id", "self.tokenizer.additional_stop_token_ids")),
        ("Req.update_finish_state", Req.update_finish_state,
         ("iflen(self.output_ids)>=self.sampling_params.max_new_tokens:", "self._check_token_based_finish(",
          "self._check_str_based_finish(")),
        # seam/guard.py: a Req takes (rid, text, ids, sampling params) first and keeps its processor;
        # SGLang's one processor deserializer is the module global the guard replaces
        ("Req.__init__ (processor)", Req.__init__, ("self.custom_logit_processor=custom_logit_processor",)),
        ("Req.set_finish_with_abort", Req.set_finish_with_abort, ("self.to_finish=FINISH_ABORT(",)),
        ("CustomLogitProcessor.from_str", CustomLogitProcessor.from_str, ("return_cache_from_str(json_str)()",)),
        ("SamplingBatchInfo.from_schedule_batch", SamplingBatchInfo.from_schedule_batch,
         ("processor=CustomLogitProcessor.from_str(processor_str)", "r.sampling_params.custom_paramsforrinreqs")),
        # the window commit's output hold sees each token as the scheduler adds it (rollback.HeldOutputs)
        ("batch_result_processor", batch_result_processor,
         ("req.output_ids.append(next_token_id)", "req.output_ids.extend(next_token_id)")),
    ]
    problems += _missing(sources)
    fields = [
        ("LogitsProcessorOutput", {f.name for f in dataclasses.fields(LogitsProcessorOutput)}, ("next_token_logits",)),
        ("SamplingBatchInfo", {f.name for f in dataclasses.fields(SamplingBatchInfo)},
         ("custom_params", "has_custom_logit_processor", "custom_logit_processor")),
        ("ReqKvInfo", {f.name for f in dataclasses.fields(ReqKvInfo)}, ("req_pool_idx",)),
        # reasons.unmodelled and link.end_rules read these
        ("SamplingParams", set(SamplingParams.__struct_fields__),
         ("max_new_tokens", "stop_token_ids", "ignore_eos", "frequency_penalty", "presence_penalty",
          "repetition_penalty", "min_new_tokens", "logit_bias", "stop_strs", "stop_regex_strs", "custom_params",
          "watermark", "beam_width")),
        ("ServerArgs", {f.name for f in record_fields(ServerArgs)},
         ("forward_hooks", "enable_custom_logit_processor", "speculative_algorithm", "tp_size", "pp_size", "dp_size",
          "attn_dp_size", "attn_cp_size", "dcp_size", "enable_dp_attention", "kv_cache_dtype", "dtype",
          "enable_hierarchical_cache", "grammar_backend", "device", "context_length", "api_key",
          "startup_weight_load_mode", "enable_memory_saver", "weight_cache_mode", "cpu_offload_gb", "enable_lora",
          "lora_paths", "quantization", "mem_fraction_static", "served_model_name")),
    ]
    for what, have, names in fields:
        problems += [f"{what} has no field {n!r}" for n in names if n not in have]
    if not callable(getattr(CustomLogitProcessor, "to_str", None)):
        problems.append("CustomLogitProcessor.to_str is missing")
    if not callable(getattr(clp, "_cache_from_str", None)):
        problems.append("sglang.srt.sampling.custom_logit_processor._cache_from_str is missing")
    from sglang.srt.managers.tokenizer_manager import SignalHandler
    from sglang.srt.utils import common

    # shutdown.install wraps these: SGLang's process-tree kill and its SIGTERM handler
    if _params(common.kill_process_tree)[:2] != ["parent_pid", "include_parent"]:
        problems.append(f"kill_process_tree args: expected ['parent_pid', 'include_parent', ...], found "
                        f"{_params(common.kill_process_tree)}")
    if not callable(getattr(SignalHandler, "sigterm_handler", None)):
        problems.append("SignalHandler.sigterm_handler is missing")

    # shutdown.sglang_children passes these, wrapping their defaults (SGLang's child entry points)
    from mg_server.launch.shutdown import CHILD_ENTRIES

    entries = inspect.signature(http_server.launch_server).parameters
    for name in CHILD_ENTRIES:
        if name not in entries or not callable(entries[name].default):
            problems.append(f"launch_server has no {name} parameter with SGLang's entry point as its default")
    if not hasattr(http_server, "app"):
        problems.append("sglang.srt.entrypoints.http_server.app is missing")
    # seam/ranks.py: the TP ranks' CPU group, this rank, rank 0's global rank
    from sglang.srt.distributed import parallel_state

    if not callable(getattr(parallel_state, "get_tp_group", None)):
        problems.append("sglang.srt.distributed.parallel_state.get_tp_group is missing")
    problems += [f"GroupCoordinator has no {n!r}" for n in ("cpu_group", "first_rank", "rank_in_group", "world_size")
                 if n not in _code(inspect.getsource(parallel_state.GroupCoordinator))]
    if problems:
        raise SeamMismatch("SGLang seams do not match:\n  - " + "\n  - ".join(problems))
    return version
