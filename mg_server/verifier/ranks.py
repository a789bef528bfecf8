"""The verifier's tensor-parallel ranks in serving: rank 0 serves, ranks 1.. follow.

Rank 0 is the worker the controller talks to (verifier/server.py). At its load it starts one
follower process per other rank, and all of them join one gloo group (a file rendezvous in the
run folder). Rank 0 sends every call that changes an engine (a step of verify items, a release) to
the followers first: one broadcast of the call and of the clock it runs at. Then every rank runs
the call on its own shard, and the model's reductions go in lockstep (verifier/tp.py). So the
ranks' engines take the same calls at the same times and make the same admission, eviction and
prefix-cache choices; their collectives match, and rank 0's answers are the TP reference. What a
call only reads (hello, stats) stays on rank 0; an idle rank 0 sends a keep-alive call each
minute (a follower's wait for the next call has the group's timeout).

A follower that dies breaks the group: rank 0's next collective raises, that call fails with the
reason, and the worker exits, so the controller starts a new one (a follower whose leader is
gone exits by its parent watch).

Only on a CPU for now: there the gloo group also carries the model's gathers. On CUDA each rank
would compute on its own SGLang rank's weights (a per-rank export) with an NCCL group of a fixed
algorithm; that is not built, and the worker refuses it at load.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from mg_server.config import VerifierConfig
from mg_server.verifier.tp import Ranks

# The longest wait for the other ranks: at the rendezvous (a follower that failed to start fails
# the worker's load then), at each collective, and a follower's for rank 0's next call (rank 0
# sends a KEEP call after KEEP_S without one)
GROUP_TIMEOUT = timedelta(minutes=10)
KEEP_S = 60.0
STEP, RELEASE, KEEP, STOP = "step", "release", "keep", "stop"  # the calls rank 0 sends


class Leader:
    """Rank 0's side: the followers it started and the group's broadcast."""

    def __init__(self, cfg: VerifierConfig):
        if torch.device(cfg.device).type != "cpu":
            raise ValueError(f"a tensor-parallel verifier ({cfg.tp} ranks) runs on a CPU only for now (module doc)")
        init = f"file://{os.path.dirname(cfg.ipc_path) or '.'}/verifier-tp-{uuid.uuid4().hex[:8]}"
        # new interpreters, not multiprocessing children (the worker is a daemon process, which may
        # have none), importing what this one imports; each gets its call on stdin
        self.procs = []
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        for r in range(1, cfg.tp):
            p = subprocess.Popen([sys.executable, "-c", "from mg_server.verifier.ranks import main; main()"],
                                 stdin=subprocess.PIPE, env=env)
            p.stdin.write(pickle.dumps((replace(cfg, parent_pid=os.getpid()), r, init)))
            p.stdin.close()
            self.procs.append(p)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # (one host: the loopback interface)
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=cfg.tp, timeout=GROUP_TIMEOUT)
        self.ranks = Ranks(0, cfg.tp)
        self.sent = time.monotonic()

    def send(self, *call) -> None:
        """Every follower receives `call` (STEP, items, now | RELEASE, rids | KEEP | STOP)."""
        dist.broadcast_object_list([call], src=0)
        self.sent = time.monotonic()

    def keep(self) -> None:
        """An idle worker's turn: a KEEP call once KEEP_S passed without a call (module doc)."""
        if time.monotonic() - self.sent > KEEP_S:
            self.send(KEEP)

    def stop(self) -> None:
        try:
            self.send(STOP)
        finally:
            for p in self.procs:
                try:
                    p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    p.kill()
            dist.destroy_process_group()


def main() -> None:
    """A follower's entry point: (config, rank, rendezvous) pickled on stdin by its Leader."""
    run_follower(*pickle.loads(sys.stdin.buffer.read()))


def run_follower(cfg: VerifierConfig, rank: int, init: str) -> None:
    """A follower's process: its shard and engine, built as rank 0 builds its own, then rank 0's
    calls in the order it sends them, until STOP (or its leader is gone)."""
    from mg_server.wire.channel import set_process_title
    from mg_server.wire.liveness import Lifeline, beat_path, ignore_stop_signals

    ignore_stop_signals()  # (the controller stops the worker, which stops its followers)
    set_process_title(f"mg::verifier-rank{rank}")
    lifeline = Lifeline(beat_path(f"{cfg.ipc_path}.rank{rank}"), cfg.parent_pid, lambda: None,
                        f"mg-verifier-rank{rank}-life").start()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=cfg.tp, timeout=GROUP_TIMEOUT)
    try:
        if cfg.num_threads > 0:  # (as rank 0's VerifierServer.reserve)
            torch.set_num_threads(cfg.num_threads)
        engine = build_engine(cfg, load_model(cfg, Ranks(rank, cfg.tp)))
        while True:
            box: list = [None]
            dist.broadcast_object_list(box, src=0)
            call = box[0]
            if call[0] == STEP:
                engine.step(call[1], now=call[2])
            elif call[0] == RELEASE:
                for rid in call[1]:
                    engine.release(rid)
            elif call[0] == STOP:
                break
    finally:
        dist.destroy_process_group()
        lifeline.stop()


def load_model(cfg: VerifierConfig, ranks: Ranks | None, checkpoint=None):
    """The model every rank loads alike: its shard of the checkpoint (the whole model for one rank)."""
    from mg_server.checkpoint import read_checkpoint
    from mg_server.verifier.model import VerifierModel

    ck = checkpoint or (cfg.model if cfg.model is not None else read_checkpoint(cfg.model_path, identify=False))
    return VerifierModel.load(ck, getattr(torch, cfg.dtype), cfg.device, cfg.max_seq_len, tp=ranks)


def build_engine(cfg: VerifierConfig, model, pool=None):
    """A model's engine under the config's limits (every worker and rank builds its own here)."""
    from mg_server.verifier.engine import VerifierEngine

    return VerifierEngine(model, cfg.max_requests, cfg.pool_tokens, cfg.max_seq_len, cfg.evict_idle_s, pool=pool)


__all__ = ["Leader", "build_engine", "load_model", "main", "run_follower", "KEEP", "KEEP_S", "STEP", "RELEASE", "STOP"]
