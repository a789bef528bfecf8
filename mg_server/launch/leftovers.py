"""SGLang's own files of one server instance, removed with mg's (wire.cleanup) at every stop.

SGLang names its inter-process sockets with `tempfile.NamedTemporaryFile(delete=False)` (five
`/tmp/tmpXXXXXXXX` files per start) and its load-snapshot slot file after the instance id
(`/dev/shm/sglang_loads_<id>_<digest>.shm`), all in `PortArgs.init_new`, and removes none of
them at its stop (measured: five /tmp files and one /dev/shm file more after each start/stop).
mg records the names of the PortArgs built in its own process, so only this server's files go,
and lists them in the instance's run folder (wire.cleanup.SGLANG_FILES): a server killed with
SIGKILL has them removed by its controller's orphan watch, or by the next start's sweep.
Best effort: an SGLang without these internals only leaves its files, as before.
"""

from __future__ import annotations

import dataclasses
import logging
import os

log = logging.getLogger(__name__)

_paths: list[str] = []  # this server's SGLang files, in the order they were named
_listing: list[str] = []  # the run folder's list of them ([] : none kept)


def _record(port_args) -> None:
    try:
        from sglang.srt.managers.load_snapshot import shm_path_for
    except ImportError:
        shm_path_for = None
    for f in dataclasses.fields(port_args):
        value = getattr(port_args, f.name, None)
        if f.name.endswith("_ipc_name") and isinstance(value, str) and value.startswith("ipc://"):
            _paths.append(value[len("ipc://"):])
    if shm_path_for is not None and getattr(port_args, "instance_id", ""):
        _paths.append(shm_path_for(port_args.instance_id))
    for listing in _listing:
        with open(listing, "w") as f:
            f.write("\n".join(_paths) + "\n")


def track(run_dir: str = "") -> None:
    """Record the files of every PortArgs SGLang builds in this process (the server's main one),
    listed in `run_dir` too when given."""
    from sglang.srt.server_args import PortArgs

    from mg_server.wire.cleanup import SGLANG_FILES

    if run_dir:
        _listing[:] = [os.path.join(run_dir, SGLANG_FILES)]

    original = PortArgs.__dict__.get("init_new")
    if not isinstance(original, staticmethod) or getattr(original.__func__, "_mg_tracked", False):
        return

    def init_new(*args, **kwargs):
        port_args = original.__func__(*args, **kwargs)
        try:
            _record(port_args)
        except Exception:  # noqa: BLE001 - never keep SGLang from starting over a file name
            log.debug("mg: could not record SGLang's instance files", exc_info=True)
        return port_args

    init_new._mg_tracked = True
    PortArgs.init_new = staticmethod(init_new)


def remove() -> None:
    """Remove the recorded files (idempotent; a bound socket's open connections stay)."""
    for path in _paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("could not remove %s: %s", path, e)
