"""The verifier's deterministic K/V pool on a GPU: sized to the deterministic load, not to the
context.

Why: the pool holds the shadow K/V of the deterministic requests being checked; it was sized to
two whole contexts (262,144 tokens, 34 GB for Llama-3.1-8B), which left SGLang 0.60x of its K/V.
Now it is a cache (the engine evicts the least recently used request that a forward does not
need; the controller computes an evicted one again from position 0, with the same bits), so
its size bounds memory, not correctness. It is allocated before SGLang starts, so SGLang's own
sizing (free memory x --mem-fraction-static, less its weights) counts it: SGLang's K/V shrinks by
mem_fraction_static x the verifier's memory.

Default: KV_SHARE of what SGLang's K/V would be without mg (free memory x SGLang's fraction, less
the checkpoint's bytes: checkpoint.ModelSpec.weight_bytes), at least MIN_TOKENS; `--mg-kv-budget-gb G`
sets it. A request longer than the pool is refused at its first step, naming the budget.
"""

from __future__ import annotations

from mg_server.config import VerifierConfig

SGLANG_FRACTION = VerifierConfig.sglang_fraction  # SGLang's --mem-fraction-static when not given
KV_SHARE = 0.02  # of plain SGLang's K/V: with the verifier's ~1 GB of context and workspace, SGLang keeps >= 0.95x
MIN_TOKENS = 4096  # a pool below this would evict on every check of a handful of requests
ROUND = 256  # pool sizes in whole multiples (a stable number in logs and fingerprints of runs)


def token_bytes(spec, dtype_bytes: int = 2) -> int:
    """K and V of one token, every layer."""
    return 2 * spec.n_layers * spec.n_kv_heads * spec.head_dim * dtype_bytes


def pool_tokens(spec, free_bytes: int, sglang_fraction: float, weights_bytes: int, budget_gb: float = 0.0,
                max_tokens: int = 1 << 20, dtype_bytes: int = 2) -> int:
    """The pool's tokens: `budget_gb` of K/V if given, else KV_SHARE of SGLang's estimated K/V
    (free_bytes x sglang_fraction - weights_bytes); at most `max_tokens`."""
    per = token_bytes(spec, dtype_bytes)
    if budget_gb > 0:
        tokens = int(budget_gb * (1 << 30)) // per
    else:
        plain = max(0, int(free_bytes * sglang_fraction) - weights_bytes)
        tokens = max(MIN_TOKENS, int(KV_SHARE * plain) // per)
    return max(ROUND, min(max_tokens, tokens) // ROUND * ROUND)
