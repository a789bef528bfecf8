"""CUDA graphs of the verifier's forward, one per row-count bucket.

A verify forward of R rows (decode steps and short catch-ups of any requests) is launch-bound
when run op by op from Python: hundreds of small kernels, each with Python and launch overhead.
`VerifierModel.forward_rows` reads every per-step size from device tensors (positions, each
row's slot table), so one captured graph per bucket replays it for any positions. Rows beyond R
in a bucket are padding: they read and write only a scratch slot, and since every kernel is
batch-invariant (a row's bits never depend on the other rows) they change nothing for the real
rows. The graph also computes the top-2 of every row's logits. Its inputs and that top-2 move
through page-locked host buffers that the graph's own kernels read and write (wire.zerocopy:
no copy engine), so a step costs one replay and one event sync.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mg_server.verifier import ops
from mg_server.wire.zerocopy import copy_

# Rows per graph; a forward of more rows replays the largest in chunks (engine). Windows (the
# pending rows of every protected request, e.g. 8 x 17 or 8 x 65) fit one replay up to 640 rows:
# every replay reads all weights once, so a forward split over two graphs costs two weight reads.
# Steps of 32-64 rows above 128 keep a window's padding (compute, attention, fp32 logits rows) small.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 160, 192, 256, 320, 384, 448, 512, 576, 640)


class RowGraphs:
    def __init__(self, model, pool, kv_table: Tensor, max_len: int, scratch_slot: int, scratch_table_row: int,
                 buckets: tuple[int, ...] = BUCKETS):
        self.model, self.pool, self.kv_table, self.max_len = model, pool, kv_table, max_len
        self.buckets = tuple(sorted(buckets))
        dev = model.device
        n = self.buckets[-1]
        # Static inputs, [4, max bucket] int64 on the device: tokens, positions, slots, table rows.
        self.inputs = torch.zeros((4, n), dtype=torch.int64, device=dev)
        # Their page-locked host copy [4, max bucket] int64, which the graph's first kernel reads,
        # and the page-locked copy of every row's (margin, argmax) [max bucket, 2] fp64 that its
        # last kernel writes (wire.zerocopy); `done` is recorded after each replay.
        self.staging = torch.zeros((4, n), dtype=torch.int64, pin_memory=True)
        self.top_host = torch.zeros((n, 2), dtype=torch.float64, pin_memory=True)
        self.done = torch.cuda.Event()
        # The logits [max bucket, V] fp32 that every graph writes (rows [:b]); one buffer, not one
        # per graph: each graph's own output would stay allocated, 1.9 GB over these buckets for
        # an 8B vocabulary. A run's logits are valid until the next run either way.
        self.logits = torch.empty((n, model.spec.vocab), dtype=torch.float32, device=dev)
        # The answer rows' logits of a forward longer than one replay, copied out before the next
        # replay overwrites them: [one per request, V] fp32, made now: a verify call makes no device
        # allocation (engine._graph_rows, server._warm_up).
        self.kept = torch.empty((scratch_table_row, model.spec.vocab), dtype=torch.float32, device=dev)
        self.pad = (0, 0, scratch_slot, scratch_table_row)  # a padding row's token, position, slot, table row
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor, Tensor, Tensor]] = {}
        self.max_rows = n
        self.pool_handle = torch.cuda.graph_pool_handle()

    def _fn(self, b: int):
        copy_(self.staging, self.inputs)  # [4, max bucket] int64: host -> device by a kernel
        tok, pos, slot, trow = (self.inputs[i, :b] for i in range(4))
        # The rows' own slots into their requests' tables, in the graph (no host copies; padding
        # rows write the scratch slot into the scratch table row, which holds nothing else).
        self.kv_table[trow, pos] = slot
        logits = self.model.forward_rows(tok, pos, slot, trow, self.kv_table, self.pool, self.max_len,
                                         logits_out=self.logits[:b])  # [b, V] fp32, a view of self.logits
        top = ops.margin_rows(logits)  # [b, 2] fp64
        copy_(top, self.top_host[:b])  # device -> host by a kernel
        return logits, top

    def capture(self) -> None:
        """Warm up (Triton compiles outside the capture) and capture every bucket, largest first
        (the buckets share one memory pool)."""
        self._fill([[], [], [], []])  # all rows padding
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            for b in self.buckets:
                self._fn(b)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        for b in reversed(self.buckets):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool_handle):
                out = self._fn(b)
            self.graphs[b] = (g, *out)
        torch.cuda.synchronize(self.model.device)

    def _fill(self, cols: list[list[int]]) -> None:
        """cols: tokens, positions, slots, table rows (equal lengths <= the largest bucket). The
        previous replay has finished (run waits for it), so nothing reads the buffer now."""
        h, r = self.staging.numpy(), len(cols[0])
        for i in range(4):
            h[i, :r] = cols[i]
            h[i, r:] = self.pad[i]

    def run(self, tokens: list[int], positions: list[int], slots: list[int], table_rows: list[int]):
        """-> (logits [R, V] fp32: a view of the graph's output, valid until the next run; each
        row's [margin, argmax] as floats: ops.margin_rows). Returns once the replay finished. The
        graph also writes kv_table[table_rows, positions] = slots. R <= the largest bucket."""
        r = len(tokens)
        b = next(x for x in self.buckets if x >= r)
        self._fill([tokens, positions, slots, table_rows])
        g, logits, _ = self.graphs[b]
        g.replay()
        self._wait()
        return logits[:r], self.top_host[:r].tolist()

    def read(self, x: Tensor) -> list[list[float]]:
        """x [S, 2] fp64 on the device (S <= the largest bucket) -> its rows as floats, through
        the top-2 buffer by a kernel (after run's caller has read it): no copy engine (graphs doc)."""
        copy_(x.contiguous(), self.top_host[:x.shape[0]])
        self._wait()
        return self.top_host[:x.shape[0]].tolist()

    def _wait(self) -> None:
        self.done.record(torch.cuda.current_stream(self.inputs.device))
        self.done.synchronize()  # an event of this stream only (no device-wide or copy-engine wait)
