"""Every environment variable mg_server reads, in one place.

Process entry points receive frozen config dataclasses; only the CLI and the SGLang launcher
call these functions to build them.
"""

from __future__ import annotations

import os
from pathlib import Path

COMPAT_VAR = "MG_COMPAT"  # host profile set by the launcher; SGLang's spawned processes inherit it


def cache_dir() -> Path:
    """Where prepared models live: $MG_CACHE_DIR, else $XDG_CACHE_HOME/mg_server."""
    if os.environ.get("MG_CACHE_DIR"):
        return Path(os.environ["MG_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mg_server"


def compat_profile() -> str:
    """The compatibility profile the launcher applied ("" when none): see sglang_ext.compat."""
    return os.environ.get(COMPAT_VAR, "")


def prometheus_multiproc_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")


def lagged_on_cpu() -> bool:
    """Tests only: MG_LAGGED_ON_CPU=1 runs the lagged seam on a CPU server, with the CPU
    reference gate answering each holding forward at once (sglang_ext/lagged.py)."""
    return os.environ.get("MG_LAGGED_ON_CPU", "") == "1"


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


def fault_missed_flip() -> int:
    """Tests only: MG_FAULT_MISSED_FLIP=k makes the seam fast-commit the runner-up as the k-th
    answer token of every deterministic request (a missed flip on demand); -1 = off."""
    return int(os.environ.get("MG_FAULT_MISSED_FLIP", "-1"))


def fault_flip_margin() -> float:
    """Tests only: the margin the seam reports for MG_FAULT_MISSED_FLIP's token (default 1e9, so
    it is released early on a stream; 0 makes it a low-margin step, checked within a few forwards)."""
    return float(os.environ.get("MG_FAULT_FLIP_MARGIN", "1e9"))
