"""What SGLang's processes accept from a request's custom-logit-processor fields.

mg starts SGLang with `--enable-custom-logit-processor` because SGLang hands a request's
`custom_params` to the model forward only for requests that name a processor; and SGLang turns a
processor string into code with `dill.loads`. The front refuses every client-supplied processor
and `custom_params` on every route (front.surface); this guard holds for a request that reached
SGLang any other way:
- SGLang's one deserializer (`_cache_from_str`: the scheduler's batches, the tokenizer manager's
  sampling-mask check) never unpickles: mg's own processor string gives mg's class, any other
  string is a ValueError (in the tokenizer manager, a 400 for that request).
- A request whose fields SGLang's own `Req` refuses (a ValueError or TypeError in its constructor,
  e.g. `return_hidden_states: []`, which stopped the scheduler) is made without them and aborted
  (400) instead.
- A `Req` (every request the scheduler creates) that names a processor must name mg's, with the server's mark in
  its `custom_params` (a random value of this server start that only the front knows) and mg's
  sampling fields of the types the front writes; otherwise its processor and params are dropped
  and it is aborted (400) before it is scheduled. The step seam reads marked rows only
  (rows.protected_rows), so no client can pose as deterministic.
- A marked deterministic `Req` that passes is announced to the seam (`on_admit`: its prompt goes to
  the controller at once, protocol `Arrive`).
"""

from __future__ import annotations

import hmac
import logging
import math

from mg_server.config import DETERMINISTIC_PARAM, MARK_PARAM, SEED_PARAM, TEMPERATURE_PARAM

log = logging.getLogger(__name__)

REFUSED = "custom_logit_processor and custom_params are not accepted by this server"
# What the request made in place of one whose fields SGLang's Req refused keeps (rid, text, ids and
# sampling parameters are positional): how its abort reaches its client; SGLang's own
# session-not-found abort passes the same.
SAFE_KWARGS = ("stream", "vocab_size", "http_worker_ipc", "eos_token_ids", "time_stats", "metrics_collector")


_on_admit = None  # install's on_admit (a later install may add it: the first one wrapped Req already)


def marked(params, mark: str) -> bool:
    """True if a request's custom_params carry this server's mark (constant-time compare)."""
    got = params.get(MARK_PARAM) if isinstance(params, dict) else None
    return bool(mark) and isinstance(got, str) and hmac.compare_digest(got.encode(), mark.encode())


def refusal(processor, params, ours: str, mark: str) -> str:
    """Why the scheduler must not run a request with these fields ("" if it may)."""
    if processor is None:
        return ""
    if processor != ours or not marked(params, mark):
        return REFUSED
    t, seed = params.get(TEMPERATURE_PARAM), params.get(SEED_PARAM)
    if t is not None and (isinstance(t, bool) or not isinstance(t, float) or not 0 < t < math.inf):
        return "mg's sampling fields are malformed"
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2 ** 64):
        return "mg's sampling fields are malformed"
    return ""


def install(mark: str, on_admit=None) -> None:
    """Guard this process's SGLang (idempotent): its deserializer, and every Req it creates
    (sglang_facts.check verifies both with the texts this relies on). on_admit(req): called for
    each marked deterministic Req that passes (the scheduler's seam); it must not raise."""
    global _on_admit
    if on_admit is not None:
        _on_admit = on_admit
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling import custom_logit_processor as clp

    from mg_server.seam.processor import MgFlagProcessor, serialized

    ours = serialized()

    def from_str(json_str: str):
        if json_str == ours:
            return MgFlagProcessor
        raise ValueError(REFUSED)

    clp._cache_from_str = from_str  # (CustomLogitProcessor.from_str calls the module's global)
    original = Req.__init__
    if getattr(original, "mg_guard", False):
        return

    def __init__(self, *args, **kwargs):
        try:
            original(self, *args, **kwargs)
        except (ValueError, TypeError) as e:  # a field SGLang's intake let through (its raise stops the scheduler)
            log.error("mg: request %s refused in the scheduler: %s", args[0] if args else "?", e)
            original(self, *args[:4], **{k: kwargs[k] for k in SAFE_KWARGS if k in kwargs})
            self.set_finish_with_abort(f"invalid request: {e}")
            return
        why = refusal(self.custom_logit_processor, self.sampling_params.custom_params, ours, mark)
        if why:
            log.error("mg: request %s refused in the scheduler: %s", self.rid, why)
            self.custom_logit_processor = None
            self.sampling_params.custom_params = None
            self.set_finish_with_abort(why)
        elif _on_admit is not None and self.custom_logit_processor is not None:
            params = self.sampling_params.custom_params
            if isinstance(params, dict) and params.get(DETERMINISTIC_PARAM):
                _on_admit(self)

    __init__.mg_guard = True
    Req.__init__ = __init__
