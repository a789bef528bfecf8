"""What the step seam reads of a forward's rows and writes into them (hook.py, ranks.py, lagged.py):
the protected rows of a batch, the top-1/top-2 margin, the decided tokens forced into the logits."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from mg_server.config import DETERMINISTIC_PARAM, INSTANCE_PARAM, instance_key
from mg_server.seam import guard


def the_req(ref):
    """SGLang's Req behind custom_params["__req__"]: the object itself, or (0.5.23) a weak proxy.
    mg keeps the Req until it has reported the request's end (link.Tracked), after SGLang may
    have dropped it, so it holds the object: a bound method's __self__ is the proxy's referent."""
    return ref.finished.__self__ if isinstance(ref, weakref.ProxyTypes) else ref


def protected_rows(sampling_info, mark: str) -> list[tuple[int, object, str]]:
    """(row, Req, instance key) of the batch's requests that carry mg's flag and the server's
    mark (guard.py: only the front sets them) (cheap: CPU lists only). The key (rid + the
    front's instance id) names the request in all of mg's bookkeeping."""
    if sampling_info is None or not sampling_info.has_custom_logit_processor:
        return []  # plain batches: mg's flag travels with a custom logit processor, so none here
    params = sampling_info.custom_params or ()
    return [(i, req, instance_key(req.rid, p.get(INSTANCE_PARAM)))
            for i, p in enumerate(params) if p and p.get(DETERMINISTIC_PARAM) and guard.marked(p, mark)
            for req in [the_req(p["__req__"])]]


def only_mg_processors(sampling_info) -> bool:
    """True if every custom logit processor of the batch is mg's no-op flag carrier (SGLang
    applies it with index kernels only: no host wait)."""
    entries = getattr(sampling_info, "custom_logit_processor", None) or {}
    return bool(entries) and all(type(e.processor).__name__ == "MgFlagProcessor"
                                 and type(e.processor).__module__.startswith("mg_server") for e in entries.values())


def top2(logits: Tensor) -> tuple[Tensor, Tensor]:
    """logits: [rows, vocab] -> (margin [rows] fp32 = top1 - top2, argmax [rows] int64)."""
    top = logits.float().topk(2, dim=-1)  # ties: topk order; only the margin (0) matters then
    return top.values[:, 0] - top.values[:, 1], top.indices[:, 0]


def force_tokens(logits: Tensor, rows: list[int], tokens: list[int]) -> None:
    """Make any sampler pick tokens[k] in rows[k] (in place): greedy argmax, and a one-hot
    softmax for the sampling path a mixed batch takes."""
    dev = logits.device
    sel = torch.tensor(rows, dtype=torch.int64, device=dev)
    logits.index_fill_(0, sel, float("-inf"))
    logits[sel, torch.tensor(tokens, dtype=torch.int64, device=dev)] = 0.0
