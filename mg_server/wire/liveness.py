"""Liveness of mg's runtime processes (controller, verifier): heartbeats and parent watch.

Each runtime process runs one `Lifeline` thread from its first moments (before any model load):
- it rewrites a small beat file next to its ipc socket every `BEAT_PERIOD_S`, with a monotonic
  time stamp and a one-line status (the controller's says whether its verifier is up). A client
  waiting for that process reads the beat's age: a process that died, was stopped (SIGSTOP) or
  froze stops beating within a second, while a process busy with a long verify keeps beating
  (torch releases the GIL inside its ops, and Python switches threads every few ms). So a
  waiter gives up on a dead or stopped peer within seconds, not after a long call timeout.
- it watches the process that started it: once that one is gone (e.g. `kill -9` of
  mg-server), it runs the process's clean-up and exits, whatever the main thread is blocked in
  (a model load, a verify call). The parent's pid is passed in the process's config, so a
  parent that died before the thread started is noticed too.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

log = logging.getLogger(__name__)

BEAT_PERIOD_S = 0.25
# A beat older than this means the process is dead, stopped or frozen. Several periods of
# slack: the machines that run mg are busy (SGLang's processes busy-poll), and a false alarm
# fails deterministic requests.
STALE_AFTER_S = 3.0


def beat_path(ipc_path: str) -> str:
    """The beat file of the process serving `ipc_path` (one place, so clients and servers agree)."""
    return ipc_path + ".beat"


def seam_beat_path(controller_ipc: str) -> str:
    """The beat file of the step seam's finish watcher (scheduler process), beside the controller's."""
    return os.path.join(os.path.dirname(controller_ipc), "seam.beat")


def write_beat(path: str, status: str) -> None:
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # per thread: two writers never share it
    with open(tmp, "w") as f:
        f.write(f"{time.monotonic():.3f} {status}")
    os.replace(tmp, path)  # readers never see a half-written beat


@dataclass(frozen=True)
class Beat:
    age_s: float  # seconds since the process last beat (CLOCK_MONOTONIC is system-wide on Linux)
    status: str  # the process's one-line status ("" if it has none)


def read_beat(path: str) -> Beat | None:
    """The last beat of a process; None if it never beat (not started yet, or stopped cleanly)."""
    try:
        with open(path) as f:
            stamp, _, status = f.read().partition(" ")
        return Beat(time.monotonic() - float(stamp), status.strip())
    except (FileNotFoundError, ValueError):
        return None


def stale_reason(path: str, stale_after_s: float = STALE_AFTER_S) -> str:
    """"" while the process beats (or has not started beating), else why it counts as down."""
    beat = read_beat(path)
    if beat is not None and beat.age_s > stale_after_s:
        return f"no heartbeat for {beat.age_s:.1f}s (process dead, stopped or frozen)"
    return ""


class Lifeline:
    """The beat writer and parent watch of one runtime process (see module doc)."""

    def __init__(self, path: str, parent_pid: int, on_orphan: Callable[[], None] = lambda: None,
                 name: str = "mg-lifeline"):
        self.path = path
        self.parent_pid = parent_pid
        self.on_orphan = on_orphan  # runs in the lifeline thread right before os._exit
        self.status = ""
        self._lock = threading.Lock()  # status and its write, between the beat thread and set_status
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "Lifeline":
        self._beat()
        self._thread.start()
        return self

    def _beat(self) -> None:
        with self._lock:
            write_beat(self.path, self.status)

    def set_status(self, status: str) -> None:
        """Change the status line and write it now (not at the next beat, which could otherwise
        write the old line after this one)."""
        with self._lock:
            self.status = status
            write_beat(self.path, status)

    def _parent_gone(self) -> bool:
        if os.getppid() != self.parent_pid:
            return True
        try:  # a dead parent not yet reaped is still our parent, as a zombie
            with open(f"/proc/{self.parent_pid}/stat") as f:
                return f.read().rpartition(")")[2].split()[0] == "Z"
        except (OSError, IndexError):
            return False

    def _run(self) -> None:
        while not self._stop.wait(BEAT_PERIOD_S):
            if self.parent_pid and self._parent_gone():
                log.error("parent process %d is gone: cleaning up and exiting", self.parent_pid)
                try:
                    self.on_orphan()
                finally:
                    os._exit(1)
            try:
                self._beat()
            except OSError:  # run folder removed at shutdown: nothing left to tell
                pass

    def stop(self) -> None:
        """Stop beating (the file stays: a process that stopped serving reads as down). Joined,
        so no daemon thread is left running into interpreter shutdown."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(2 * BEAT_PERIOD_S)


def ignore_stop_signals() -> None:
    """SIGINT and SIGTERM do nothing in this process, one of a server's child processes (call it
    from the main thread, first). Why: Ctrl-C in a terminal, or a signal sent to the server's
    process group, reaches every process; the main process alone decides how the server stops (its
    drain needs the others alive), then stops them itself, and a child whose parent is gone exits."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
