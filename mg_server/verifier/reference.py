"""Verifier-alone decoding: the canonical answer of a deterministic request (greedy, or seeded
sampling with `temperature` > 0 and a seed per prompt).

Several prompts are decoded in the same forwards: the verifier's kernels are batch-invariant
(tested: 1 vs 8 co-batched requests give bitwise-equal results), so this equals decoding each
prompt alone and is much faster.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mg_server.wire.protocol import ErrorReply, VerifyItem


@dataclass
class Reference:
    prompt: list[int]
    tokens: list[int] = field(default_factory=list)  # generated tokens
    margins: list[float] = field(default_factory=list)  # verifier margin at each generated token


def greedy_reference(engine, prompts: list[list[int]], max_new: int, stop_ids: tuple[int, ...] = (),
                     rid_prefix: str = "ref", progress=None, temperature: float = 0.0,
                     seeds: list[int] | None = None) -> list[Reference]:
    """Decode each prompt for max_new tokens (or until a stop id, which is kept): greedily, or,
    with temperature > 0, by seeded sampling with seeds[i] for prompt i (the rule mg applies to
    a deterministic request with that temperature and seed).
    `progress(n)`, if given, is called after every forward with the tokens it produced."""
    if temperature > 0 and (seeds is None or len(seeds) != len(prompts)):
        raise ValueError("seeded sampling needs one seed per prompt")
    refs = [Reference(prompt=list(p)) for p in prompts]
    live = list(range(len(refs)))
    try:
        while live:
            items = []
            for i in live:
                r = refs[i]
                seq = r.prompt + r.tokens
                new = seq if not r.tokens else seq[-1:]
                items.append(VerifyItem(rid=f"{rid_prefix}-{i}", pos=len(seq) - 1, tokens=new,
                                        prompt_len=len(r.prompt) if not r.tokens else 0,
                                        temperature=temperature, seed=seeds[i] if temperature > 0 else 0))
            outs = engine.step(items)
            if progress is not None:
                progress(len(items))
            for i, out in zip(list(live), outs):
                if isinstance(out, ErrorReply):
                    raise RuntimeError(f"reference decoding failed: [{out.code}] {out.message}")
                refs[i].tokens.append(out.token)
                refs[i].margins.append(out.margin)
                if len(refs[i].tokens) >= max_new or out.token in stop_ids:
                    live.remove(i)
    finally:
        for i in range(len(refs)):
            engine.release(f"{rid_prefix}-{i}")
    return refs


def load_engine(model, dtype: str = "bfloat16", device: str = "cpu", max_seq_len: int = 4096,
                max_requests: int = 64, pool_tokens: int = 32768, evict_idle_s: float = float("inf"),
                cuda_graphs: bool = True):
    """A verifier engine on a checkpoint (a folder or a checkpoint.Checkpoint; the reference: the
    worker computes the same on SGLang's tensors, tests/test_shared_weights.py). cuda_graphs (CUDA
    only): replay captured graphs for forwards of up to 128 rows."""
    import torch

    from mg_server.verifier.engine import VerifierEngine
    from mg_server.verifier.model import VerifierModel

    loaded = VerifierModel.load(model, getattr(torch, dtype), device, max_seq_len)
    return VerifierEngine(loaded, max_requests, pool_tokens, max_seq_len, evict_idle_s, cuda_graphs)
