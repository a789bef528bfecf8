"""Every environment variable mg_server reads, in one place.

Process entry points receive frozen config dataclasses; only the CLI and the SGLang launcher
call these functions to build them.
"""

from __future__ import annotations

import os
from pathlib import Path

CPU_COMPAT_VAR = "MG_CPU_COMPAT"  # set by the launcher; SGLang's spawned processes inherit it


def cache_dir() -> Path:
    """Where prepared models live: $MG_CACHE_DIR, else $XDG_CACHE_HOME/mg_server."""
    if os.environ.get("MG_CACHE_DIR"):
        return Path(os.environ["MG_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mg_server"


def cpu_compat_requested() -> bool:
    return os.environ.get(CPU_COMPAT_VAR) == "1"


def prometheus_multiproc_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR")
