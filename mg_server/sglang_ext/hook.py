"""mg's forward hook on SGLang's `logits_processor` module (runs in SGLang's scheduler process).

SGLang calls it after every forward that produces next-token logits, prefill and decode alike,
with LogitsProcessor.forward's positional args `(input_ids, hidden_states, lm_head,
forward_batch, ...)` and its `LogitsProcessorOutput`. For the rows of requests that asked for
determinism it computes the top-1/top-2 margin of the pre-sampling logits and, when a controller
is attached, sends the step to it; for verified rows it then (1) forces the row's logits so
greedy sampling emits the verifier's token and (2) on disagreement writes the verifier's K/V
column of the current position into SGLang's pool, all layers, in place.

Positions: a row's input token at this forward is t_pos with pos = len(prompt) + len(output) - 1;
the logits choose t_{pos+1}. The slot of position pos was allocated for this very forward
(SGLang always computes the last position, even on a full prefix-cache hit), so the request owns
it: it is not shared through the radix cache, and the hook checks that before writing.
"""

from __future__ import annotations

import logging
import threading
import time
from http import HTTPStatus

import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from mg_server import metrics
from mg_server.config import DETERMINISTIC_PARAM, HookConfig
from mg_server.runtime import protocol as P

log = logging.getLogger(__name__)


def protected_rows(forward_batch: ForwardBatch) -> list[tuple[int, object]]:
    """(row, Req) of this batch's requests that carry mg_deterministic and sample a token now.

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
        rows.append((i, req))
    return rows


def top2(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits: [rows, vocab] -> (margin [rows] fp32 = top1 - top2, argmax [rows] int64)."""
    top = logits.float().topk(2, dim=-1)  # ties: topk order; only the margin (0) matters then
    return top.values[:, 0] - top.values[:, 1], top.indices[:, 0]


def force_token(logits: torch.Tensor, row: int, token: int) -> None:
    """Make greedy sampling pick `token` in `row` (in place)."""
    logits[row].fill_(float("-inf"))
    logits[row, token] = 0.0


def write_kv_column(forward_batch: ForwardBatch, row: int, pos: int, column: torch.Tensor) -> None:
    """column: [layers, 2, kv_heads, head_dim] (K after RoPE, V) -> the row's slot of position pos."""
    pool = forward_batch.token_to_kv_pool
    req_idx = forward_batch.req_pool_indices[row]
    loc = forward_batch.req_to_token_pool.req_to_token[req_idx, pos].reshape(1)  # [1] int
    if not bool((forward_batch.out_cache_loc == loc).any()):
        raise RuntimeError(f"slot {int(loc)} of position {pos} was not written by this forward; not repairing it")
    n_layers = len(pool.k_buffer)
    if column.shape[0] != n_layers or column.shape[2:] != pool.k_buffer[0].shape[1:]:
        raise RuntimeError(f"verifier K/V column {tuple(column.shape)} does not fit the pool "
                           f"({n_layers} layers of {tuple(pool.k_buffer[0].shape[1:])})")
    column = column.to(device=pool.k_buffer[0].device, dtype=pool.k_buffer[0].dtype)
    for layer in range(n_layers):
        pool.set_kv_buffer(None, loc, column[layer, 0][None], column[layer, 1][None], layer_id_override=layer)


class ControllerLink:
    """The hook's connection to the controller, plus the finish watcher thread."""

    def __init__(self, config: HookConfig):
        from mg_server.runtime.controller.client import ControllerClient
        from mg_server.runtime.shm import SlotBuffer

        self.config = config
        self.client = ControllerClient(config.controller_ipc, timeout_s=config.step_timeout_s, client_name="hook")
        self.info = self.client.hello()
        self.slots = SlotBuffer.attach(self.info.shm) if self.info.shm is not None else None
        self.sent: dict[str, int] = {}  # rid -> tokens already sent to the controller
        self.active: dict[str, object] = {}  # rid -> Req, until its Finish is sent
        self.lock = threading.Lock()
        threading.Thread(target=self._watch_finished, name="mg-finish-watch", daemon=True).start()

    def new_tokens(self, req, pos: int) -> list[int]:
        start = self.sent.get(req.rid, 0)
        prompt, out = req.origin_input_ids, req.output_ids
        new = (prompt[start:] if start < len(prompt) else []) + out[max(0, start - len(prompt)):]
        return list(new[: pos + 1 - start])

    def _watch_finished(self) -> None:
        """A request's last token is never the input of a forward; report ends from here."""
        from mg_server.runtime.controller.client import ControllerClient

        client = ControllerClient(self.config.controller_ipc, timeout_s=self.config.step_timeout_s,
                                  client_name="hook-finish")
        while True:
            time.sleep(0.005)
            with self.lock:
                done = [(rid, req, self.sent.pop(rid, 0)) for rid, req in self.active.items() if req.finished()]
                for rid, _, _ in done:
                    del self.active[rid]
            for rid, req, start in done:
                tokens = list(req.origin_input_ids) + list(req.output_ids)
                aborted = type(req.finished_reason).__name__ == "FINISH_ABORT"
                try:
                    client.finish(rid, tokens[start:], aborted)
                except Exception as e:  # noqa: BLE001 - the verdict then stays "running" and says so
                    log.error("mg: could not report the end of %s: %s", rid, e)


class MarginHook:
    def __init__(self, config: HookConfig):
        self.config = config
        self.steps, self.margin, self.control = metrics.hook_metrics(config.margin_buckets)
        self.link = ControllerLink(config) if config.controller_ipc else None

    def __call__(self, module, args, output):
        forward_batch = args[3] if len(args) > 3 else None
        if not isinstance(forward_batch, ForwardBatch):
            return None
        rows = protected_rows(forward_batch)
        if not rows:
            return None
        t0 = time.perf_counter()
        logits = output.next_token_logits  # [bs, vocab], pre-sampling
        margins, fast = top2(logits[[i for i, _ in rows]])
        margins_l, fast_l = margins.tolist(), fast.tolist()
        self.steps.inc(len(rows))
        for m in margins_l:
            self.margin.observe(m)
        verified = self._control(forward_batch, logits, rows, margins_l, fast_l) if self.link else False
        if not verified:
            self.control.observe(time.perf_counter() - t0)
        return None  # logits were edited in place where needed

    def _control(self, forward_batch, logits, rows, margins, fast) -> bool:
        """Ask the controller; apply its decisions. True if any row was verified."""
        link = self.link
        step_rows, positions = [], []
        with link.lock:
            for (i, req), margin, tok in zip(rows, margins, fast):
                pos = len(req.origin_input_ids) + len(req.output_ids) - 1
                step_rows.append(P.StepRow(rid=req.rid, pos=pos, new_tokens=link.new_tokens(req, pos),
                                           margin=margin, fast_token=tok))
                link.sent[req.rid] = pos + 1
                link.active[req.rid] = req
                positions.append(pos)
        try:
            decisions = link.client.step(step_rows)
        except Exception as e:  # noqa: BLE001 - controller unreachable: fail these requests loudly
            decisions = [P.StepDecision(rid=r.rid, error=f"mg controller unavailable: {e}") for r in step_rows]
        any_verified = False
        for (i, req), pos, d in zip(rows, positions, decisions):
            any_verified |= d.verified
            if d.error:
                req.to_finish = FINISH_ABORT(f"deterministic decoding failed: {d.error}",
                                             HTTPStatus.SERVICE_UNAVAILABLE, "ServiceUnavailable")
                continue
            if not d.verified:
                continue
            force_token(logits, i, d.token)
            if d.repair:
                try:
                    write_kv_column(forward_batch, i, pos, link.slots.read(d.slot, d.gen))
                except Exception as e:  # noqa: BLE001
                    req.to_finish = FINISH_ABORT(f"deterministic K/V repair failed: {e}",
                                                 HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
        return any_verified


def make_hook(config: dict) -> MarginHook:
    """Factory named in SGLang's --forward-hooks spec."""
    hook = MarginHook(HookConfig.from_json_dict(config))
    log.info("mg forward hook ready (controller: %s)", config.get("controller_ipc") or "none")
    return hook
