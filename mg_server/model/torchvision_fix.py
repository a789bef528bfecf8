"""`import torchvision` on a host where its C extension cannot load (launch.compat's fix 2).

The registry's torchvision wheels are CUDA builds; on CPU torch the pure-Python package fails at
import while registering fake kernels for `torchvision::nms`/`qnms`. Defining those two schemas
first (as ops that raise when called) lets it import. transformers imports torchvision where it
is installed, so model preparation needs this as much as SGLang's processes (launch.compat
applies it there).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_libraries: list = []  # keeps torch.library.Library objects alive (they unregister when collected)


def fix_torchvision(report=None) -> None:
    """Make `import torchvision` work (module doc); a no-op where the extension loads or
    torchvision is already imported. `report`: launch.compat's CompatReport (applied /
    not_needed lists), if any."""
    import torch

    report = report if report is not None else SimpleNamespace(applied=[], not_needed=[])
    if "torchvision" in sys.modules or _libraries:
        return
    if importlib.util.find_spec("torchvision") is None:
        report.not_needed.append("torchvision ops (torchvision not installed)")
        return
    from importlib.machinery import EXTENSION_SUFFIXES

    tv_dir = Path(importlib.util.find_spec("torchvision").origin).parent
    for suffix in EXTENSION_SUFFIXES:
        ext = tv_dir / f"_C{suffix}"
        if ext.exists():
            try:
                torch.ops.load_library(str(ext))
                report.not_needed.append("torchvision ops (its C extension loads)")
                return
            except (OSError, RuntimeError):
                break
    lib = torch.library.Library("torchvision", "DEF")  # noqa: TOR901 - kept alive in _libraries
    for schema in _SCHEMAS:
        lib.define(schema)
        op_name = schema.split("(", 1)[0]

        def _raise(*_args, _op=op_name, **_kwargs):
            raise RuntimeError(f"torchvision::{_op} is unavailable on this host")

        lib.impl(op_name, _raise, "CompositeExplicitAutograd")
    _libraries.append(lib)
    report.applied.append("torchvision nms/qnms schemas")
