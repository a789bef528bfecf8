"""An instance's files and the start-up sweep of dead instances' files (issue 12, item 7).
No server: folders and segment names under tmp_path stand for /tmp and /dev/shm."""

import os
import subprocess
import sys

from mg_server.runtime.cleanup import remove_instance, shm_base, sweep_stale, temp_prefix


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep_removes_only_what_dead_servers_owned(tmp_path):
    tmp, shm = tmp_path / "tmp", tmp_path / "shm"
    tmp.mkdir(), shm.mkdir()
    dead, live = dead_pid(), os.getpid()
    for pid in (dead, live):
        for kind in ("run", "metrics"):
            d = tmp / (temp_prefix(kind, 30000, pid) + "abc")
            d.mkdir()
            (d / "controller.sock.beat").write_text("1 ok")
        base = shm_base(pid, f"/x/{pid}/verifier.sock")
        (shm / base).write_bytes(b"x")
        (shm / (base + "_g")).write_bytes(b"x")
    # names mg does not own, or from before owners were named: never touched
    others = ["mgv_06b79e611ab0b1cb", "mgv_06b79e611ab0b1cb_g", "psm_1234", f"mg-run-30000-{dead}x"]
    for name in others:
        (shm / name).write_bytes(b"x")
    (tmp / "mg-metrics-30000-hwf14k8z").mkdir()
    removed = sweep_stale(tmp_dir=str(tmp), shm_dir=str(shm))
    assert len(removed) == 4 and all(str(dead) in os.path.basename(p) for p in removed)
    left = sorted(os.listdir(tmp)) + sorted(os.listdir(shm))
    assert all(str(live) in n or n in others or n == "mg-metrics-30000-hwf14k8z" for n in left)
    assert len(left) == 4 + len(others) + 1
    assert sweep_stale(tmp_dir=str(tmp), shm_dir=str(shm)) == []


def test_remove_instance_is_complete_and_idempotent(tmp_path):
    run, metrics = tmp_path / "run", tmp_path / "metrics"
    run.mkdir(), metrics.mkdir()
    (metrics / "counter.db").write_bytes(b"x")
    base = shm_base(123, "/r/verifier.sock")
    (tmp_path / base).write_bytes(b"x")
    (tmp_path / (base + "_g")).write_bytes(b"x")
    for _ in range(2):
        remove_instance((str(run), str(metrics)), (base,), shm_dir=str(tmp_path))
    assert os.listdir(tmp_path) == []
