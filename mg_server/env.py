"""Every environment variable mg_server reads, in one place.

Process entry points receive frozen config dataclasses; only the CLI and the SGLang launcher
call these functions to build them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

COMPAT_VAR = "MG_COMPAT"  # host profile set by the launcher; SGLang's spawned processes inherit it


def cache_dir() -> Path:
    """Where prepared models live: $MG_CACHE_DIR, else $XDG_CACHE_HOME/mg_server."""
    if os.environ.get("MG_CACHE_DIR"):
        return Path(os.environ["MG_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mg_server"


def compat_profile() -> str:
    """The compatibility profile the launcher applied ("" when none): see launch.compat."""
    return os.environ.get(COMPAT_VAR, "")


MARK_VAR = "MG_REQUEST_MARK"  # set by the launcher at each start; SGLang's scheduler inherits it


def request_mark() -> str:
    """The front's mark of deterministic requests (config.MARK_PARAM; "" outside a server)."""
    return os.environ.get(MARK_VAR, "")


def stacks_on_usr1() -> bool:
    """Diagnostics: MG_STACKS_ON_USR1=1 makes SGLang's scheduler process (where mg's seam runs)
    print every thread's Python stack to its stderr on SIGUSR1 (a hung forward, a stuck gate)."""
    return os.environ.get("MG_STACKS_ON_USR1", "") == "1"


def trace_calls() -> int:
    """Diagnostics: MG_TRACE_CALLS=1 makes a CUDA verifier log one line per verify call (its
    phases' times, how long it waited to be taken) and every garbage collection of its process
    over 5 ms; MG_TRACE_CALLS=2 adds the device's CUDA allocations around each call."""
    v = os.environ.get("MG_TRACE_CALLS", "")
    return int(v) if v.isdigit() else 0


def kernels_backend() -> str:
    """Tests and benchmarks: MG_KERNELS_BACKEND=triton runs the batch-invariant kernels' Triton
    versions on CPU tensors (with TRITON_INTERPRET=1); "" = by device. Never needed in production."""
    return os.environ.get("MG_KERNELS_BACKEND", "")


@dataclass(frozen=True)
class Faults:
    """Test-only fault injection, read where it is applied (the step seam, in SGLang's scheduler
    process, which inherits the environment) and never part of a production config."""

    missed_flip: int = -1  # MG_FAULT_MISSED_FLIP=k: the seam fast-commits the runner-up as the k-th answer token
    flip_margin: float = 1e9  # MG_FAULT_FLIP_MARGIN: the margin reported for it (1e9: released early on a
    # stream; 0: a low-margin step, checked within a few forwards)
    lagged_on_cpu: bool = False  # MG_LAGGED_ON_CPU=1: the lagged seam on a CPU server, with the CPU reference gate

    @property
    def active(self) -> bool:
        return self.missed_flip >= 0


def faults() -> Faults:
    return Faults(missed_flip=int(os.environ.get("MG_FAULT_MISSED_FLIP", "-1")),
                  flip_margin=float(os.environ.get("MG_FAULT_FLIP_MARGIN", "1e9")),
                  lagged_on_cpu=os.environ.get("MG_LAGGED_ON_CPU", "") == "1")
