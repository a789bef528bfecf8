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
A beat names the process that wrote it, so a caller tells a restarted peer from the one its call
went to (`PeerWatch`); while none runs, its supervisor writes a placeholder beat (pid
`NO_PROCESS`) whose status says why. The rules for restarting a lost worker (`Restarts`,
`WEDGED_AFTER_S`) are shared by the controller (its verifier) and the main process (the controller).
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
# A worker whose beat is older than this is killed and started again. Why not at STALE_AFTER_S: a
# pause that ends (a loaded host, a debugger) then costs its calls only, not its model load and
# the state of every request it held.
WEDGED_AFTER_S = 10.0
NO_PROCESS = 0  # the pid of a placeholder beat: no process serves the socket now
# Restarts: the k-th failure in a row (an exit, a wedge, a new worker that did not start) waits
# RESTART_BACKOFF_S[k-1] before the next start: the first at once (a crash after long service),
# later ones back off (a worker that keeps failing to load). Failures stop counting as "in a row"
# once a worker has run for RESTART_STABLE_S; the RESTART_LIMIT-th in a row gives up (the server
# stops, exit code 1): four starts in about 7 s plus their load times.
RESTART_BACKOFF_S = (0.0, 1.0, 2.0, 4.0)
RESTART_LIMIT = 5
RESTART_STABLE_S = 60.0
GAVE_UP_EXIT = 3  # a controller's exit code once its verifier failed RESTART_LIMIT times in a row


def beat_path(ipc_path: str) -> str:
    """The beat file of the process serving `ipc_path` (one place, so clients and servers agree)."""
    return ipc_path + ".beat"


def seam_beat_path(controller_ipc: str) -> str:
    """The beat file of the step seam's finish watcher (scheduler process), beside the controller's."""
    return os.path.join(os.path.dirname(controller_ipc), "seam.beat")


def write_beat(path: str, status: str, pid: int | None = None) -> None:
    """A beat of this process (`pid` None), or a placeholder (`NO_PROCESS`) from its supervisor."""
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # per thread: two writers never share it
    with open(tmp, "w") as f:
        f.write(f"{time.monotonic():.3f}@{os.getpid() if pid is None else pid} {status}")
    os.replace(tmp, path)  # readers never see a half-written beat


@dataclass(frozen=True)
class Beat:
    age_s: float  # seconds since the process last beat (CLOCK_MONOTONIC is system-wide on Linux)
    status: str  # the process's one-line status ("" if it has none)
    pid: int | None = None  # the writer (NO_PROCESS: a placeholder; None: a beat that names none)


def read_beat(path: str) -> Beat | None:
    """The last beat of a process; None if it never beat (not started yet, or stopped cleanly)."""
    try:
        with open(path) as f:
            head, _, status = f.read().partition(" ")
        stamp, _, pid = head.partition("@")
        return Beat(time.monotonic() - float(stamp), status.strip(), int(pid) if pid else None)
    except (FileNotFoundError, ValueError):
        return None


def stale_reason(path: str, stale_after_s: float = STALE_AFTER_S, pid: int | None = None) -> str:
    """"" while the process beats (or has not started beating), else why it counts as down.
    `pid`: only that process's beat counts (a new worker's before its first beat: its
    predecessor's last one is no news of it)."""
    beat = read_beat(path)
    if beat is not None and beat.age_s > stale_after_s and (pid is None or beat.pid == pid):
        return f"no heartbeat for {beat.age_s:.1f}s (process dead, stopped or frozen)"
    return ""


class PeerWatch:
    """A caller's `peer_check` (wire.channel) of the process serving a socket, by its beat file:
    down when its beat is stale, when a placeholder says none serves it, or when another process
    beats there than the one seen at the call's first look (its predecessor took the call's
    request with it; the new one does not know it). `reset()` before each call."""

    def __init__(self, path: str):
        self.path = path
        self.pid: int | None = None  # the process serving the current call, once seen

    def reset(self) -> None:
        self.pid = None

    def __call__(self) -> str:
        beat = read_beat(self.path)
        if beat is None:
            return ""  # not started yet
        if beat.pid == NO_PROCESS:
            return beat.status or "no process serves it"
        if beat.age_s > STALE_AFTER_S:
            return f"no heartbeat for {beat.age_s:.1f}s (process dead, stopped or frozen)"
        if beat.pid is None:  # (a beat that names no process: its age is all it says)
            return ""
        if self.pid is None:
            self.pid = beat.pid
        elif beat.pid != self.pid:
            return f"process {self.pid} was replaced by process {beat.pid}"
        return ""


def exit_reason(proc, what: str) -> str:
    """"" while the multiprocessing child `proc` runs, else how it ended."""
    return "" if proc is None or proc.is_alive() else f"the {what} process exited (code {proc.exitcode})"


def wait_gone(pid: int, timeout_s: float) -> bool:
    """Wait until process `pid` has exited (a zombie counts as gone); False if it still runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rpartition(")")[2].split()[0] == "Z":
                    return True
        except (OSError, IndexError):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


class Restarts:
    """When to start a lost worker again, and when to give up (the RESTART_* rules above)."""

    def __init__(self, backoff_s: tuple[float, ...] = RESTART_BACKOFF_S, limit: int = RESTART_LIMIT,
                 stable_s: float = RESTART_STABLE_S):
        self.backoff_s, self.limit, self.stable_s = backoff_s, limit, stable_s
        self.in_a_row = 0  # failures since a worker last ran for stable_s
        self.up_since: float | None = None  # when the current worker came up (None: none is up)

    def up(self, now: float) -> None:
        self.up_since = now

    def failed(self, now: float) -> float | None:
        """Count a failure at `now`: the delay before the next start, or None: give up."""
        if self.up_since is not None and now - self.up_since >= self.stable_s:
            self.in_a_row = 0
        self.up_since = None
        self.in_a_row += 1
        if self.in_a_row >= self.limit:
            return None
        return self.backoff_s[min(self.in_a_row, len(self.backoff_s)) - 1]


class Lifeline:
    """The beat writer and parent watch of one runtime process (see module doc)."""

    def __init__(self, path: str, parent_pid: int, on_orphan: Callable[[], None] = lambda: None,
                 name: str = "mg-lifeline", status: str = ""):
        self.path = path
        self.parent_pid = parent_pid
        self.on_orphan = on_orphan  # runs in the lifeline thread right before os._exit
        self.status = status  # from the first beat on
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
