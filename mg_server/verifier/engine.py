"""Shadow K/V caches per protected request, lazy catch-up and batched verify forwards.

In-process core of the verifier worker (no sockets here). One `VerifyItem` (see protocol.py)
teacher-forces the tokens t_start..t_pos the verifier has not seen, writing their K/V into the
request's shadow cache, and answers for position pos: the greedy token t_{pos+1}, its margin and
the K/V column of position pos. Catch-up rows are ordinary rows of the same forward, so the
verifier also records its own argmax/margin at every caught-up position (the audit).
Several requests share one forward; the kernels are batch-invariant, so this changes nothing.
A request's prompt positions that begin like an earlier request's are mapped from the prefix
cache (verifier/prefix.py) instead of computed, at its first item and at every later chunk of its
prompt while all it holds is cached blocks: the item's answer is the same bits, its rows there
decide nothing (prompt rows are not audited: their audit entries are -1 / NaN).
An item with temperature > 0 is decoded by seeded sampling (protocol module doc): its rows'
tokens and margins come from `sampling.sampled_pairs` (all of a forward's seeded rows at once) of
their fp32 logits row, the function mg's seam calls on the fast path's row, so both add
bit-identical noise.
"""

from __future__ import annotations

import hashlib
import math
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch
from torch import Tensor

from mg_server.verifier import ops
from mg_server.verifier.model import KVPool, Segment, VerifierModel
from mg_server.verifier.prefix import BLOCK, Block, PrefixCache
from mg_server.wire.protocol import ErrorCode, ErrorReply, VerifyItem


@dataclass
class SeqState:
    rid: str
    table_row: int  # this request's row of the engine's device-side slot table
    slots: list[int] = field(default_factory=list)  # pool slot of positions 0..len-1
    tokens: list[int] = field(default_factory=list)  # token id of positions 0..len-1 (the cache's keys)
    blocks: list[Block] = field(default_factory=list)  # the prefix cache's blocks it maps, in order
    shared: int = 0  # positions 0..shared-1 are in cache-owned slots (blocks'); the rest are its own
    caching: bool = True  # its next whole block may be registered (False after an unaligned cut)
    last_pred: int = -1  # the verifier's token for position len (from its last forward)
    prompt_len: int = 0  # t_q with q < prompt_len are prompt tokens: not audited
    last_used: float = 0.0  # the engine's clock at the last forward (for idle eviction)

    @property
    def length(self) -> int:
        return len(self.slots)


@dataclass
class StepOutput:
    """Result for one item (in-process form; the server turns it into a VerifyResult)."""

    rid: str
    pos: int
    token: int
    margin: float
    column: Callable[[], Tensor]  # -> kv_column, built only when asked (most results never need it)
    logits: Tensor  # [V] fp32, device: the logits row of position pos (a view: valid until the next forward)
    audit_tokens: list[int]
    audit_margins: list[float]
    first_mismatch: int
    batch_rows: int
    batch_requests: int
    forward_ms: float
    reused: int = 0  # leading positions of the item mapped from the prefix cache (not computed)
    digest: bytes = b""  # VerifyItem.want_digest: blake2b of `logits`, taken before any later forward

    @property
    def kv_column(self) -> Tensor:
        """[L, 2, Hkv, D] model dtype, device: K/V of position pos (0 = K, 1 = V); read it before
        the request's positions change (a rewind or release frees the slot, and so does a later
        forward of the request that maps a cached block in place of the one holding it)."""
        return self.column()


class VerifierEngine:
    def __init__(self, model: VerifierModel, max_requests: int, pool_tokens: int, max_seq_len: int,
                 evict_idle_s: float = float("inf"), cuda_graphs: bool = True,
                 graph_buckets: tuple[int, ...] | None = None, pool: KVPool | None = None):
        """pool: one allocated already (the worker's, before SGLang started: verifier.budget);
        else one of pool_tokens."""
        self.model = model
        self.evict_idle_s = evict_idle_s  # when full, requests idle this long are dropped (LRU first)
        self.max_requests = max_requests
        self.max_seq_len = min(max_seq_len, model.max_positions)
        self.pool = pool or KVPool(model.pool_spec, pool_tokens, model.dtype, model.device)
        pool_tokens = self.pool.n_tokens
        scratch = pool_tokens - 1  # the padding rows of a CUDA graph read and write only this slot
        self._free: list[int] = list(range(scratch - 1, -1, -1))  # stack of free slots
        # Slot of every position of every request, on the device: attention reads a request's
        # K/V through its row (the last row is the padding rows' table: [scratch, ...]).
        self.kv_table = torch.full((max_requests + 1, self.max_seq_len), scratch, dtype=torch.int64,
                                   device=model.device)  # [requests + 1, max_seq_len] int64
        self._free_rows: list[int] = list(range(max_requests - 1, -1, -1))
        self.seqs: dict[str, SeqState] = {}
        self.cache = PrefixCache()  # computed K/V blocks, reused by requests that begin alike
        self._map_host = None  # graphs: [max_seq_len] int64 page-locked, a mapped prefix's slots (_map)
        self.forwards = 0
        # the time of the call in progress (step's `now`): every LRU and idle decision reads it, so
        # the ranks of a TP verifier, given the same calls and times, decide alike (verifier/ranks.py)
        self.now = 0.0
        self.graph_forwards = 0  # graph replays (a forward of more rows than the largest bucket takes several)
        self.graphs = None
        if cuda_graphs and model.device.type == "cuda":
            from mg_server.verifier.graphs import BUCKETS, RowGraphs

            self.graphs = RowGraphs(model, self.pool, self.kv_table, self.max_seq_len, scratch, max_requests,
                                    graph_buckets or BUCKETS)  # (rows per graph: graphs.BUCKETS)
            self.graphs.capture()
            self._map_host = torch.zeros(self.max_seq_len, dtype=torch.int64, pin_memory=True)  # (made now: _map)

    # ---- request table -------------------------------------------------------------------
    def release(self, rid: str) -> bool:
        st = self.seqs.pop(rid, None)
        if st is None:
            return False
        self._free.extend(reversed(st.slots[st.shared:]))  # its own slots; the cache keeps its blocks'
        self.cache.drop(st.blocks)
        self._free_rows.append(st.table_row)
        return True

    def _truncate(self, st: SeqState, length: int) -> None:
        if length < st.shared:  # a cut inside the mapped prefix: blocks past it unmapped, never freed here
            keep = -(-length // BLOCK)
            self.cache.drop(st.blocks[keep:])
            del st.blocks[keep:]
            self._free.extend(reversed(st.slots[st.shared:]))
            st.shared, st.caching = length, length % BLOCK == 0 and st.caching
        else:
            self._free.extend(reversed(st.slots[length:]))
        del st.slots[length:], st.tokens[length:]
        st.last_pred = -1

    def _register(self, st: SeqState) -> None:
        """Cache the whole blocks the request has computed (prefix module doc). A block cached
        already (computed beside this one, or by a request that began alike) is mapped in place of
        the request's own slots, which are freed: the same bits, and its chain goes on, so its next
        chunk maps what is cached past it."""
        swapped = -1  # the first position whose slots became the cache's
        while st.caching and st.length >= st.shared + BLOCK:
            a, parent = st.shared, st.blocks[-1] if st.blocks else None
            toks = tuple(st.tokens[a:a + BLOCK])
            b = self.cache.register(parent, toks, st.slots[a:a + BLOCK])
            if b is None:
                b = self.cache.find(parent, toks)
                if b is None:  # a digest collision (prefix module doc): keep ours, cache no more
                    st.caching = False
                    break
                self.cache.take([b])
                self._free.extend(reversed(st.slots[a:a + BLOCK]))
                st.slots[a:a + BLOCK] = b.slots
                swapped = a if swapped < 0 else swapped
            st.blocks.append(b)
            st.shared += BLOCK
        if swapped >= 0:
            self._map(st.table_row, st.slots[swapped:st.shared], at=swapped)

    def _evict_idle(self, need_tokens: int, need_requests: int, keep: set[str], rid: str) -> None:
        """Free slots until the need is met: unmapped cached blocks first (least recently used
        leaf first), then least-recently-used requests idle > evict_idle_s (a caller that comes
        back gets UNKNOWN_REQUEST and resends its prefix from position 0); never one of `keep`
        (the forward's admitted requests) or `rid` (the item's own)."""
        def met() -> bool:
            return len(self._free) >= need_tokens and len(self.seqs) + need_requests <= self.max_requests

        idle = None
        now = self.now
        while not met():  # (the common case: met at once, no sort of the whole table)
            if len(self._free) < need_tokens and (slots := self.cache.evict_one()):
                self._free.extend(reversed(slots))
                continue
            if idle is None:
                idle = iter(sorted(self.seqs.values(), key=lambda x: x.last_used))
            st = next(idle, None)
            if st is None:
                return
            if st.rid not in keep and st.rid != rid and now - st.last_used > self.evict_idle_s:
                self.release(st.rid)

    def drop_cache(self) -> None:
        """Forget every cached block no request maps (their slots freed)."""
        while slots := self.cache.evict_one():
            self._free.extend(reversed(slots))

    @property
    def pool_used(self) -> int:
        """Slots held by requests and by unmapped cached blocks (the scratch slot is never a request's)."""
        return self.pool.n_tokens - 1 - len(self._free)

    def _reusable(self, it: VerifyItem, st: SeqState | None = None) -> list[Block] | None:
        """The cached blocks an item may map: whole blocks of the prompt, never its last position
        (its row gives the first answer token) nor the item's last. A new request's first item
        (`st` None) looks them up from position 0; a held request's item from where it stands,
        if every position it holds is a cached block's (a long prompt's next chunk). None: the
        item may map nothing (a held request with positions of its own, a cut, a gap)."""
        start = it.pos + 1 - len(it.tokens)
        if st is None:
            return self.cache.match(it.tokens, self._prompt_rows(it, st)) if start == 0 else None
        if start != st.length or st.shared != st.length or not st.caching or not st.blocks:
            return None
        return self.cache.match(it.tokens, self._prompt_rows(it, st), st.blocks[-1])

    @staticmethod
    def _prompt_rows(it: VerifyItem, st: SeqState | None) -> int:
        """The item's leading tokens that are prompt positions before the prompt's last (the only
        ones the cache may map: the last one's row gives the first answer token)."""
        n = len(it.tokens)
        return min((st.prompt_len if st else it.prompt_len) or n, it.pos + 1) - 1 - (it.pos + 1 - n)

    def _map(self, row: int, slots: list[int], at: int = 0) -> None:
        """kv_table[row, at:at + len(slots)] = slots (mapped blocks), before the forward that reads them."""
        m = len(slots)
        if m == 0:
            return
        if self.graphs is None:
            self.kv_table[row, at:at + m] = torch.tensor(slots, dtype=torch.int64, device=self.kv_table.device)
            return
        from mg_server.wire.zerocopy import copy_  # (a kernel's copy: graphs.py)

        self._map_host.numpy()[:m] = slots
        copy_(self._map_host[:m], self.kv_table[row, at:at + m])
        self.graphs._wait()  # (the buffer is reused by the next mapping)

    def _check(self, it: VerifyItem, busy: set[str], reserved: int = 0) -> ErrorReply | int:
        """Validate an item against the request table; on success, prepare its state and return
        the pool slots it takes. `reserved`: slots already promised to earlier items of the same
        forward (each item's need alone could fit where all of them together do not)."""
        n = len(it.tokens)
        start = it.pos + 1 - n
        if n == 0 or start < 0:
            return ErrorReply(code=ErrorCode.BAD_REQUEST, rid=it.rid,
                              message=f"need 1..pos+1 tokens, got {n} for pos {it.pos}")
        if it.pos + 1 > self.max_seq_len:
            return ErrorReply(code=ErrorCode.TOO_LONG, rid=it.rid,
                              message=f"pos {it.pos} needs {it.pos + 1} positions > max_seq_len {self.max_seq_len}")
        vocab = self.model.spec.vocab
        if min(it.tokens) < 0 or max(it.tokens) >= vocab:
            return ErrorReply(code=ErrorCode.BAD_REQUEST, rid=it.rid, message=f"token id outside [0, {vocab})")
        st = self.seqs.get(it.rid)
        if st is None and start != 0:
            return ErrorReply(code=ErrorCode.UNKNOWN_REQUEST, rid=it.rid, expected_pos=0,
                              message=f"no shadow cache for {it.rid!r}; the first item must start at 0")
        if st is not None and start != st.length and not (it.rewind and start <= st.length):
            return ErrorReply(code=ErrorCode.POSITION_MISMATCH, rid=it.rid, expected_pos=st.length,
                              message=f"tokens start at {start}, verifier holds {st.length} positions")
        mapped = self._reusable(it, st) or []
        self.cache.take(mapped)  # (mapped before eviction looks for room: they stay)
        need = it.pos + 1 - (min(start, st.length) if st else 0) - BLOCK * len(mapped)
        self._evict_idle(need + reserved, int(st is None), busy, it.rid)
        err = None
        if st is None and len(self.seqs) >= self.max_requests:
            err = ErrorReply(code=ErrorCode.NO_CAPACITY, rid=it.rid,
                             message=f"{self.max_requests} requests already held")
        elif need > len(self._free) - reserved:
            err = ErrorReply(code=ErrorCode.NO_CAPACITY, rid=it.rid,
                             message=f"K/V pool has {len(self._free) - reserved} free tokens, need {need} "
                                     f"(pool: {self.pool.n_tokens} tokens)")
        if err is not None:
            self.cache.drop(mapped)
            return err
        if st is None:
            st = self.seqs[it.rid] = SeqState(it.rid, self._free_rows.pop(), prompt_len=it.prompt_len or n,
                                              last_used=self.now)
        if mapped:  # a prompt's first item, or a long prompt's next chunk along the cached chain
            m, slots = BLOCK * len(mapped), [s for b in mapped for s in b.slots]
            self._map(st.table_row, slots, at=st.length)
            st.blocks.extend(mapped)
            st.slots.extend(slots)
            st.tokens.extend(it.tokens[:m])
            st.shared += m
            self.cache.hits += m
        elif start < st.length:  # rewind
            self._truncate(st, start)
        return need

    # ---- forward ------------------------------------------------------------------------
    def step(self, items: list[VerifyItem], now: float | None = None) -> list[StepOutput | ErrorReply]:
        """Serve items in order (`now`: the call's time; time.monotonic() if not given); items of one
        rid go to successive forwards, the rest batch. So do
        new requests whose first uncached block is alike (n samples of one prompt, a preamble not
        cached yet): the later ones map what the first computed (`_first_new_block`)."""
        self.now = time.monotonic() if now is None else now
        out: list[StepOutput | ErrorReply | None] = [None] * len(items)
        pending = list(range(len(items)))
        while pending:
            batch, later, seen = [], [], set()
            for i in pending:
                key = self._first_new_block(items[i])
                (later if items[i].rid in seen or (key is not None and key in seen) else batch).append(i)
                seen.update((items[i].rid, key))
            ok, errors = self._admit([items[i] for i in batch])
            for k, err in errors.items():
                out[batch[k]] = err
            ok = [batch[k] for k in ok]
            if ok:
                try:
                    for i, res in zip(ok, self._forward([items[i] for i in ok])):
                        out[i] = res
                except Exception as e:  # noqa: BLE001 - drop the half-written requests, keep serving
                    for i in ok:
                        self.release(items[i].rid)
                        out[i] = ErrorReply(code=ErrorCode.INTERNAL, rid=items[i].rid,
                                            message=f"{type(e).__name__}: {e}")
            pending = later
        return out  # type: ignore[return-value]

    def _first_new_block(self, it: VerifyItem) -> tuple | None:
        """An item's next prompt block to compute past what the cache maps for it, if another item
        of the same forward could reuse it (None: nothing to share): its parent block's key and
        its tokens, which name every token up to its end."""
        st = self.seqs.get(it.rid)
        mapped = self._reusable(it, st)
        if mapped is None:
            return None
        k = len(mapped)
        if (k + 1) * BLOCK > self._prompt_rows(it, st):
            return None
        parent = mapped[-1] if mapped else st.blocks[-1] if st else None
        return (parent.key if parent else b"", tuple(it.tokens[k * BLOCK:(k + 1) * BLOCK]))

    def _admit(self, items: list[VerifyItem]) -> tuple[list[int], dict[int, ErrorReply]]:
        """_check each item of one forward (distinct rids) in order, the pool slots of those
        admitted reserved for the next: (indices admitted, index -> error of the others)."""
        ok, errors, reserved, busy = [], {}, 0, set()
        for k, it in enumerate(items):
            got = self._check(it, busy, reserved)
            if isinstance(got, int):
                ok.append(k)
                busy.add(it.rid)
                reserved += got
            else:
                errors[k] = got
        return ok, errors

    def _forward(self, items: list[VerifyItem]) -> list[StepOutput]:
        t0 = time.perf_counter()
        dev = self.model.device
        tokens, positions, out_slots, table_rows, segs, metas = [], [], [], [], [], []
        for it in items:
            st = self.seqs[it.rid]
            st.last_used = self.now
            start = it.pos + 1 - len(it.tokens)
            skip = st.length - start  # > 0: positions mapped from the prefix cache (_check), not computed
            rows = it.tokens[skip:]
            new = [self._free.pop() for _ in rows]
            prev_pred = st.last_pred
            st.slots.extend(new)
            st.tokens.extend(rows)
            segs.append(Segment(row_start=len(tokens), n_rows=len(rows), q_start=start + skip,
                                kv_indices=self.kv_table[st.table_row, : it.pos + 1]))
            metas.append((st, start, skip, prev_pred))
            tokens.extend(rows)
            positions.extend(range(start + skip, it.pos + 1))
            out_slots.extend(new)
            table_rows.extend([st.table_row] * len(new))
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
        # row -> (temperature, seed, position): the rows that decide a sampled token (position >=
        # prompt_len - 1); rows inside the prompt decide nothing (not audited) and keep the greedy
        # argmax, which spares a long prompt's catch-up the noise of every row
        sampled: dict[int, tuple[float, int, int]] = {}
        for it, seg, (st, _, _, _) in zip(items, segs, metas):
            if it.temperature > 0:
                sampled.update({seg.row_start + j: (it.temperature, it.seed, seg.q_start + j)
                                for j in range(seg.n_rows) if seg.q_start + j + 1 >= st.prompt_len})
        if self.graphs is not None:  # the graph writes the new positions' slots into kv_table itself
            answers = [s.row_start + s.n_rows - 1 for s in segs]  # each item's answer row
            logits, top = self._graph_rows(tokens, positions, out_slots, table_rows, answers, sampled)
        else:
            self.kv_table[t(table_rows), t(positions)] = t(out_slots)  # the new positions' slots
            logits = self.model.forward(t(tokens), t(positions), t(out_slots), segs, self.pool)  # [R, V] fp32
            top = ops.margin_rows(logits).tolist()  # [R, 2] fp64 (margin, argmax): one device-to-host copy
            if sampled:  # all seeded rows' noise in one call, one more copy to the host
                rows = list(sampled)
                pairs = ops.sampled_pairs(logits[torch.tensor(rows, device=logits.device)],
                                          *map(list, zip(*sampled.values()))).tolist()
                for r, pair in zip(rows, pairs):
                    tok, m = ops.choice_of_pair(pair, sampled[r][0])
                    top[r] = [m, float(tok)]
        margins = [row[0] for row in top]
        preds = [int(row[1]) for row in top]
        self.forwards += 1
        ms = (time.perf_counter() - t0) * 1e3
        results = []
        for it, seg, (st, start, skip, prev_pred) in zip(items, segs, metas):
            last = seg.row_start + seg.n_rows - 1
            audit_t = [-1] * skip + preds[seg.row_start:last]  # (mapped rows: prompt rows, decide nothing)
            audit_m = [math.nan] * skip + margins[seg.row_start:last]
            first_mm = -1
            if start >= st.prompt_len and prev_pred >= 0 and prev_pred != it.tokens[0]:
                first_mm = start - 1
            else:
                for j, tok in enumerate(audit_t):
                    if start + j + 1 >= st.prompt_len and tok != it.tokens[j + 1]:
                        first_mm = start + j
                        break
            st.last_pred = preds[last]
            self._register(st)  # (before its column is bound: a block it maps now has the cache's slots)
            results.append(StepOutput(
                rid=it.rid, pos=it.pos, token=preds[last], margin=margins[last],
                column=partial(self.pool.column, st.slots[it.pos]), logits=logits[last],
                audit_tokens=audit_t, audit_margins=audit_m, first_mismatch=first_mm,
                batch_rows=len(tokens), batch_requests=len(items), forward_ms=ms, reused=skip,
                digest=_digest(logits[last]) if it.want_digest else b""))
        return results

    def _graph_rows(self, tokens: list[int], positions: list[int], slots: list[int], table_rows: list[int],
                    answers: list[int], sampled: dict[int, tuple[float, int, int]]):
        """Replay the captured graphs over the rows, at most the largest bucket per replay.

        -> (logits, each row's [margin, argmax]: RowGraphs.run, the `sampled` rows' replaced by
        their seeded choice [T * (top1 - top2), token]). logits is the graph's [R, V] fp32 output
        when one replay serves all rows, else {answer row: [V] fp32} (RowGraphs.kept; the rest of a
        long catch-up's rows are never read, and R x V fp32 would be ~1 GB for an 8B vocabulary).
        Sampled rows are decided after their own replay, before the next overwrites them.
        Nothing here allocates page-locked memory, and every copy is a kernel (wire.zerocopy) but
        the seeded rows' noise keys (16 bytes a row, sampling.gumbel_rows).
        Why chunks keep every row's bits: a row reads only K/V of its own request's positions
        <= its own, and chunks go in row order, so those are written (by an earlier replay or this
        one) exactly as one forward would write them; each row's arithmetic does not depend on
        the other rows of its replay (batch-invariant kernels). Before, a forward of more rows
        than the largest bucket ran op by op: 24 ms where a replay takes 2.4 ms (smol, H100).
        """
        from mg_server.wire.zerocopy import copy_  # (graphs exist on CUDA only)

        g, n = self.graphs, self.graphs.max_rows
        logits: Tensor | dict[int, Tensor] = {}
        tops: list = []
        for a in range(0, len(tokens), n):
            lg, top = g.run(tokens[a:a + n], positions[a:a + n], slots[a:a + n], table_rows[a:a + n])
            self.graph_forwards += 1
            if rows := [r for r in sampled if a <= r < a + n]:  # (temporaries: the caching allocator's)
                sub = torch.stack([lg[r - a] for r in rows])  # [S, V] fp32 (a gather by a kernel)
                pairs = g.read(ops.sampled_pairs(sub, *map(list, zip(*(sampled[r] for r in rows)))))
                for r, pair in zip(rows, pairs):
                    tok, m = ops.choice_of_pair(pair, sampled[r][0])
                    top[r - a] = [m, float(tok)]
            if len(tokens) <= n:
                logits = lg
            else:
                for j, r in enumerate(answers):
                    if a <= r < a + n:
                        # on CUDA a kernel's copy, not a copy engine's (wire.zerocopy)
                        logits[r] = copy_(lg[r - a], g.kept[j]) if lg.is_cuda else g.kept[j].copy_(lg[r - a])
            tops += top
        return logits, tops


def _digest(row: Tensor) -> bytes:
    """blake2b of a [V] fp32 logits row (a diagnostic: its copy to the host may use the copy engine)."""
    return hashlib.blake2b(row.cpu().numpy().tobytes(), digest_size=16).digest()
