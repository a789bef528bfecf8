"""The device-side stream gate (mg_server/kernels/gate.py) on a real GPU; skipped without CUDA."""

import threading
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _setup():
    from mg_server.kernels.gate import gate, release

    dev = torch.device("cuda")
    flag = torch.zeros(1, dtype=torch.int64, device=dev)
    status = torch.full((1,), -1, dtype=torch.int32, device=dev)
    return gate, release, flag, status, dev


def test_pass_through_when_nothing_needs_the_host():
    gate, _, flag, status, dev = _setup()
    x = torch.zeros(1, device=dev)
    gate(flag, torch.zeros(1, dtype=torch.int32, device=dev), 5, int(10e9), status)
    x += 1
    t0 = time.perf_counter()
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 1.0 and int(status) == 0 and float(x) == 1.0


def test_holds_the_stream_until_released_from_another_thread():
    gate, release, flag, status, dev = _setup()
    side = torch.cuda.Stream()
    out = torch.zeros(1, dtype=torch.int64, device=dev)
    override = torch.zeros(1, dtype=torch.int64, device=dev)
    gate(flag, torch.ones(1, dtype=torch.int32, device=dev), 1, int(10e9), status)
    out.copy_(override)  # must read the value written before the release
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.05)
    assert not done.query()  # held

    def opener():
        time.sleep(0.1)
        with torch.cuda.stream(side):
            override.fill_(42)
            release(flag, 1)

    th = threading.Thread(target=opener)
    t0 = time.perf_counter()
    th.start()
    done.synchronize()  # the main thread waits in a CUDA sync while the opener needs the GIL
    waited = time.perf_counter() - t0
    th.join()
    assert int(status) == 1 and int(out) == 42, (int(status), int(out))
    assert 0.09 < waited < 5.0, waited


def test_times_out_without_a_release():
    gate, _, flag, status, dev = _setup()
    t0 = time.perf_counter()
    gate(flag, torch.ones(1, dtype=torch.int32, device=dev), 7, int(0.3e9), status)
    torch.cuda.synchronize()
    assert int(status) == 2 and 0.25 < time.perf_counter() - t0 < 5.0


def test_monotonic_flag_opens_earlier_gates():
    gate, release, flag, status, dev = _setup()
    release(flag, 9)
    gate(flag, torch.ones(1, dtype=torch.int32, device=dev), 9, int(10e9), status)
    torch.cuda.synchronize()
    assert int(status) == 1
