"""Launch a Triton kernel through its compiled object instead of `kernel[grid](...)`.

Why: the lagged seam enqueues four small kernels per deterministic forward on SGLang's scheduler
thread, which is CPU-bound at these batch sizes, so their host time lands on every request of the
batch. `JITFunction.run` binds the arguments and rebuilds the specialization key at each call;
launching the compiled kernel skips that (H100, docs/history/gpu-measurements.md: force 18.6-30.1 us a
call through the JIT, 8.7-12.0 us through the compiled kernel; results/gpu/seam_launch_h100.json).

Correctness: a compiled kernel is only valid for arguments that Triton would specialize the same
way, so the cache key is a superset of Triton's specialization: per tensor its dtype and whether
its address is 16-byte aligned, per int whether it is 1, whether it is a multiple of 16 and its
integer width, per bool its value, and every constexpr's value. A key not seen before goes
through the JIT (which compiles or finds the right kernel) and its result is kept for that key.
Finer keys than Triton's only cost an extra cache entry; none is coarser.
"""

from __future__ import annotations

import torch


def spec_key(args: tuple, constexprs: int = 0) -> tuple:
    """What Triton's specialization can depend on, per argument (see module doc); the last
    `constexprs` arguments are compile-time constants, keyed by value."""
    split = len(args) - constexprs
    key = [("c", type(a).__name__, a) for a in args[split:]]
    for a in args[:split]:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, bool):
            key.append(("b", a))
        elif isinstance(a, int):
            key.append(("i", a == 1, a % 16 == 0, -(2 ** 31) <= a < 2 ** 31, a < 2 ** 63))
        elif isinstance(a, float):
            key.append(("f",))
        else:
            key.append((type(a).__name__, a))  # anything else: by value
    return tuple(key)


class Launcher:
    """`Launcher(kernel, constexprs=k, num_warps=4)(grid, *args)`: args in the kernel's parameter
    order, its k constexpr parameters included, positionally (the kernels here declare them last)."""

    def __init__(self, kernel, constexprs: int, **options):
        params = getattr(kernel, "params", None)  # a JITFunction's parameters
        if params is not None and [p.is_constexpr for p in params] != [i >= len(params) - constexprs
                                                                       for i in range(len(params))]:
            raise ValueError(f"{kernel}: its constexpr parameters are not its last {constexprs}")
        self.kernel, self.constexprs = kernel, constexprs
        self.options = options  # launch options fixed per launcher (num_warps)
        self.compiled: dict[tuple, object] = {}  # spec_key -> CompiledKernel
        self.runners: dict[tuple, object] = {}  # (spec_key, grid) -> the compiled kernel's launcher
        self.direct = True  # False once the compiled object's call convention was refused
        self.refused = ""  # why (the seam logs it)

    def __call__(self, grid: tuple, *args) -> None:
        key = spec_key(args, self.constexprs)
        runner = self.runners.get((key, grid)) if self.direct else None
        if runner is not None:
            runner(*args)
            return
        compiled = self.compiled.get(key)
        if compiled is None or not self.direct:
            compiled = self.kernel[grid](*args, **self.options)
            if compiled is not None and hasattr(compiled, "run"):  # (the interpreter returns none)
                self.compiled[key] = compiled
            return
        runner = compiled[(*grid, 1, 1)[:3]]
        try:
            runner(*args)
        except TypeError as e:  # another Triton's convention: its own launch path from now on
            self.direct = False  # (raised while parsing the arguments, before anything is enqueued)
            self.refused = f"{type(e).__name__}: {e}"
            self.kernel[grid](*args, **self.options)
            return
        self.runners[(key, grid)] = runner


def current_stream(device: torch.device) -> int:
    """The raw handle of the device's current CUDA stream (torch.cuda.current_stream(device)
    builds a Python Stream object: 5-8.5 us a call on the H100 host)."""
    return torch._C._cuda_getCurrentRawStream(device.index if device.index is not None
                                               else torch.cuda.current_device())


__all__ = ["Launcher", "spec_key", "current_stream"]
