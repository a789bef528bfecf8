"""Processes of one server's own tree (never found by name machine-wide: other servers may run)."""

from __future__ import annotations

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
