"""The server's log: third-party start-up noise lowered to debug, in every process of the tree.

`quiet()` runs in mg-server's own process and in each process SGLang or mg spawns (they
re-import `mg_server.launch.cli`, see its docstring). It changes only the records named here, each
a known message of a known logger (SGLang logs through `logging.getLogger(__name__)`), and
never a record at ERROR or above: a real error, and its traceback, still shows. A lowered record
is logged at DEBUG (`--log-level debug` shows it). Filters sit on the loggers themselves, since
SGLang re-configures the root handlers in each process (`logging.basicConfig(force=True)`).
"""

from __future__ import annotations

import logging
import re
import sys
import warnings

# logger -> messages (regex, matched at the start) that are not news on an mg server
NOISE = {
    # the soft limit of open files is kept where the host's hard limit caps it
    "sglang.srt.utils.common": (r"Fail to set RLIMIT_NOFILE",),
    # model families whose optional kernels/packages are not installed (not the served model)
    "sglang.srt.models.registry": (r"Ignore import error when loading",),
    "sglang.srt.managers.multimodal_processor": (r"Ignore import error when loading",),
    "sglang.srt.dllm.algorithm": (r"Ignore import error when loading",),
    # mg's hook factory attaches to the sampler itself and returns no module hook (by design)
    "sglang.srt.model_executor.hook_manager": (r"Hook factory '.*' returned None",),
    # the CPU engine settings mg chose itself (launch.launcher)
    "sglang.srt.arg_groups.attention_hook": (r"Cuda graph is disabled because of using torch native",),
    "sglang.srt.model_executor.model_runner_components.cuda_graph_setup": (
        r"Disable prefill CUDA graph because cuda_graph_config resolved",),
    "sglang.kernels.jit.utils.arch": (r"Cannot detect CUDA architecture",),
    "sglang.srt.distributed.bootstrap": (r"init_cpu_threads_env and shared memory based AllReduce is disabled",
                                         r"Init parallel (begin|ends)", r"Memory baseline taken"),
    "sglang.srt.utils.numa_utils": (r"init_threads_binding:",),
    # every server flag on one line of ~20 kB (`/get_server_info` has them)
    "sglang.srt.entrypoints.engine": (r"server_args=",),
    "sglang.srt.mem_cache.unified_radix_cache": (r"Init Unified Radix Cache",),
    "sglang.srt.mem_cache.registry": (r"Tree cache initialized",),
}
# Python warnings SGLang's CPU platform raises at import, once per process
WARNINGS = (r"Only CUDA, .* support (AWQ|GGUF)", r"Triton is not supported on current platform")
HEALTH = ("/health", "/health_generate")


class Lower(logging.Filter):
    """Log a logger's known noise at DEBUG instead of its own level (below ERROR only)."""

    def __init__(self, patterns: tuple[str, ...]):
        super().__init__()
        self.patterns = re.compile("|".join(f"(?:{p})" for p in patterns))

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR or not self.patterns.match(record.getMessage()):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


class HealthBeforeReady(logging.Filter):
    """uvicorn's access line of a `/health` 503 answered before the first 200: a client polling
    a server that is still starting (later 503s are news: mg's runtime is down)."""

    def __init__(self):
        super().__init__()
        self.ready = False

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        if len(args) != 5 or str(args[2]).split("?")[0] not in HEALTH:
            return True  # (client, method, path, http version, status): uvicorn's access record
        self.ready = self.ready or args[4] == 200
        if self.ready or args[4] != 503:
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def no_tqdm_semaphore() -> None:
    """tqdm's write lock is a multiprocessing RLock by default: under SGLang's spawn start method a
    named POSIX semaphore (`/dev/shm/sem.mp-*`), which only multiprocessing's resource tracker
    would unlink, and SGLang's stop kills that tracker with SIGKILL. No tqdm bar of the server
    is shared between processes: a thread lock (tqdm's other lock) is enough."""
    from tqdm.std import TqdmDefaultWriteLock

    if not hasattr(TqdmDefaultWriteLock, "mp_lock"):  # (before the first bar creates it)
        TqdmDefaultWriteLock.mp_lock = None


def no_bars_in_files() -> None:
    """A progress bar redraws with carriage returns: in a log file its frames run together on
    one line. Off where stderr is not a terminal; the log's own lines say what was loaded."""
    if sys.stderr is not None and sys.stderr.isatty():
        return
    from tqdm import std

    if getattr(std.tqdm.__init__, "_mg_no_bars", False):
        return
    init = std.tqdm.__init__

    def quiet_init(self, *args, **kwargs):
        kwargs["disable"] = True
        init(self, *args, **kwargs)

    quiet_init._mg_no_bars = True
    std.tqdm.__init__ = quiet_init


def quiet() -> None:
    """Apply the filters above in this process (idempotent)."""
    for name, patterns in NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, Lower) for f in logger.filters):
            logger.addFilter(Lower(patterns))
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, HealthBeforeReady) for f in access.filters):
        access.addFilter(HealthBeforeReady())
    for message in WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    no_tqdm_semaphore()
    no_bars_in_files()
