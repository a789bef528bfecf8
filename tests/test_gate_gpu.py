"""The step gate's CUDA kernel (mg_server/seam/gate.py) on a real GPU, against its CPU
reference; skipped without CUDA."""

import threading
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

L, H, D, N = 4, 3, 64, 5  # layers, kv heads, head dim, rows


def _setup():
    from mg_server.seam.gate import ReferenceStepGate, StepGate

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    slots = torch.randn(8, L, 2, H, D, generator=g).to(torch.bfloat16)
    r2t = torch.arange(4 * 32, dtype=torch.int32).reshape(4, 32) + 7  # request r, position p -> slot 7 + 32r + p
    ref_k = [torch.zeros(200, H, D, dtype=torch.bfloat16) for _ in range(L)]
    ref_v = [torch.zeros(200, H, D, dtype=torch.bfloat16) for _ in range(L)]
    ref = ReferenceStepGate(16, ref_k, ref_v, slots, r2t)
    k = [b.to(dev) for b in ref_k]
    v = [b.to(dev) for b in ref_v]
    gpu = StepGate(16, k, v, slots.to(dev), r2t.to(dev))
    gpu.pools = (k, v)  # the test's handle on what the kernel writes
    return gpu, ref, dev


def _inputs(dev, need):
    margin = torch.tensor([0.5, 0.01, 3.0, 0.0, 1.25], dtype=torch.float32)
    fast = torch.tensor([11, 12, 13, 14, 15], dtype=torch.int64)
    pos = torch.tensor([3, 4, 5, 6, 7], dtype=torch.int64)
    need = torch.tensor(need, dtype=torch.int32)
    return [t.to(dev) for t in (margin, fast, pos, need)]


def _answer(gate, target, repairs):
    """The host's side: wait for the values, answer with fast + 100 and the repairs."""
    t0 = time.monotonic()
    while not gate.published(target, N):
        assert time.monotonic() - t0 < 10, "no values published"
        time.sleep(1e-4)
    tokens = [int(f) + 100 for _, f, _, _ in gate.values(N)]
    gate.release(target, tokens, repairs)
    return tokens


def test_pass_through_publishes_and_chooses_the_fast_tokens():
    gpu, ref, dev = _setup()
    chosen = torch.full((N,), -1, dtype=torch.int64, device=dev)
    gpu.launch(*_inputs(dev, [0] * N), chosen, 1)
    torch.cuda.synchronize()
    ref_chosen = torch.full((N,), -1, dtype=torch.int64)
    ref.launch(*_inputs("cpu", [0] * N), ref_chosen, 1)
    assert gpu.published(1, N) and gpu.values(N) == ref.values(N)
    assert gpu.acked(1) == 0 == ref.acked(1) and chosen.cpu().tolist() == ref_chosen.tolist() == [11, 12, 13, 14, 15]


@pytest.mark.parametrize("allocate", [False, True])
def test_holds_until_the_host_answers_from_memory_then_copies_the_repairs(allocate):
    gpu, ref, dev = _setup()
    need = [0, 1, 0, 1, 0]
    repairs = [(5 * gpu.slot_numel, 1, 9), (2 * gpu.slot_numel, 3, 0)]
    chosen = torch.full((N,), -1, dtype=torch.int64, device=dev)
    # CUDA loads a kernel's module on first use (lazy loading), and that load waits for the device
    # like an allocation: warm the op used behind the gate, or this thread blocks until answered
    after = chosen + 0
    torch.cuda.synchronize()
    gpu.launch(*_inputs(dev, need), chosen, 1)
    after = chosen + 0  # enqueued after the gate: must see the host's tokens
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.05)
    assert not done.query() and gpu.published(1, N), gpu.ack.tolist()  # values out, stream held
    th = threading.Thread(target=lambda: (time.sleep(0.1), _answer(gpu, 1, repairs)))
    t0 = time.perf_counter()
    th.start()
    if allocate:  # implicit synchronization: waits for the gated stream, which the host thread opens
        torch.empty(3 << 20, dtype=torch.uint8, pin_memory=True)
    done.synchronize()
    waited = time.perf_counter() - t0
    th.join()
    ref_chosen = torch.full((N,), -1, dtype=torch.int64)
    ref.launch(*_inputs("cpu", need), ref_chosen, 1)
    ref.release(1, [int(f) + 100 for _, f, _, _ in ref.values(N)], repairs)
    assert gpu.acked(1) == 1 == ref.acked(1) and 0.09 < waited < 5.0, waited
    assert after.cpu().tolist() == ref_chosen.tolist() == [11, 112, 13, 114, 15]
    gk, gv = ([b.cpu() for b in bufs] for bufs in gpu.pools)
    for layer in range(L):
        assert torch.equal(gk[layer], ref.k_buffers[layer]) and torch.equal(gv[layer], ref.v_buffers[layer])
        assert torch.equal(gk[layer][7 + 32 + 9], ref.slots[5, layer, 0])  # request 1, position 9 <- slot 5
        assert torch.equal(gv[layer][7 + 96], ref.slots[2, layer, 1])  # request 3, position 0 <- slot 2


def test_opened_without_an_answer_chooses_the_fast_tokens_and_repairs_nothing():
    """The watchdog's way out: the flag raised with no inbox answer."""
    gpu, _, dev = _setup()
    chosen = torch.full((N,), -1, dtype=torch.int64, device=dev)
    gpu.launch(*_inputs(dev, [1] * N), chosen, 1)
    done = torch.cuda.Event()
    done.record()
    time.sleep(0.2)
    assert not done.query() and gpu.acked(1) is None
    gpu.open(1)
    done.synchronize()
    assert gpu.acked(1) == 2 and chosen.cpu().tolist() == [11, 12, 13, 14, 15]
    assert not any(b.any() for b in gpu.pools[0] + gpu.pools[1])


def test_many_forwards_in_a_row_keep_the_protocol():
    """Back-to-back gates of 100 rows (all 4 warps store values), every third one holding,
    answered by a host thread: each forward's values, tokens and acknowledgement are its own
    (a tag visible before the values would show the previous forward's positions here)."""
    from mg_server.seam.gate import StepGate

    gpu0, _, dev = _setup()
    rows, rounds, seen = 100, 300, []
    gpu = StepGate(128, *gpu0.pools, gpu0.slots, gpu0.req_to_token)
    base = torch.arange(rows, dtype=torch.int64, device=dev)
    outs = torch.zeros(rounds, rows, dtype=torch.int64, device=dev)

    def host():
        for t in range(1, rounds + 1):
            t0 = time.monotonic()
            while not gpu.published(t, rows):
                if time.monotonic() - t0 > 20:
                    seen.append(None)  # lost: the main thread's check fails
                    return
                time.sleep(0)
            vals = gpu.values(rows)
            if any(n for *_, n in vals):
                gpu.release(t, [int(f) + t for _, f, _, _ in vals], [])
                while gpu.acked(t) is None:
                    time.sleep(0)
            seen.append([int(p) for _, _, p, _ in vals])  # processed: the next forward may launch

    th = threading.Thread(target=host)
    th.start()
    for t in range(1, rounds + 1):
        need = torch.full((rows,), int(t % 3 == 0), dtype=torch.int32, device=dev)
        chosen = torch.empty(rows, dtype=torch.int64, device=dev)
        t0 = time.monotonic()
        while t > 1 and len(seen) < t - 1:  # as lagged.py: launch only after the host processed the last one
            assert time.monotonic() - t0 < 30 and None not in seen, (t, seen[-3:])
            time.sleep(0)
        gpu.launch(base.float(), base + 1000, base + 7 * t, need, chosen, t)
        outs[t - 1] = chosen
    torch.cuda.synchronize()
    th.join()
    assert seen == [[p + 7 * t for p in range(rows)] for t in range(1, rounds + 1)]
    want = [[f + 1000 + (t if t % 3 == 0 else 0) for f in range(rows)] for t in range(1, rounds + 1)]
    assert outs.cpu().tolist() == want


_FIRST_HOLD = """
import time, torch
from mg_server.seam.gate import StepGate
dev = torch.device("cuda")
slots = torch.zeros(2, 1, 2, 1, 8, dtype=torch.bfloat16, device=dev)
pool = [torch.zeros(4, 1, 8, dtype=torch.bfloat16, device=dev)]
gate = StepGate(4, pool, pool, slots, torch.zeros(1, 4, dtype=torch.int32, device=dev))
one = torch.ones(1, device=dev)
chosen = torch.zeros(1, dtype=torch.int64, device=dev)
gate.launch(one, chosen + 1, chosen, torch.ones(1, dtype=torch.int32, device=dev), chosen, 1)
while not gate.published(1, 1):
    time.sleep(1e-4)
gate.release(1, [7], [])
torch.cuda.synchronize()
print("ok", gate.acked(1), chosen.item())
"""


def test_a_fresh_processs_first_holding_gate_does_not_block_its_own_thread():
    """The first launch of a kernel loads its module, which waits for the device; a holding gate
    enqueued before the apply kernel's first load deadlocked the thread that would answer it."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _FIRST_HOLD], capture_output=True, text=True, timeout=180,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0 and r.stdout.split() == ["ok", "1", "7"], r.stderr[-2000:]


def test_strided_inputs_are_read_row_by_row():
    """topk's indices[:, 0] is a strided view; the kernels must see row k's own values."""
    gpu, ref, dev = _setup()
    margin, fast, pos, need = _inputs(dev, [0] * N)
    pairs = torch.stack([fast, fast + 1000], dim=1)  # [N, 2]: column 0 strided like topk's indices
    strided = pairs[:, 0]
    assert not strided.is_contiguous()
    chosen = torch.full((N,), -1, dtype=torch.int64, device=dev)
    gpu.launch(margin, strided, pos, need, chosen, 1)
    torch.cuda.synchronize()
    assert [int(v[1]) for v in gpu.values(N)] == fast.tolist() == chosen.tolist()


def test_decide_and_force_kernels_match_their_torch_reference():
    """seam.decide on CUDA (the lagged seam's launch) against decide_reference: margins, the
    lowest-index argmax on ties, positions, the step check, tau, the row modes, mode always;
    meta read from page-locked host memory as the seam passes it; force's one-hot rows."""
    from mg_server.seam import decide as DC

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    bs, V, n = 40, 49152, 33
    lg = torch.randn(bs, V, generator=g) * 4
    lg[3, 100] = lg[3, 40000] = 99.0  # a tie
    lg[5, 7], lg[5, 8] = 50.0, 50.0 - 2 ** -10  # a near-tie
    lg[6, :] = float("-inf")
    positions = torch.randint(0, 500, (bs,), generator=g)
    rows = torch.randperm(bs, generator=g)[:n]
    expected = positions[rows].clone()
    expected[::3] += 1  # not the step mg expects (every mode gets such rows: the modes cycle by 4)
    modes = torch.arange(n) % 4  # HOLD, LAZY, BEHIND, MUST
    meta = torch.cat([rows, expected, modes]).pin_memory()
    # each case twice (the second launch goes through the compiled kernel seam.kernel_launch kept), then
    # with logits at an odd address and row stride (a specialization the first kernel must not serve)
    cases = [(False, 1.0, 0), (False, 1.0, 0), (False, 0.0, 0), (True, 0.0, 0), (True, 0.0, 0), (False, 1.0, 1),
             (False, 1.0, 1), (False, 1.0, 0)]
    for always, tau, odd in cases:
        tt = torch.tensor([tau], dtype=torch.float64).pin_memory()
        outs = [torch.zeros(n, device=dev), *(torch.zeros(n, dtype=torch.int64, device=dev) for _ in range(2)),
                torch.zeros(n, dtype=torch.int32, device=dev), torch.zeros(n, dtype=torch.int64, device=dev)]
        ref = [torch.zeros(n), torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64),
               torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int64)]
        if odd:  # [bs, V] view of a flat buffer: first element at byte 4 (mod 16), row stride V + 1
            flat = torch.zeros(1 + bs * (V + 1), device=dev)
            lgd = flat[1:].view(bs, V + 1)[:, :V]
            lgd.copy_(lg)
            assert lgd.data_ptr() % 16 != 0 and lgd.stride(0) % 16 != 0
        else:
            lgd = lg.to(dev)
        DC.decide(lgd, positions.to(dev), meta, tt, always, *outs)
        DC.decide_reference(lg, positions, meta, tt, always, *ref)
        for name, a, b in zip(("margin", "fast", "pos", "need", "rows"), outs, ref):  # (row 6's margin: NaN)
            torch.testing.assert_close(a.cpu(), b, rtol=0, atol=0, equal_nan=True, msg=f"{name} {always} {tau} {odd}")
        chosen = (outs[1] + 3) % V
        DC.force(lgd, outs[4], chosen)
        want = lg.clone()
        want[rows] = float("-inf")
        want[rows, chosen.cpu()] = 0.0
        assert torch.equal(lgd.cpu(), want), (always, tau, odd)


def test_a_waiting_thread_wakes_at_the_publish_while_the_stream_is_held():
    """Early verify (seam/lagged.py): another thread sleeps on the event recorded between
    the publish kernel and the stream wait; it must wake with the values out while the gate still
    holds (an event after the wait would never fire before the answer), and answer it."""
    gpu, _, dev = _setup()
    gpu.watch_publish()
    woke = {}

    def early():
        gpu.bind_thread()
        gpu.wait_published()
        woke["published"], woke["acked"] = gpu.published(1, N), gpu.acked(1)
        _answer(gpu, 1, [])

    chosen = torch.full((N,), -1, dtype=torch.int64, device=dev)
    inputs = _inputs(dev, [0, 1, 0, 0, 0])  # (made first: a pageable copy would wait for the work below)
    slow = torch.randn(4096, 4096, device=dev)
    torch.cuda.synchronize()
    try:
        for _ in range(20):  # ~50 ms of GPU work ahead of the publish: the thread must really wait for it
            slow = slow @ slow / 64
        gpu.launch(*inputs, chosen, 1)
        assert not gpu.published(1, N)  # still behind the matmuls
        th = threading.Thread(target=early)  # (after the launch: an event never recorded counts as done)
        th.start()
        th.join(10)
        assert not th.is_alive() and woke == {"published": True, "acked": None}
        torch.cuda.synchronize()
        assert gpu.acked(1) == 1 and chosen.cpu().tolist() == [11, 112, 13, 14, 15]
    finally:
        gpu.open(1)  # never leave the stream held for the next test


def test_zerocopy_copies_move_bits_without_a_copy_engine():
    """wire.zerocopy.copy_: page-locked host -> device, device -> host and device -> device
    are bit-exact (NaN payloads and -0 included), and a copy out of a held process still runs:
    a forward held by a step gate on another stream does not hold it up."""
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

    from mg_server.seam.gate import _stream_wait_geq
    # every buffer first: an allocation while the stream is held would wait for it (gate.py)
    flag, sink, out = (torch.zeros(n, dtype=torch.int64).pin_memory() for n in (1, 3001, 3001))
    held, side, done = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Event()
    torch.cuda.synchronize()
    with torch.cuda.stream(held):
        _stream_wait_geq(held.cuda_stream, flag.data_ptr(), 1)  # held until the host raises flag
        sink.copy_(d, non_blocking=True)  # a copy-engine copy queued behind the wait, as SGLang's are
    with torch.cuda.stream(side):
        copy_(d, out)
        done.record(side)
    t0 = time.monotonic()
    while not done.query() and time.monotonic() - t0 < 10:
        time.sleep(1e-3)
    ok = done.query()
    flag[0] = 1  # release the held stream
    held.synchronize()
    assert ok and torch.equal(out, words)
