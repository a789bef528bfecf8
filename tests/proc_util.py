"""Processes of one server's own tree (never found by name machine-wide: other servers may run)."""

from __future__ import annotations

import os
import time

import psutil


def titles(root_pid: int) -> dict[int, str]:
    """pid -> process title (mg::controller, mg::verifier, sglang::scheduler, ...) of root's descendants."""
    out = {}
    try:
        kids = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return out
    for k in kids:
        try:
            out[k.pid] = (k.cmdline() or [""])[0]
        except psutil.Error:
            pass
    return out


def find(root_pid: int, title: str) -> list[int]:
    return [pid for pid, t in titles(root_pid).items() if t.startswith(title)]


def running(pids) -> list[int]:
    """The pids that still run (a zombie has exited)."""
    left = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
        except psutil.NoSuchProcess:
            pass
    return left


def wait_until(cond, timeout: float, period: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(period)
    return cond()


def held_paths(pids, under: tuple[str, ...] = ("/tmp/", "/dev/shm/")) -> set[str]:
    """Files under `under` that the processes hold: open, mapped (shared memory, named semaphores)
    or bound as unix sockets (the listing of a socket file names its inode, not its holder)."""
    paths, inodes = set(), set()
    for pid in pids:
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    target = os.readlink(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[len("socket:["):-1])
                else:
                    paths.add(target)
            with open(f"/proc/{pid}/maps") as f:
                paths.update(line.split(maxsplit=5)[5].strip() for line in f if len(line.split(maxsplit=5)) == 6)
        except OSError:
            pass
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if len(fields) == 8 and fields[6] in inodes:
                paths.add(fields[7])
    return {p for p in paths if p.startswith(under) and not p.endswith(" (deleted)")}


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group still runs (a zombie counts until it is reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
