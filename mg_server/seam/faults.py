"""Test-only faults in the step seam (env.Faults), kept out of the production class.

`make_hook` builds a `FaultySeam` instead of a `StepSeam` only when a fault variable is set
(the tests' servers): a missed flip on demand. The k-th answer token of every protected request
is its runner-up, presented as the fast path's argmax with margin `flip_margin` (huge: it is
fast-committed and only the audit can find it; 0: a low-margin step, checked within a few
forwards). On the lagged seam the fault is written into the logits themselves (CPU only: there
the decision kernel runs inline), so the device's top-2 sees it; on a GPU a faulted seam takes
the synchronous path.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mg_server import env
from mg_server.seam.hook import StepSeam


class FaultySeam(StepSeam):
    def __init__(self, config, runner):
        super().__init__(config, runner)
        self.faults = env.faults()
        if self.lagged is not None and self.lagged.inline:
            launch = self.lagged.launch

            def faulted_launch(logits: Tensor, positions: Tensor, rows) -> None:
                self._flip_in_logits(logits, positions, rows)
                launch(logits, positions, rows)

            self.lagged.launch = faulted_launch

    def _lag_ok(self) -> bool:
        return self.lagged.inline

    def _control(self, logits: Tensor, steps) -> bool:
        k, out = self.faults.missed_flip, []
        for i, req, pos, margin, fast, key in steps:
            if pos - len(req.origin_input_ids) + 1 == k:
                fast, margin = int(logits[i].float().topk(2).indices[1]), self.faults.flip_margin
            out.append((i, req, pos, margin, fast, key))
        return super()._control(logits, out)

    def _flip_in_logits(self, logits: Tensor, positions: Tensor, rows) -> None:
        """The k-th answer token's runner-up made the top, ahead by flip_margin (at least one ulp)."""
        for i, req, _ in rows:
            if int(positions[i]) - len(req.origin_input_ids) + 1 == self.faults.missed_flip:
                top = logits[i].float().topk(2)
                up = torch.nextafter(top.values[0], torch.tensor(float("inf"))) + self.faults.flip_margin
                logits[i, top.indices[1]] = up.to(logits.dtype)
