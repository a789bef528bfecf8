"""The seam under tensor parallelism: rank 0 decides, every rank applies (a mixin of hook.StepSeam).

Every SGLang TP rank runs the same batches, and samples its own copy of the gathered logits; a
rank's scheduler state stays equal to rank 0's only if mg edits it alike on every rank at the same
point. Rank 0's seam is the only one with a controller link (and its threads: news, finishes,
arrivals); the others, the followers, talk to no controller. At the two points where mg edits
SGLang's state, every rank reaches one collective over SGLang's CPU group of the TP ranks (gloo,
no device sync), at the same call of the same batch:

- the sampler pre-hook of a forward with protected rows: rank 0 decides as with one rank and
  broadcasts what it did (`Plan`: per row the token forced, a rollback, a failure; each held
  request's hold), which a follower applies to its own Req, K/V slots and logits. Then every
  rank names the rows it could not apply (a rollback that raised) and every rank fails those
  requests: no rank goes on with a request the others changed otherwise.
- SGLang's finish rules of a held request once they end it (or find a held end): rank 0 runs
  the finish barrier and broadcasts the outcome (rollback.py's `_agree_finish`); a follower
  takes it instead of its own reading (its holds learn the checked lengths only from plans).

Only the synchronous seam runs under TP (the lagged path and held ends are refused: they read
state rank 0's threads move between forwards). With one rank nothing here runs.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch.distributed as dist

from mg_server.seam import rollback
from mg_server.seam.rows import force_tokens, protected_rows

log = logging.getLogger(__name__)


class SeamRanks:
    """SGLang's TP group as the seam uses it: this rank, the group's size, two collectives."""

    def __init__(self, coordinator=None):
        # coordinator: SGLang's GroupCoordinator of the TP ranks (None: one rank)
        self.group = coordinator.cpu_group if coordinator is not None else None
        self.src = coordinator.first_rank if coordinator is not None else 0  # rank 0's global rank
        self.rank = coordinator.rank_in_group if coordinator is not None else 0
        self.size = coordinator.world_size if coordinator is not None else 1

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, obj):
        """Rank 0's `obj` on every rank (a follower passes None)."""
        box = [obj]
        dist.broadcast_object_list(box, src=self.src, group=self.group)
        return box[0]

    def union(self, items: list) -> list:
        """Every rank's `items`, joined in rank order."""
        out: list = [None] * self.size
        dist.all_gather_object(out, items, group=self.group)
        return [x for part in out for x in part]


def sglang_ranks() -> SeamRanks:
    """The ranks of this scheduler process's SGLang (one where TP is off)."""
    from sglang.srt.distributed import parallel_state

    tp = parallel_state.get_tp_group()
    return SeamRanks(tp if tp.world_size > 1 else None)


@dataclass
class RowPlan:
    """What rank 0 did to one protected row of a forward."""

    row: int  # the row in the batch (every rank's batch is the same)
    token: int = -1  # the token forced (-1: none)
    rollback: tuple[int, int] | None = None  # (answer tokens decided, answer index p): rollback.roll_back
    fail: str = ""  # the request failed with this reason


@dataclass
class Plan:
    """Rank 0's decisions of one forward, in the order it made them."""

    rows: dict[int, RowPlan] = field(default_factory=dict)
    holds: list[tuple[int, int, int, object]] = field(default_factory=list)  # (row, verified, released, end)
    index: dict[int, int] = field(default_factory=dict)  # id(Req) -> row, rank 0's only (emptied before the send)

    def at(self, row: int) -> RowPlan:
        return self.rows.setdefault(row, RowPlan(row))

    def of(self, req) -> RowPlan:
        return self.at(self.index[id(req)])


class RankSeam:
    """The seam's TP side (module doc). The seam sets `ranks`, `follower` and `plan`."""

    def _tp_call(self, args):
        """The pre-hook under TP: rank 0 decides (and records its plan), a follower applies it."""
        rows = protected_rows(args[1], self.mark)
        if not rows:
            return None  # (the same on every rank: no collective)
        logits = args[0].next_token_logits
        bad: list[int] = []
        if self.follower:
            plan = self.ranks.share(None)
            try:
                bad = self._apply(plan, logits, rows)
            except Exception:  # noqa: BLE001 - why: a raise here would stop this rank's scheduler alone
                log.exception("mg: a follower could not apply rank 0's plan; its rows fail on every rank")
                bad = [i for i, _, _ in rows]
        else:
            self.plan = Plan(index={id(req): i for i, req, _ in rows})
            try:
                self._forward(args, rows)
            except Exception as e:  # noqa: BLE001 - as StepSeam.__call__
                self._seam_error(rows, e)
            plan, self.plan = self.plan, None
            plan.holds, plan.index = self._hold_states(rows), {}
            self.ranks.share(plan)
        bad = sorted(set(self.ranks.union(bad)))
        if bad:
            by_row = {i: (req, key) for i, req, key in rows}
            why = "mg: a tensor-parallel rank could not apply rank 0's decision"
            if self.follower:
                for i in bad:
                    self._fail(by_row[i][0], why)
            else:
                self.fail([(*by_row[i], why) for i in bad])
        return None

    @staticmethod
    def _hold_states(rows) -> list[tuple[int, int, int, object]]:
        return [(i, h.verified, h.released, h.end) for i, req, _ in rows if (h := rollback.held(req)) is not None]

    def _apply(self, plan: Plan, logits, rows) -> list[int]:
        """A follower's copy of rank 0's decisions (rollbacks, failures, holds, forced tokens), in
        rank 0's order; returns the rows whose rollback raised here."""
        by_row = {i: req for i, req, _ in rows}
        if set(plan.rows) - set(by_row) or {h[0] for h in plan.holds} - set(by_row):
            raise RuntimeError("rank 0's plan names rows this rank's batch does not protect")
        bad = []
        for rp in plan.rows.values():
            req = by_row[rp.row]
            if rp.rollback is not None:
                try:
                    rollback.roll_back(req, *rp.rollback, self.runner.token_to_kv_pool_allocator,
                                       self.runner.req_to_token_pool.req_to_token)
                except Exception as e:  # noqa: BLE001 - failed on every rank (caller)
                    log.error("mg: rollback of %s failed on rank %d: %s", req.rid, self.ranks.rank, e)
                    bad.append(rp.row)
            if rp.fail:
                self._fail(req, rp.fail)
        for i, verified, released, end in plan.holds:
            h = rollback.held(by_row[i]) or rollback.hold(by_row[i], None, threading.Lock())
            h.verified, h.released, h.end = verified, released, end
        forced = [rp for rp in plan.rows.values() if rp.token >= 0]
        if forced:
            force_tokens(logits, [rp.row for rp in forced], [rp.token for rp in forced])
        return bad

