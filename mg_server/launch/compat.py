"""Make SGLang importable and runnable where its compiled packages are missing.

Host profiles (`detect_profile`):
- `cuda`: a normal SGLang GPU install (sgl_kernel and flashinfer import): nothing to do.
- `cuda-bare`: CUDA, but sgl_kernel or flashinfer missing (e.g. a GPU host with only torch and
  triton). SGLang then runs on its torch-native ops, triton attention and pytorch sampling.
- `cpu`: no CUDA; SGLang's CPU engine with torch_native attention.

The launcher applies the profile in its own process and records it in `MG_COMPAT`; SGLang spawns
its children (scheduler, detokenizer) with multiprocessing's *spawn* method, which re-imports
mg-server's main module there, and that import re-applies the profile (`install_if_requested`)
before the child imports SGLang. Each fix checks first whether it is still needed and says so,
so a newer SGLang/torch does not get patched silently.

Fixes (profile that needs each):
1. (cpu: sgl_kernel; cuda-bare: sgl_kernel, flashinfer) imported unconditionally by some SGLang
   modules. An import finder serves them and every submodule as a stand-in whose attributes
   raise when called: the torch-native paths never call them, and an accidental call fails
   loudly instead of computing something else.
2. (cpu) torchvision's registry wheels are CUDA builds whose C extension cannot load on CPU torch;
   the pure-Python package then fails at import registering fake kernels for
   `torchvision::nms`/`qnms`. Defining those two schemas first lets it import
   (`mg_server.model.torchvision_fix`: model preparation needs it too).
3. (cpu) SGLang's other processes busy-poll, so a scheduler with more than one OpenMP thread
   competes with them for 2 cores (measured: 60 ms -> 1.5-3.4 s per decode step):
   `OMP_NUM_THREADS=1` in the children.
4. (cuda-bare) SGLang's fused ops (norms, activations, RoPE, position clamps) would pick
   sgl_kernel or nvcc-JIT kernels on CUDA: SGLang's own switch `SGLANG_FORCE_FUSED_OP_BACKEND=
   torch` puts every one on its `forward_native`. Right after SGLang imports them, the JIT K/V
   store is reported unusable (SGLang then writes the pool with torch indexing) and the fused
   gate/up dual GEMM is never chosen (a Blackwell CuTe DSL kernel whose module imports
   nvidia-cutlass-dsl even to say it does not apply), and the triton attention backend's
   programmatic-dependent-launch query (an sgl_kernel function) answers no. The radix cache
   runs on SGLang's Python tree (its compiled one is built for SGLang's own torch pin).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sys
import types
from dataclasses import dataclass, field
from typing import Callable

from mg_server import env
from mg_server.model.torchvision_fix import fix_torchvision  # noqa: F401 - fix 2, re-exported

log = logging.getLogger(__name__)

PROFILES = ("cpu", "cuda-bare", "cuda")
STANDIN_PACKAGES = ("sgl_kernel", "flashinfer")



@dataclass
class CompatReport:
    profile: str = ""
    applied: list[str] = field(default_factory=list)
    not_needed: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return f"profile={self.profile} applied={self.applied or '-'} not_needed={self.not_needed or '-'}"


def _real_module_loads(name: str) -> bool:
    """True if `name` is installed and imports without error (outside our stand-in)."""
    if importlib.util.find_spec(name) is None:
        return False
    try:
        module = __import__(name)
    except Exception:  # noqa: BLE001 - any failure means "does not load here"
        sys.modules.pop(name, None)
        return False
    return not getattr(module, "MG_STANDIN", False)


def detect_profile(cpu: bool) -> str:
    """The profile of this host: `cpu`, or `cuda` / `cuda-bare` by whether the kernels import."""
    if cpu:
        return "cpu"
    return "cuda" if all(_real_module_loads(p) for p in STANDIN_PACKAGES) else "cuda-bare"


# ---- fix 1: import stand-ins ---------------------------------------------------------------
class _Placeholder:
    """Any attribute of a stand-in: more placeholders on attribute access (module-level code
    such as `scalar_types.uint4b8` only stores them), an error when called."""

    def __init__(self, qualname: str):
        self._qualname = qualname

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self._qualname}.{name}")

    def __call__(self, *_args, **_kwargs):
        raise RuntimeError(
            f"{self._qualname} was called, but {self._qualname.split('.')[0]} is mg_server's import "
            "stand-in (the package is missing or does not load on this host); this code path needs "
            "SGLang's compiled kernels."
        )

    def __repr__(self) -> str:
        return f"<mg stand-in {self._qualname}>"


class _StandIn(types.ModuleType):
    MG_STANDIN = True

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Placeholder(f"{self.__name__}.{name}")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, packages: tuple[str, ...]):
        self.packages = packages

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".", 1)[0] in self.packages:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StandIn(spec.name)
        module.__path__ = []  # a package, so any submodule import comes back here
        return module

    def exec_module(self, module):
        pass


def _install_standins(report: CompatReport, packages: tuple[str, ...]) -> None:
    if any(isinstance(f, _StandInFinder) for f in sys.meta_path):
        return
    missing = tuple(p for p in packages if not _real_module_loads(p))
    for p in packages:
        if p not in missing:
            report.not_needed.append(f"{p} stand-in (the real package imports)")
    if missing:
        sys.meta_path.insert(0, _StandInFinder(missing))
        report.applied.append(f"stand-ins for {', '.join(missing)}")


# ---- fix 2: torchvision: mg_server.model.torchvision_fix (model preparation needs it too) -----


# ---- fix 4: bare CUDA hosts -----------------------------------------------------------------
def _patch_store_cache(module) -> None:
    module.can_use_store_cache = lambda *_args, **_kwargs: False


def _patch_dual_gemm(module) -> None:
    module.DualGemm._select_mode = lambda *_args, **_kwargs: None  # (None: the plain gate/up and down GEMMs)


def _patch_pdl(module) -> None:
    module.is_arch_support_pdl = lambda: False  # (sgl_kernel's query; triton kernels launch without PDL)


# module -> (the attributes the patch relies on, the patch)
_BARE_CUDA_PATCHES: dict[str, tuple[tuple[str, ...], Callable]] = {
    "sglang.srt.mem_cache.memory_pool": (("can_use_store_cache",), _patch_store_cache),
    "sglang.srt.layers.dual_gemm": (("DualGemm",), _patch_dual_gemm),
    "sglang.srt.layers.attention.triton_backend": ((), _patch_pdl),
}


def _apply_patch(name: str, module) -> None:
    needs, patch = _BARE_CUDA_PATCHES[name]
    missing = [a for a in needs if not hasattr(module, a)]
    if missing:
        raise RuntimeError(f"mg compat: {name} has no {missing}; this SGLang differs from the supported one")
    patch(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after a named module is executed (before anyone uses it)."""

    def __init__(self, names: tuple[str, ...]):
        self.names = names

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.names:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        inner = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, s):
                return inner.create_module(s)

            def exec_module(self, module):
                inner.exec_module(module)
                _apply_patch(fullname, module)

        spec.loader = _Loader()
        return spec


def _install_bare_cuda_patches(report: CompatReport) -> None:
    if any(isinstance(f, _AfterImport) for f in sys.meta_path):
        return
    for name in _BARE_CUDA_PATCHES:
        if name in sys.modules:  # already imported in this process: patch in place
            _apply_patch(name, sys.modules[name])
    sys.meta_path.insert(0, _AfterImport(tuple(_BARE_CUDA_PATCHES)))
    # SGLang's start-up check of the sgl_kernel version and its flashinfer probe; its fused ops'
    # own switch to their torch reference.
    os.environ["SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK"] = "1"
    os.environ["SGLANG_IS_FLASHINFER_AVAILABLE"] = "false"
    os.environ["SGLANG_FORCE_FUSED_OP_BACKEND"] = "torch"
    # why: SGLang's bundled Rust radix tree is built for its own torch pin; on the host's torch 2.11
    # it misread an int64 tensor as Float and stopped the scheduler at the first request
    os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = "python"
    report.applied.append("torch fused ops, torch K/V store, no dual GEMM, no PDL, Python radix tree")


# ---- entry points ---------------------------------------------------------------------------
def install(profile: str) -> CompatReport:
    """Apply every fix the profile needs in this process; spawned children re-apply it."""
    if profile not in PROFILES:
        raise ValueError(f"unknown compat profile {profile!r}")
    report = CompatReport(profile=profile)
    # SGLang's crash diagnostics (a child's SIGQUIT): a py-spy dump of the scheduler only where
    # py-spy is installed, CUDA coredumps only on CUDA; each would otherwise delay the stop (5 s,
    # then 60 s of waiting for a coredump that cannot come). A user's own setting wins.
    if shutil.which("py-spy") is None:
        os.environ.setdefault("SGLANG_PYSPY_DUMP_BEFORE_CRASH", "false")
    if profile == "cpu":
        os.environ.setdefault("SGLANG_CUDA_COREDUMP_BEFORE_CRASH", "false")
        if os.environ.get("OMP_NUM_THREADS") != "1":
            os.environ["OMP_NUM_THREADS"] = "1"
            report.applied.append("OMP_NUM_THREADS=1")
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        # flashinfer only matters on CUDA; a stand-in here would make "is it importable" probes lie.
        _install_standins(report, ("sgl_kernel",))
        fix_torchvision(report)
    elif profile == "cuda-bare":
        _install_standins(report, STANDIN_PACKAGES)
        _install_bare_cuda_patches(report)
    os.environ[env.COMPAT_VAR] = profile
    return report


def install_if_requested() -> None:
    """Called at import of mg-server's entry modules, which SGLang's spawned children re-import."""
    profile = env.compat_profile()
    if profile and profile != "cuda":
        install(profile)


def die_with_the_server() -> None:
    """In a process SGLang spawned for a server (not mg's own, which are named mg-* and clean up
    after an orphaning themselves): be killed when the server's main process dies, from the first
    moment. Why: SGLang's children ask for that (PR_SET_PDEATHSIG) only after their imports, so a
    server killed (-9) while they import left them running."""
    import multiprocessing

    name = multiprocessing.current_process().name  # a spawned child's own, set before this import
    if not env.compat_profile() or name == "MainProcess" or name.startswith("mg-") or sys.platform != "linux":
        return
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:  # the server died before that call
        os._exit(1)
