"""What a request carrying `X-Deterministic` may be, and the body SGLang gets for it.

- The header's value: 1/0/true/false (case-insensitive); anything else is a 400.
- Endpoints, deny by default: the header is served on the generation endpoints mg rewrites
  (`GENERATE_ROUTES`) and passes on a few read-only ones (`READ_ONLY`); any other request that
  carries it (other SGLang endpoints, and any SGLang adds later) is a 400 naming the supported
  ones, so a client never gets an echoed header on an answer mg did not check.
- Parameters, for `X-Deterministic: 1`: greedy (an unset temperature becomes 0) or seeded
  sampling (temperature > 0 with a seed: `seed`, on /generate `sampling_params.sampling_seed`;
  without one a 400 says to add it; `top_p`, `top_k`, `min_p` must then be neutral, since they
  cut the candidates by the fast path's ranks, which the margin does not guard). Seeded requests
  carry temperature and seed in mg's custom_params and SGLang sees temperature 0: mg samples
  (hook module doc) and SGLang greedy-decodes the logits mg forced. One completion per
  prompt (n > 1 with a seed is split into single samples first: front.samples), and nothing
  that changes which token greedy decoding emits in a way
  the verifier does not compute (penalties, logit bias, a minimum length, grammars and
  structured outputs, LoRA adapters, non-text inputs), nor logprobs (mg forces each verified
  step's logits to the decided token, so SGLang's logprobs of those steps would be meaningless),
  nor hidden states or routed experts (the fast path's, of steps nobody sees too).
  A request without the header (or with `X-Deterministic: 0`) is not rewritten: SGLang serves it.
  Each is a 400 naming the parameter. `top_p`, `top_k`, `min_p` and `seed` are accepted: at
  temperature 0 SGLang samples with top_k = 1, so they cannot change the token.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from mg_server.config import DETERMINISTIC_PARAM, MARK_PARAM, SEED_PARAM, TEMPERATURE_PARAM

_VALUES = {"1": True, "true": True, "0": False, "false": False}
OPENAI_PATHS = ("/v1/chat/completions", "/v1/completions")
NATIVE_PATHS = ("/generate",)
# (method, path) of the requests mg rewrites and verifies.
GENERATE_ROUTES = {("POST", p) for p in OPENAI_PATHS + NATIVE_PATHS} | {("PUT", "/generate")}
# GET paths (or prefixes, ending in "/") that generate nothing: the header passes, echoed.
READ_ONLY = ("/health", "/health_generate", "/v1/models", "/v1/models/", "/get_model_info", "/model_info",
             "/metrics")
SUPPORTED = "POST /v1/chat/completions, POST /v1/completions, POST|PUT /generate"

# Parameters with a value that leaves greedy decoding as the verifier computes it; any other
# value is refused. None (unset) is always fine.
NEUTRAL: dict[str, Any] = {
    "n": 1, "best_of": 1,
    "frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1,
    "min_tokens": 0, "min_new_tokens": 0, "top_logprobs": 0, "beam_width": 1,
}
# Parameters refused whenever set (any value but None): they change the emitted tokens or need
# the logits of steps whose logits mg forces.
UNMODELLED: dict[str, str] = {
    "regex": "grammar-constrained decoding", "ebnf": "grammar-constrained decoding",
    "json_schema": "grammar-constrained decoding", "structural_tag": "grammar-constrained decoding",
    "logit_bias": "a logit bias", "lora_path": "LoRA adapters", "lora_id": "LoRA adapters",
    "input_embeds": "input embeddings", "image_data": "non-text inputs", "video_data": "non-text inputs",
    "audio_data": "non-text inputs", "watermark": "watermarked sampling", "max_thinking_tokens": "a thinking budget",
}
# Extra outputs refused when asked for (a true value): they are the fast path's, per step
# SGLang ran, which for a deterministic request includes steps nobody sees (a rollback's
# discarded tokens, a held end's surplus).
EXTRA_OUTPUTS = {"return_hidden_states": "hidden states", "return_routed_experts": "routed experts"}
WHY_NEUTRAL = {
    "n": "more than one completion per prompt", "best_of": "more than one completion per prompt",
    "frequency_penalty": "penalties", "presence_penalty": "penalties", "repetition_penalty": "penalties",
    "min_tokens": "a minimum length", "min_new_tokens": "a minimum length",
    "top_logprobs": "logprobs", "beam_width": "beam search",
}


class BadRequest(Exception):
    def __init__(self, message: str, param: str = "X-Deterministic"):
        super().__init__(message)
        self.param = param  # the request field the client has to change


def parse_flag(raw: bytes) -> bool:
    value = raw.decode("latin-1").strip().lower()
    if value not in _VALUES:
        raise BadRequest(f"X-Deterministic must be one of 1, 0, true, false; got {value!r}")
    return _VALUES[value]


def route(method: str, path: str) -> str:
    """"rewrite" for a generation endpoint mg handles, "pass" for a read-only one; else a 400."""
    if (method, path) in GENERATE_ROUTES:
        return "rewrite"
    if method in ("GET", "HEAD") and any(path == p or (p.endswith("/") and path.startswith(p)) for p in READ_ONLY):
        return "pass"
    raise BadRequest(f"X-Deterministic is served on {SUPPORTED} only (not on {method} {path}); "
                     "send this request without the header")


def _refused(name: str, value: Any, where: str, why: str) -> BadRequest:
    shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
    return BadRequest(f"X-Deterministic: 1 cannot be combined with {where}{name}={shown}: mg's verifier "
                      f"does not compute {why}; drop it, or send the request without the header",
                      param=f"{where}{name}")


def check_params(params: dict, where: str) -> None:
    """Refuse what the verifier does not model in one set of sampling parameters (a deterministic
    request's OpenAI body, or one /generate `sampling_params` object)."""
    for name, neutral in NEUTRAL.items():
        value = params.get(name)
        if value is not None and value != neutral:
            raise _refused(name, value, where, WHY_NEUTRAL[name])
    for name, why in UNMODELLED.items():
        if params.get(name) is not None:
            raise _refused(name, params[name], where, why)
    for name, why in EXTRA_OUTPUTS.items():
        if params.get(name):
            raise _refused(name, params[name], where, why)
    logprobs = params.get("logprobs")  # chat: a bool; completions: an int, where 0 asks for one logprob
    if logprobs is not None and logprobs is not False:
        raise _refused("logprobs", logprobs, where, "logprobs")
    fmt = params.get("response_format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise _refused("response_format", fmt, where, "structured outputs (grammar-constrained decoding)")
    choice, tools = params.get("tool_choice"), params.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest(f"{where}tools must be a list (got {type(tools).__name__})", param=f"{where}tools")
    if tools and (choice == "required" or isinstance(choice, dict)):
        raise _refused("tool_choice", choice, where, "forced tool calls (grammar-constrained decoding)")
    for i, tool in enumerate(params.get("tools") or ()):
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict) and tool["function"].get("strict"):
            raise _refused(f"tools[{i}].function.strict", True, where, "strict tool schemas (grammar-constrained "
                           "decoding)")


def _check_native_top_level(body: dict) -> None:
    """/generate fields outside sampling_params (logprobs may be a list, one per prompt)."""
    for name, why in {"return_logprob": "logprobs", **EXTRA_OUTPUTS}.items():
        value = body.get(name)
        if value and (not isinstance(value, list) or any(value)):
            raise _refused(name, value, "", why)
    for name in ("lora_path", "lora_id", "input_embeds", "image_data", "video_data", "audio_data", "watermark",
                 "max_thinking_tokens"):
        if body.get(name) is not None:
            raise _refused(name, body[name], "", UNMODELLED[name])


def _mark_params(params: Any, where: str, mark: str) -> dict:
    """A deterministic request's sampling parameters, checked, with mg's fields set (the client
    cannot have set any: front.surface refuses custom_params)."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest(f"{where or 'request'} must be an object", param=where.rstrip(".") or "body")
    out = dict(params)
    check_params(out, where)
    # An unset temperature would default to SGLang's sampling, so it is pinned to 0; a seeded
    # one moves into custom_params (mg samples, SGLang decodes greedily).
    temperature, seed = sampling_rule(out, where)
    out["temperature"] = 0.0
    out["custom_params"] = {DETERMINISTIC_PARAM: True, MARK_PARAM: mark}
    if temperature > 0:
        out["custom_params"].update({TEMPERATURE_PARAM: temperature, SEED_PARAM: seed})
    return out


TRUNCATION = {"top_p": 1, "top_k": (-1, 0), "min_p": 0}  # neutral values of the candidate cut-offs
SEED_KEYS = ("seed", "sampling_seed")  # OpenAI bodies; /generate's sampling_params


def sampling_rule(params: dict, where: str = "") -> tuple[float, int]:
    """(temperature, seed mod 2**64) of a deterministic request's parameters; (0.0, 0) is greedy.
    Temperature > 0 needs a seed and no top_p / top_k / min_p cut-off (each a 400 naming it)."""
    temperature = params.get("temperature")
    if temperature is None or (isinstance(temperature, (int, float)) and temperature == 0):
        return 0.0, 0
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 < temperature < math.inf:
        raise BadRequest(f"{where}temperature must be a finite number >= 0 (got {temperature!r})",
                         param=f"{where}temperature")
    key = SEED_KEYS[1] if where.startswith("sampling_params") else SEED_KEYS[0]
    seed = params.get(key)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise BadRequest(f"X-Deterministic: 1 with {where}temperature={temperature!r} samples reproducibly only "
                         f"with a seed: add an integer {where}{key} (or set temperature 0 for greedy decoding)",
                         param=f"{where}{key}")
    for name, neutral in TRUNCATION.items():
        value = params.get(name)
        if value is not None and value not in (neutral if isinstance(neutral, tuple) else (neutral,)):
            raise _refused(name, value, where, "sampling with top_p, top_k or min_p at temperature > 0 (they cut "
                           "the candidates by the fast path's ranks, which mg's margin does not guard)")
    return float(temperature), seed & (2 ** 64 - 1)


def _assign_rids(body: dict, path: str) -> list[str]:
    """Deterministic requests carry an id mg knows, to ask the controller for their verdict."""
    rid = body.get("rid")
    if isinstance(rid, str) and rid:
        return [rid]
    if isinstance(rid, list) and rid and all(isinstance(r, str) and r for r in rid):
        return rid
    if rid is not None:
        raise BadRequest("rid must be a non-empty string or a list of them", param="rid")
    batch = None  # /generate takes a list of prompts; then SGLang wants a list of rids
    if path in NATIVE_PATHS:
        for key in ("text", "input_ids"):
            value = body.get(key)
            if isinstance(value, list) and value and (key == "text" or isinstance(value[0], list)):
                batch = len(value)
    rids = [f"mg-{uuid.uuid4().hex}" for _ in range(batch or 1)]
    body["rid"] = rids if batch else rids[0]
    return rids


def empty_answer_rids(body: dict, rids: list[str]) -> set[str]:
    """The prompts of a deterministic body that ask for no token (/generate `max_new_tokens` 0,
    OpenAI `max_tokens` 0; front.surface made it the one OpenAI limit): SGLang only prefills
    them, so mg sees no step; their empty answer is complete and has no token left unchecked,
    so their verdict is `verified` without asking the controller (front.verdict checks that the
    answer has no token)."""
    if "sampling_params" not in body:
        limit = body.get("max_tokens")
        return set(rids) if limit == 0 and not isinstance(limit, bool) else set()
    params = body.get("sampling_params")
    per = params if isinstance(params, list) else [params] * len(rids)
    return {rid for rid, p in zip(rids, per) if isinstance(p, dict) and p.get("max_new_tokens") == 0
            and not isinstance(p.get("max_new_tokens"), bool)}


def rewrite_body(body: dict, path: str, noop_processor: str, mark: str) -> dict:
    """The body SGLang gets for a request with X-Deterministic: 1: checked, mg's processor named,
    each parameter set marked (config.MARK_PARAM), request ids assigned."""
    if path in OPENAI_PATHS:
        out = _mark_params(body, "", mark)
    else:  # /generate: flags live in sampling_params, one dict or one per prompt
        _check_native_top_level(body)
        out = dict(body)
        params = body.get("sampling_params")
        if isinstance(params, list):
            out["sampling_params"] = [_mark_params(p, f"sampling_params[{i}].", mark) for i, p in enumerate(params)]
        else:
            out["sampling_params"] = _mark_params(params, "sampling_params.", mark)
    out["custom_logit_processor"] = noop_processor
    _assign_rids(out, path)
    return out
