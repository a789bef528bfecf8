"""The step publisher's CUDA kernel (mg_server/seam/publish.py) on a real GPU, against its CPU
reference, and wire.zerocopy's copies; skipped without CUDA."""

import threading
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _inputs(n: int, t: int, dev):
    g = torch.Generator().manual_seed(t)
    margin = torch.rand(n, generator=g, dtype=torch.float32) * 4
    fast = torch.randint(0, 150000, (n,), generator=g, dtype=torch.int64)
    pos = torch.arange(n, dtype=torch.int64) + 7 * t
    need = torch.zeros(n, dtype=torch.int32)
    return [x.to(dev) for x in (margin, fast, pos, need)]


@pytest.mark.parametrize("n", [1, 5, 33, 300])
def test_the_kernel_publishes_what_the_reference_does(n):
    from mg_server.seam.publish import ReferencePublisher, StepPublisher

    gpu, ref = StepPublisher(512, torch.device("cuda")), ReferencePublisher(512)
    gpu.launch(*_inputs(n, 3, "cuda"), 3)
    ref.launch(*_inputs(n, 3, "cpu"), 3)
    torch.cuda.synchronize()
    assert gpu.published(3, n) and gpu.values(n) == ref.values(n)
    assert not gpu.published(4, n)


def test_a_strided_input_is_read_row_by_row():
    from mg_server.seam.publish import StepPublisher

    gpu = StepPublisher(8, torch.device("cuda"))
    top = torch.tensor([[5.0, 1.0], [7.0, 2.0], [9.0, 3.0]], device="cuda").topk(2).indices[:, 0]  # a strided view
    margin, _, pos, need = _inputs(3, 1, "cuda")
    gpu.launch(margin, top, pos, need, 1)
    torch.cuda.synchronize()
    assert [int(f) for _, f, _, _ in gpu.values(3)] == top.cpu().tolist()


def test_many_forwards_in_a_row_keep_the_protocol():
    """Back-to-back forwards of 100 rows (all 4 warps store values), a host thread reading each
    once its tags are there, the next launched only after (as lagged.py does): each forward's
    values are its own (a tag visible before the values would show the previous positions)."""
    from mg_server.seam.publish import StepPublisher

    rows, rounds, seen = 100, 300, []
    gpu = StepPublisher(128, torch.device("cuda"))
    base = torch.arange(rows, dtype=torch.int64, device="cuda")

    def host():
        for t in range(1, rounds + 1):
            t0 = time.monotonic()
            while not gpu.published(t, rows):
                if time.monotonic() - t0 > 20:
                    seen.append(None)
                    return
                time.sleep(0)
            seen.append([int(p) for _, _, p, _ in gpu.values(rows)])

    th = threading.Thread(target=host)
    th.start()
    need = torch.zeros(rows, dtype=torch.int32, device="cuda")
    for t in range(1, rounds + 1):
        t0 = time.monotonic()
        while t > 1 and len(seen) < t - 1:
            assert time.monotonic() - t0 < 30 and None not in seen, (t, seen[-3:])
            time.sleep(0)
        gpu.launch(base.float(), base + 1000, base + 7 * t, need, t)
    th.join(30)
    assert seen == [[p + 7 * t for p in range(rows)] for t in range(1, rounds + 1)]


def test_zerocopy_copies_move_bits_exactly():
    """wire.zerocopy.copy_: page-locked host -> device, device -> host and device -> device are
    bit-exact (NaN payloads and -0 included); pageable host memory is refused."""
    from mg_server.wire.zerocopy import copy_

    dev = torch.device("cuda")
    words = torch.randint(-2 ** 62, 2 ** 62, (3001,), dtype=torch.int64)
    words[:4] = torch.tensor([0x7FF8000000000123, -0x8000000000000000, 0x7FF0000000000001, 0], dtype=torch.int64)
    host = words.pin_memory()
    d = copy_(host, torch.empty(3001, dtype=torch.int64, device=dev))
    back = copy_(d.view(torch.float64), torch.empty(3001, dtype=torch.float64).pin_memory())
    torch.cuda.synchronize()
    assert torch.equal(back.view(torch.int64), words)
    bf = torch.randn(7, 2, 3, 64, device=dev).to(torch.bfloat16)
    assert torch.equal(copy_(bf, torch.empty_like(bf)).view(torch.int16), bf.view(torch.int16))
    with pytest.raises(ValueError):
        copy_(words, torch.empty(3001, dtype=torch.int64, device=dev))  # pageable host memory
