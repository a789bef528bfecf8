"""Test-only faults in the step seam (env.Faults), kept out of the production class.

`make_hook` installs them on its `StepSeam` only when a fault variable is set (the tests'
servers): a missed flip on demand. The k-th answer token of every protected request
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


def install(seam) -> None:
    """Wrap this seam's control (and, on a CPU lagged seam, its launch) with the faults."""
    faults = env.faults()
    control = seam._control

    def faulted_control(logits: Tensor, steps) -> bool:
        out = []
        for i, req, pos, margin, fast, key in steps:
            if pos - len(req.origin_input_ids) + 1 == faults.missed_flip:
                fast, margin = int(logits[i].float().topk(2).indices[1]), faults.flip_margin
            out.append((i, req, pos, margin, fast, key))
        return control(logits, out)

    seam._control = faulted_control
    seam._lag_ok = lambda: seam.lagged.inline
    if seam.lagged is not None and seam.lagged.inline:
        launch = seam.lagged.launch

        def faulted_launch(logits: Tensor, positions: Tensor, rows, rules) -> None:
            flip_in_logits(faults, logits, positions, rows)
            launch(logits, positions, rows, rules)

        seam.lagged.launch = faulted_launch


def flip_in_logits(faults: env.Faults, logits: Tensor, positions: Tensor, rows) -> None:
    """The k-th answer token's runner-up made the top, ahead by flip_margin (at least one ulp)."""
    for i, req, _ in rows:
        if int(positions[i]) - len(req.origin_input_ids) + 1 == faults.missed_flip:
            top = logits[i].float().topk(2)
            up = torch.nextafter(top.values[0], torch.tensor(float("inf"))) + faults.flip_margin
            logits[i, top.indices[1]] = up.to(logits.dtype)
