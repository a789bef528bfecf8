"""The file through which SGLang's scheduler hands its weights to the verifier (CUDA IPC handles).

Written by the seam (seam/export.py) in the instance's run folder, read by each verifier start:
`wait_shared` polls for it (the verifier starts before SGLang has loaded the model) and rebuilds
the tensors, mapped into the verifier's CUDA context. The file holds pickled torch CUDA
reductions written by mg's own scheduler process into a private folder (mkdtemp, 0700): only
that process's data is unpickled.
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Callable

WEIGHTS_FILE = "sglang-weights.ipc"


def weights_path(run_dir: str) -> str:
    return os.path.join(run_dir, WEIGHTS_FILE)


def wait_shared(run_dir: str, timeout_s: float, gone: Callable[[], str] = lambda: "") -> dict:
    """name -> tensor of SGLang's weights once the file is there; TimeoutError after timeout_s,
    RuntimeError as soon as `gone()` says why waiting is pointless (a stop)."""
    import torch.multiprocessing  # noqa: F401 - registers the CUDA rebuild functions pickle calls

    path, t0 = weights_path(run_dir), time.monotonic()
    while not os.path.exists(path):
        if why := gone():
            raise RuntimeError(why)
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"SGLang's weights did not arrive within {timeout_s:.0f} s (its model load)")
        time.sleep(0.2)
    with open(path, "rb") as f:
        shared = pickle.loads(f.read())
    try:
        os.kill(shared["pid"], 0)
    except ProcessLookupError:
        raise RuntimeError(f"the process that shared SGLang's weights (pid {shared['pid']}) is gone") from None
    return shared["tensors"]
