"""mg's forward hook on SGLang's `logits_processor` module (runs in SGLang's scheduler process).

SGLang calls it after every forward that produces next-token logits, prefill and decode alike,
with LogitsProcessor.forward's positional args `(input_ids, hidden_states, lm_head,
forward_batch, ...)` and its `LogitsProcessorOutput`. For the rows of requests that asked for
determinism it computes the top-1/top-2 margin of the pre-sampling logits and records it.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from mg_server import metrics
from mg_server.config import DETERMINISTIC_PARAM, HookConfig

log = logging.getLogger(__name__)


def protected_rows(forward_batch: ForwardBatch) -> list[int]:
    """Rows of this batch whose request carries mg_deterministic and samples a token now.

    A request in the middle of a chunked prefill gets logits for its chunk but SGLang drops
    that token (`req.is_chunked > 0`), so it is not a step.
    """
    info = forward_batch.sampling_info
    params = info.custom_params if info is not None else None
    if not params:
        return []
    rows = []
    for i, p in enumerate(params):
        if not p or not p.get(DETERMINISTIC_PARAM):
            continue
        req = p.get("__req__")  # SGLang adds the Req object to a request's custom_params
        if req is not None and getattr(req, "is_chunked", 0) > 0:
            continue
        rows.append(i)
    return rows


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    """logits: [rows, vocab] (model dtype) -> margin [rows] fp32, top-1 minus top-2."""
    top = logits.float().topk(2, dim=-1).values  # [rows, 2] fp32
    return top[:, 0] - top[:, 1]


class MarginHook:
    def __init__(self, config: HookConfig):
        self.config = config
        self.steps, self.margin = metrics.hook_metrics(config.margin_buckets)

    def __call__(self, module, args, output):
        forward_batch = args[3] if len(args) > 3 else None
        if not isinstance(forward_batch, ForwardBatch):
            return None
        rows = protected_rows(forward_batch)
        if not rows:
            return None
        logits = output.next_token_logits  # [bs, vocab], pre-sampling, model dtype
        margins = top2_margin(logits[rows]).tolist()
        self.steps.inc(len(rows))
        for m in margins:
            self.margin.observe(m)
        return None  # the output is left as it is


def make_hook(config: dict) -> MarginHook:
    """Factory named in SGLang's --forward-hooks spec."""
    hook = MarginHook(HookConfig.from_json_dict(config))
    log.info("mg forward hook ready (metrics in %s)", config.get("metrics_dir"))
    return hook
