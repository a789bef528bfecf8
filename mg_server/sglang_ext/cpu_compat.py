"""Make SGLang 0.5.10.post1 importable and runnable on a CPU-only host.

Applied by the launcher (and, through the `MG_CPU_COMPAT` variable, by every process that
SGLang spawns, see `install_if_requested`) only when CUDA is absent. Each fix checks first
whether it is still needed and says so when it is not, so a newer SGLang/torch that no longer
needs it does not get patched silently.

1. `sgl_kernel`: some SGLang modules import it (and submodules such as
   `sgl_kernel.kvcacheio`) unconditionally; the registry's build is CUDA-only and fails to
   load. An import finder serves `sgl_kernel` and every submodule as a stand-in whose every
   attribute raises when called: the torch_native CPU path never calls them, and an
   accidental call fails loudly instead of computing something else.
2. torchvision: `sglang.srt.utils.common` imports `torchvision.io` unconditionally. The
   registry's torchvision wheels are CUDA builds whose C extension cannot load here, and the
   pure-Python package then fails at import, registering fake kernels for the operators
   `torchvision::nms`/`qnms` that the missing extension should have defined. Defining those
   two schemas first (with kernels that raise) lets the pure-Python part import; nothing on the
   text-model path calls them.
3. Threads: SGLang's other processes busy-poll, so a scheduler with more than one OpenMP
   thread competes with them for the 2 cores (measured: 60 ms -> 1.5-3.4 s per decode step).
   `OMP_NUM_THREADS=1` is set before torch starts in the child processes.
4. (Not patched, only reported) SGLang's AMX detection calls a torch function that torch 2.13
   moved, so it reports no AMX; harmless for the torch_native attention path.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

from mg_server import env

log = logging.getLogger(__name__)

_TORCHVISION_SHIM_OPS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_torchvision_lib = None  # keeps the torch.library.Library alive (it unregisters when collected)


@dataclass
class CompatReport:
    applied: list[str] = field(default_factory=list)
    not_needed: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return f"applied={self.applied or '-'} not_needed={self.not_needed or '-'}"


def _real_module_loads(name: str) -> bool:
    """True if `name` is installed and imports without error (outside our shim)."""
    if importlib.util.find_spec(name) is None:
        return False
    try:
        module = __import__(name)
    except Exception:  # noqa: BLE001 - any failure means "does not load here"
        sys.modules.pop(name, None)
        return False
    return not getattr(module, "MG_CPU_SHIM", False)


class _Placeholder:
    """Any attribute of the stand-in: more placeholders on attribute access (module-level code
    such as `scalar_types.uint4b8` only stores them), an error when called."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._qualname}.{name}")

    def __call__(self, *_args, **_kwargs):
        raise RuntimeError(
            f"{self._qualname} was called, but sgl_kernel is mg_server's CPU stand-in (the real "
            "package is CUDA-only); this code path needs a GPU build of SGLang."
        )

    def __repr__(self) -> str:
        return f"<sgl_kernel CPU stand-in {self._qualname}>"


class _Unavailable(types.ModuleType):
    """Stand-in for `sgl_kernel` or one of its submodules."""

    MG_CPU_SHIM = True

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


class _SglKernelFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "sgl_kernel" or fullname.startswith("sgl_kernel."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _Unavailable(spec.name)
        module.__path__ = []  # a package, so any submodule import comes back here
        return module

    def exec_module(self, module):
        pass


def _install_sgl_kernel_shim(report: CompatReport) -> None:
    if any(isinstance(f, _SglKernelFinder) for f in sys.meta_path):
        return
    if _real_module_loads("sgl_kernel"):
        report.not_needed.append("sgl_kernel stand-in (the real sgl_kernel imports)")
        return
    sys.meta_path.insert(0, _SglKernelFinder())
    report.applied.append("sgl_kernel stand-in")


def fix_torchvision(report: CompatReport | None = None) -> None:
    """Make `import torchvision` work when its C extension cannot load (fix 2 above).

    Needed by every process that imports transformers' model classes or SGLang in this
    environment, so also called by model preparation and the test setup. A no-op where the
    extension loads (GPU images) or torchvision is already imported.
    """
    global _torchvision_lib
    import torch

    report = report if report is not None else CompatReport()

    if "torchvision" in sys.modules or _torchvision_lib is not None:
        return
    if importlib.util.find_spec("torchvision") is None:
        report.not_needed.append("torchvision ops (torchvision not installed)")
        return
    # Try loading the wheel's own extension first: if it loads, no fix is needed.
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
    lib = torch.library.Library("torchvision", "DEF")  # noqa: TOR901 - kept alive globally
    for schema in _TORCHVISION_SHIM_OPS:
        lib.define(schema)
        op_name = schema.split("(", 1)[0]

        def _raise(*_args, _op=op_name, **_kwargs):
            raise RuntimeError(f"torchvision::{_op} is unavailable on this CPU host")

        lib.impl(op_name, _raise, "CompositeExplicitAutograd")
    _torchvision_lib = lib
    report.applied.append("torchvision nms/qnms schemas")


def _set_thread_env(report: CompatReport) -> None:
    if os.environ.get("OMP_NUM_THREADS") != "1":
        os.environ["OMP_NUM_THREADS"] = "1"
        report.applied.append("OMP_NUM_THREADS=1")
    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")


def install() -> CompatReport:
    """Apply every CPU fix that is still needed in this process; children inherit the flag."""
    report = CompatReport()
    _set_thread_env(report)
    _install_sgl_kernel_shim(report)
    fix_torchvision(report)
    os.environ[env.CPU_COMPAT_VAR] = "1"  # spawned SGLang processes re-apply (see module doc)
    return report


def install_if_requested() -> None:
    """Called at import of mg_server's entry modules, which SGLang's spawned children re-import."""
    if env.cpu_compat_requested():
        install()
