"""Liveness of mg's runtime processes (no model, no server): a waiting call gives up on a dead
peer at once, a stopped process reads as down within seconds, an orphan cleans up and exits."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
import zmq

from mg_server.wire import protocol as P
from mg_server.wire.channel import RpcClient, RpcError
from mg_server.wire.liveness import STALE_AFTER_S, Lifeline, beat_path, read_beat, stale_reason


def test_a_call_gives_up_on_a_dead_peer_long_before_its_timeout(tmp_path):
    ipc = str(tmp_path / "silent.sock")
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)  # receives, never answers: a peer that hangs or died mid-call
    server.setsockopt(zmq.LINGER, 0)
    server.bind("ipc://" + ipc)
    try:
        dead_at = time.monotonic() + 0.5
        with RpcClient(ipc, timeout_s=30, peer_check=lambda: "gone" if time.monotonic() > dead_at else "") as client:
            t0 = time.monotonic()
            with pytest.raises(RpcError) as e:
                client.call(P.Stats())
        assert e.value.code == P.ErrorCode.PEER_DOWN and "gone" in str(e.value)
        assert time.monotonic() - t0 < 2.0
        with RpcClient(ipc, timeout_s=0.3) as plain, pytest.raises(RpcError) as e:
            plain.call(P.Stats())  # without a check, the timeout is what ends the wait
        assert e.value.code == P.ErrorCode.TIMEOUT
    finally:
        server.close(0)
        ctx.term()


def _beat_forever(path: str, parent_pid: int, marker: str) -> None:
    Lifeline(path, parent_pid, on_orphan=lambda: Path(marker).write_text("cleaned")).start()
    while True:
        time.sleep(1)


def _spawn_beating_grandchild(path: str, marker: str, pid_file: str) -> None:
    """A middle process (the controller's role) that starts a beating child, then waits."""
    child = mp.get_context("spawn").Process(target=_beat_forever, args=(path, os.getpid(), marker), daemon=False)
    child.start()
    Path(pid_file).write_text(str(child.pid))
    child.join()


def _wait(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def test_a_stopped_process_reads_as_down_and_as_up_again_when_resumed(tmp_path):
    path = str(tmp_path / "p.beat")
    proc = mp.get_context("spawn").Process(target=_beat_forever, args=(path, os.getpid(), str(tmp_path / "m")))
    proc.start()
    try:
        assert _wait(lambda: read_beat(path) is not None, 30)
        assert stale_reason(path) == ""
        os.kill(proc.pid, signal.SIGSTOP)
        assert _wait(lambda: stale_reason(path) != "", STALE_AFTER_S + 2)
        assert "no heartbeat" in stale_reason(path)
        os.kill(proc.pid, signal.SIGCONT)
        assert _wait(lambda: stale_reason(path) == "", 2)
    finally:
        proc.kill()
        proc.join()


def test_an_orphaned_process_cleans_up_and_exits(tmp_path):
    # kill -9 of the middle process (mg-server, or the controller): its child must not stay
    path, marker, pid_file = (str(tmp_path / n) for n in ("c.beat", "cleaned", "pid"))
    middle = mp.get_context("spawn").Process(target=_spawn_beating_grandchild, args=(path, marker, pid_file))
    middle.start()
    assert _wait(lambda: Path(pid_file).exists() and read_beat(path) is not None, 60)
    child = int(Path(pid_file).read_text())
    middle.kill()
    middle.join()
    assert _wait(lambda: Path(marker).exists(), 5), "the orphan did not run its clean-up"

    def gone() -> bool:
        try:
            with open(f"/proc/{child}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] == "Z"  # exited, waiting to be reaped
        except FileNotFoundError:
            return True

    assert _wait(gone, 5), "the orphan is still running"


def test_beat_path_is_next_to_the_socket():
    ipc = f"/tmp/mg-{uuid.uuid4().hex}.sock"
    assert beat_path(ipc).startswith(ipc) and read_beat(beat_path(ipc)) is None and stale_reason(beat_path(ipc)) == ""
