"""CUDA graphs of the verifier's forward, one per row-count bucket.

A verify forward of R rows (decode steps and short catch-ups of any requests) is launch-bound
when run op by op from Python: hundreds of small kernels, each with Python and launch overhead.
`VerifierModel.forward_rows` reads every per-step size from device tensors (positions, each
row's slot table), so one captured graph per bucket replays it for any positions. Rows beyond R
in a bucket are padding: they read and write only a scratch slot, and since every kernel is
batch-invariant (a row's bits never depend on the other rows) they change nothing for the real
rows. The graph also computes the top-2 of every row's logits, so a step costs one replay and one
device-to-host copy.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mg_server.runtime.verifier import ops

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)  # rows per graph; a forward of more rows replays them in chunks (engine)


class RowGraphs:
    def __init__(self, model, pool, kv_table: Tensor, max_len: int, scratch_slot: int, scratch_table_row: int):
        self.model, self.pool, self.kv_table, self.max_len = model, pool, kv_table, max_len
        dev = model.device
        n = BUCKETS[-1]
        # Static inputs, [4, max bucket] int64 on the device: tokens, positions, slots, table rows.
        self.inputs = torch.zeros((4, n), dtype=torch.int64, device=dev)
        # Their page-locked staging copy [4, max bucket] int64 (an async copy: no pageable-copy sync),
        # and the event after which it may be rewritten (chunked replays fill it back to back).
        self.staging = torch.zeros((4, n), dtype=torch.int64, pin_memory=True)
        self.copied = torch.cuda.Event()
        self.pad = (0, 0, scratch_slot, scratch_table_row)  # a padding row's token, position, slot, table row
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Tensor, Tensor, Tensor]] = {}
        self.max_rows = n
        self.pool_handle = torch.cuda.graph_pool_handle()

    def _fn(self, b: int):
        tok, pos, slot, trow = (self.inputs[i, :b] for i in range(4))
        # The rows' own slots into their requests' tables, in the graph (no host copies; padding
        # rows write the scratch slot into the scratch table row, which holds nothing else).
        self.kv_table[trow, pos] = slot
        logits = self.model.forward_rows(tok, pos, slot, trow, self.kv_table, self.pool, self.max_len)  # [b, V] fp32
        return logits, ops.margin_rows(logits)  # [b, V] fp32, [b, 2] fp64

    def capture(self) -> None:
        """Warm up (Triton compiles outside the capture) and capture every bucket, largest first
        (the buckets share one memory pool)."""
        self._fill([[], [], [], []])  # all rows padding
        side = torch.cuda.Stream(self.model.device)
        side.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(side):
            for b in BUCKETS:
                self._fn(b)
        torch.cuda.current_stream(self.model.device).wait_stream(side)
        for b in reversed(BUCKETS):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool_handle):
                out = self._fn(b)
            self.graphs[b] = (g, *out)
        torch.cuda.synchronize(self.model.device)

    def _fill(self, cols: list[list[int]]) -> None:
        """cols: tokens, positions, slots, table rows (equal lengths <= the largest bucket)."""
        self.copied.synchronize()  # the previous fill's copy has read the staging buffer
        h, r = self.staging.numpy(), len(cols[0])
        for i in range(4):
            h[i, :r] = cols[i]
            h[i, r:] = self.pad[i]
        self.inputs.copy_(self.staging, non_blocking=True)
        self.copied.record(torch.cuda.current_stream(self.inputs.device))

    def run(self, tokens: list[int], positions: list[int], slots: list[int], table_rows: list[int]):
        """-> (logits [R, V] fp32, margin and argmax [R, 2] fp64: ops.margin_rows): views of the
        graph's outputs, valid until the next run. The graph also writes
        kv_table[table_rows, positions] = slots. R must be <= the largest bucket."""
        r = len(tokens)
        b = next(x for x in BUCKETS if x >= r)
        self._fill([tokens, positions, slots, table_rows])
        g, logits, top = self.graphs[b]
        g.replay()
        return logits[:r], top[:r]
