"""Why a deterministic request cannot be served, and what its client is told.

`unmodelled(req)`: a request parameter the verifier does not compute (the front refuses these
with a 400 naming them; this catches any other way in). `public_reason(why)`: the part of a
failure reason the client can act on (a parameter, its request id, mg being down); mg's internal
state (positions, token counts, controller and verifier errors) stays in the server log.
"""

from __future__ import annotations

UNMODELLED_REASONS = {
    "grammar": "grammar-constrained decoding is not verified (the verifier decodes unconstrained)",
    "penalties": "penalties, logit_bias and min_new_tokens are not verified (the verifier does not apply them)",
    "logprobs": "logprobs are not served (mg forces the logits of every deterministic step)",
    "lora": "LoRA adapters are not verified (the verifier runs the base model)",
    "watermark": "watermarked sampling is not verified (the verifier does not apply the watermark)",
    "beam": "beam search is not verified (the verifier decodes one sequence)",
}
PUBLIC_REASONS = frozenset(UNMODELLED_REASONS.values())
# (prefix of an internal reason, what the client is told)
PUBLIC_PREFIXES = (("mg controller unavailable", "mg controller unavailable"),
                   ("deterministic verifier is not running", "deterministic verifier is not running"),
                   ("verifier: [", "the deterministic verifier failed on this request"))
INTERNAL_REASON = "mg could not verify this request (the server log has the details)"


def unmodelled(req) -> str:
    """Why the verifier could not compute this request's greedy tokens ("" if it can).

    The front refuses these parameters with a 400 naming them; this catches any other way in
    (a grammar SGLang adds itself, e.g. for strict tools; mg's flag set in custom_params without
    the header), so such a request fails instead of getting a verdict about other tokens."""
    sp = req.sampling_params
    if req.grammar is not None:
        return UNMODELLED_REASONS["grammar"]
    if sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1 or sp.min_new_tokens or sp.logit_bias:
        return UNMODELLED_REASONS["penalties"]
    if req.return_logprob:
        return UNMODELLED_REASONS["logprobs"]
    if req.lora_id:
        return UNMODELLED_REASONS["lora"]
    if sp.watermark is not None:
        return UNMODELLED_REASONS["watermark"]
    if (sp.beam_width or 1) > 1:
        return UNMODELLED_REASONS["beam"]
    return ""


BUDGET_FLAG = "--mg-kv-budget-gb"
OVER_BUDGET = "this request may reach "  # over_budget's reasons begin so: the client's to fix (a 400)


def over_budget(req, pool_tokens: int) -> str:
    """Why this request cannot fit the verifier's K/V pool alone ("" if it can): its prompt and
    its length limit together exceed the pool's tokens (the client's to act on: a 400)."""
    need = len(req.origin_input_ids) + int(req.sampling_params.max_new_tokens or 0)
    if not pool_tokens or need <= pool_tokens:
        return ""
    return (f"{OVER_BUDGET}{need} tokens (prompt and max_tokens) but the deterministic verifier's "
            f"K/V pool holds {pool_tokens}; send a shorter request or raise {BUDGET_FLAG}")


def public_reason(why: str) -> str:
    """The client's form of an internal failure reason (module doc)."""
    if why in PUBLIC_REASONS or why.startswith(("request id ", OVER_BUDGET)):
        return why
    return next((short for prefix, short in PUBLIC_PREFIXES if why.startswith(prefix)), INTERNAL_REASON)
