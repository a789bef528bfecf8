"""The server log's quiet filters (mg_server.logs): known third-party noise goes to DEBUG, errors
and everything else keep their level; tqdm makes no named semaphore."""

import logging
import subprocess
import sys
import warnings

import pytest

from mg_server import logs


@pytest.fixture()
def quiet(caplog):
    logs.quiet()
    caplog.set_level(logging.INFO)
    return caplog


def test_known_noise_is_lowered_and_the_rest_kept(quiet):
    registry = logging.getLogger("sglang.srt.models.registry")
    registry.warning("Ignore import error when loading sglang.srt.models.mamba: no module")
    registry.warning("something else went wrong")
    registry.error("Ignore import error when loading x")  # an error is never lowered
    logging.getLogger("sglang.srt.utils.common").warning("Fail to set RLIMIT_NOFILE: current limit exceeds")
    logging.getLogger("sglang.srt.entrypoints.engine").info("server_args={'model_path': 'x'}")
    logging.getLogger("sglang.srt.model_executor.hook_manager").warning(
        "Hook factory 'mg_server.seam.hook:make_hook' for spec 'mg' returned None, not registering any hook")
    logging.getLogger("sglang.other").warning("Fail to set RLIMIT_NOFILE")  # another logger: its own
    shown = [(r.name, r.levelname, r.getMessage()) for r in quiet.records]
    assert shown == [("sglang.srt.models.registry", "WARNING", "something else went wrong"),
                     ("sglang.srt.models.registry", "ERROR", "Ignore import error when loading x"),
                     ("sglang.other", "WARNING", "Fail to set RLIMIT_NOFILE")]


def test_lowered_records_show_at_debug(quiet):
    quiet.set_level(logging.DEBUG)
    logging.getLogger("sglang.srt.utils.common").warning("Fail to set RLIMIT_NOFILE: x")
    assert [(r.levelname, r.getMessage()) for r in quiet.records] == [("DEBUG", "Fail to set RLIMIT_NOFILE: x")]


def test_a_health_503_is_lowered_only_before_the_first_200(quiet):
    access = logging.getLogger("uvicorn.access")
    for f in [f for f in access.filters if isinstance(f, logs.HealthBeforeReady)]:
        f.ready = False
    line = '%s - "%s %s HTTP/%s" %d'
    for path, status in (("/health", 503), ("/v1/models", 503), ("/health", 200), ("/health", 503)):
        access.info(line, "127.0.0.1:1", "GET", path, "1.1", status)
    assert [r.getMessage() for r in quiet.records] == [
        '127.0.0.1:1 - "GET /v1/models HTTP/1.1" 503', '127.0.0.1:1 - "GET /health HTTP/1.1" 200',
        '127.0.0.1:1 - "GET /health HTTP/1.1" 503']


def test_platform_warnings_are_filtered_and_others_kept():
    logs.quiet()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")
        logs.quiet()  # (catch_warnings reset the filters: the quiet ones go back on top)
        warnings.warn("Only CUDA, HIP and XPU support AWQ currently.", UserWarning)
        warnings.warn("Triton is not supported on current platform, roll back to CPU.", UserWarning)
        warnings.warn("a real warning", UserWarning)
    assert [str(w.message) for w in seen] == ["a real warning"]


CHILD = """
import multiprocessing as mp, sys
from mg_server import logs
if sys.argv[1] == "quiet":
    logs.quiet()
mp.set_start_method("spawn", force=True)
from tqdm import tqdm
from tqdm.std import TqdmDefaultWriteLock
for _ in tqdm(range(2)):
    pass
lock = TqdmDefaultWriteLock.mp_lock
name = lock._semlock.name if lock is not None else None
print(name)
if lock is not None:  # (unlinked here: this probe leaves nothing behind)
    from multiprocessing.synchronize import SemLock
    SemLock._cleanup(name)
"""


@pytest.mark.parametrize("mode", ["quiet", "plain"])
def test_tqdm_makes_no_named_semaphore_in_a_quiet_process(mode):
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    name = out.stdout.strip()
    # plain: tqdm's default lock is a /dev/shm/sem.mp-* semaphore under spawn (what leaked)
    assert (name == "None") == (mode == "quiet"), name
