"""The custom logit processor that deterministic requests name.

SGLang hands a request's `custom_params` to the model forward only for requests that name a
custom logit processor; this one leaves the logits untouched (all of mg's work happens in the
forward hook). It is serialized by reference (module + class name), so SGLang's scheduler
imports it from this module instead of executing shipped code.
"""

from __future__ import annotations

from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor


class MgFlagProcessor(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        return logits


def serialized() -> str:
    return MgFlagProcessor.to_str()
