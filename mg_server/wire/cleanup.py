"""What one `mg-server serve` instance leaves on the host, its removal, and the sweep of
instances that died without removing theirs.

An instance owns two temp folders (`mg-run-PORT-PID-*`: sockets, beat files, SGLang's shared
weights' handles; `mg-metrics-PORT-PID-*`: prometheus multiprocess files), PID being the
mg-server process. Every stop removes them (atexit, SGLang's SIGTERM/SIGQUIT path via launch.shutdown, the controller's
orphan watch after a kill -9); whatever a hard crash still leaves is swept by the next start,
which removes only names whose owning pid is gone (another live server's are never touched).
SGLang's own files of the instance (its socket files, its load-snapshot segment: launch.leftovers)
are listed in the run folder (`SGLANG_FILES`), so whoever removes the folder removes them too.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile

log = logging.getLogger(__name__)

_DIR_RE = re.compile(r"^mg-(?:run|metrics)-\d+-(\d+)-")


def temp_prefix(kind: str, port: int, owner_pid: int) -> str:
    """mkdtemp prefix of an instance's folder (kind: "run" | "metrics")."""
    return f"mg-{kind}-{port}-{owner_pid}-"


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    try:  # a zombie is gone as far as its files are concerned
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


SGLANG_FILES = "sglang-files"  # in an instance's run folder: SGLang's files of it, one path a line
# What such a listing may name (a stale or altered list never removes anything else): SGLang's
# NamedTemporaryFile sockets and its load-snapshot segment.
_SGLANG_FILE_RE = re.compile(r"^(?:/tmp/tmp[\w]+|/dev/shm/sglang_loads_[\w]+\.shm)$")


def remove_listed(folder: str) -> None:
    """Remove the SGLang files a run folder lists (SGLANG_FILES)."""
    try:
        with open(os.path.join(folder, SGLANG_FILES)) as f:
            paths = f.read().split()
    except OSError:
        return
    for path in paths:
        if _SGLANG_FILE_RE.match(path):
            try:
                os.unlink(path)
            except OSError:
                pass


def remove_instance(dirs: tuple[str, ...]) -> None:
    """Remove an instance's folders and the SGLang files they list (idempotent)."""
    for d in dirs:
        if d:
            remove_listed(d)
            shutil.rmtree(d, ignore_errors=True)


def sweep_stale(tmp_dir: str | None = None) -> list[str]:
    """Remove the folders of instances whose owning pid is gone; returns their paths."""
    removed, root = [], tmp_dir or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return removed
    for name in names:
        m = _DIR_RE.match(name)
        if m is None or pid_alive(int(m.group(1))):
            continue
        path = os.path.join(root, name)
        remove_listed(path)
        try:
            shutil.rmtree(path)
            removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove stale %s: %s", path, e)
    return removed
