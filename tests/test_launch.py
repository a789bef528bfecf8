"""seam.kernel_launch's cache key (CPU): a compiled Triton kernel is reused only for arguments that
Triton specializes the same way, so every property Triton's specialization reads must change it."""

import torch

from mg_server.seam.kernel_launch import Launcher, spec_key


def test_the_key_tells_apart_every_property_triton_specializes_on():
    buf = torch.zeros(64, dtype=torch.float32)
    base = (buf, 7, 3.0, True, 1024)
    variants = [
        (buf[1:], 7, 3.0, True, 1024),  # a tensor 4 bytes off 16-byte alignment
        (buf.to(torch.float64), 7, 3.0, True, 1024),  # another dtype
        (buf, 1, 3.0, True, 1024),  # an int equal to 1 (Triton makes it a constant)
        (buf, 32, 3.0, True, 1024),  # a multiple of 16
        (buf, 2 ** 40 + 7, 3.0, True, 1024),  # an int past int32
        (buf, 7, 3.0, False, 1024),  # a bool's value (constexpr flags)
        (buf, 7, 3.0, True, 2048),  # a constexpr's value (a multiple of 16 either way)
        (buf, 7, 3.0, 1, 1024),  # a constexpr's type (True == 1)
    ]
    keys = {spec_key(base, 2)} | {spec_key(v, 2) for v in variants}
    assert len(keys) == 1 + len(variants)
    # what Triton does not specialize on leaves the key alone: another aligned tensor, another
    # int of the same kind, another float
    assert spec_key((buf[4:], 9, -1.5, True, 1024), 2) == spec_key(base, 2)


def test_a_new_key_goes_through_the_jit_and_keeps_what_it_compiled():
    calls = []

    class Compiled:
        run = None  # (marks a compiled kernel)

        def __getitem__(self, grid):
            return lambda *args: calls.append(("direct", grid, args))

    class Kernel:
        def __getitem__(self, grid):
            def jit(*args, **options):
                calls.append(("jit", grid, args, options))
                return Compiled()
            return jit

    launch = Launcher(Kernel(), constexprs=0, num_warps=4)
    a = torch.zeros(8)
    launch((2,), a, 5)
    launch((2,), a, 5)
    launch((2,), a[1:], 5)  # misaligned: a new key, the JIT again
    launch((3,), a, 5)  # a new grid of a known key: the compiled kernel, launched directly
    assert [c[0] for c in calls] == ["jit", "direct", "jit", "direct"]
    assert calls[0][3] == {"num_warps": 4} and calls[3][1] == (3, 1, 1)


def test_the_launchers_know_their_kernels_constexprs():
    from mg_server.seam import decide, publish

    for launcher in (decide._DECIDE, decide._FORCE, publish._PUBLISH):
        params = launcher.kernel.params
        assert [p.is_constexpr for p in params].count(True) == launcher.constexprs > 0
    try:
        Launcher(decide._decide_kernel, constexprs=1)
    except ValueError:
        pass
    else:
        raise AssertionError("a wrong constexpr count was accepted")
