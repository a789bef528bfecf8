"""Start a real `mg-server serve` process (loopback only): used by tests, benchmarks and `mg-server calibrate`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests


def free_port() -> int:
    """A free port below the kernel's ephemeral range. Why: a port the OS handed out for port 0
    is in that range, and once closed it can be handed again to a bind of port 0 in the server
    starting on it (its own internal sockets) before the HTTP server binds it (seen once in CI:
    `address already in use`, then a server that never became ready)."""
    import random

    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default start
    for _ in range(100):
        port = random.randrange(10000, max(10001, low))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # (no free port there: the OS's choice)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, port: int | None = None, tree: Path | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        # The package's entry module, never an installed `mg-server` script: the server runs the
        # code of the tree this process imports (a checkout, a worktree), whatever the script names,
        # or that of `tree`, another checkout (an A/B of two versions: started there, first on the path).
        cmd = [sys.executable, "-m", "mg_server", "serve", "--port", str(self.port), *args]
        env = None
        if tree is not None:
            tree = Path(tree).resolve()
            path = [str(tree), *filter(None, [os.environ.get("PYTHONPATH")])]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
        self._log = open(log_path, "w")
        # own process group, so SGLang's children are stopped with it
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     cwd=tree, env=env)

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = 420) -> float:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return time.monotonic() - start
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        try:  # stragglers of the group (SGLang's scheduler/detokenizer)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()
