"""SGLang's forward stream at a high CUDA priority (`serve --mg-stream-priority sglang`, experimental).

With the verifier a thread of SGLang's scheduler process (`--mg-verifier-in scheduler`), its
kernels run beside SGLang's decode graph on a stream of their own; with `--mg-verify-ahead on`
every deterministic step's verifier forward does, one forward before its answer is needed. Both
streams are at CUDA's default (and lowest) priority, so the GPU hands free SMs to whichever
stream's blocks are pending: SGLang's graph was measured 0.25 ms slower per bs-8 SmolLM2 step
with the verifier beside it (benchmarks/results/gpu/HISTORY.md, "Verified ahead"). A stream of
higher priority has its pending blocks dispatched first (running blocks are never preempted).

SGLang's `ModelRunner.__init__` makes the forward stream (`runner.forward_stream`) and its
scheduler takes it from the runner (`TpModelWorker.get_worker_info`) after
`ModelRunner.initialize`, where mg's hook factory runs: replacing the runner's attribute there
puts every forward, and the graph replays in it, on the new stream. Nothing has run on the old
one by then (CUDA graphs are captured on a stream of their own). The first sampler call checks
that the forward it samples runs on the new stream, and logs which stream it found.
"""

from __future__ import annotations

import logging

import torch

from mg_server.kernels.launch import highest_stream_priority

log = logging.getLogger(__name__)


def favour_forward_stream(runner) -> None:
    """Replace `runner.forward_stream` with a stream of the device's highest priority; refuse
    (at start-up) an SGLang whose model runner has no such attribute."""
    old = getattr(runner, "forward_stream", None)
    if not isinstance(old, torch.cuda.Stream):
        raise RuntimeError("mg: --mg-stream-priority sglang needs SGLang's ModelRunner.forward_stream "
                           f"(a CUDA stream); this SGLang's is {type(old).__name__}")
    new = torch.cuda.Stream(old.device, priority=highest_stream_priority())
    runner.forward_stream = new
    handle = None

    def check(module, args):  # once, at the first forward sampled: is it on the new stream?
        handle.remove()
        cur = torch.cuda.current_stream(new.device)
        if cur == new:
            log.info("mg: SGLang's forwards run on a stream of priority %d", new.priority)
        else:
            log.warning("mg: --mg-stream-priority sglang is not in effect: the forward runs on a stream of "
                        "priority %d, not the one mg made (SGLang took its forward stream elsewhere)",
                        cur.priority)

    handle = runner.sampler.register_forward_pre_hook(check)
