"""An instance's files and the start-up sweep of dead instances' files.
No server: folders under tmp_path stand for /tmp."""

import os
import subprocess
import sys

from mg_server.wire.cleanup import remove_instance, sweep_stale, temp_prefix


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_sweep_removes_only_what_dead_servers_owned(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    dead, live = dead_pid(), os.getpid()
    for pid in (dead, live):
        for kind in ("run", "metrics"):
            d = tmp / (temp_prefix(kind, 30000, pid) + "abc")
            d.mkdir()
            (d / "controller.sock.beat").write_text("1 ok")
    # names mg does not own, or from before owners were named: never touched
    others = [f"mg-run-30000-{dead}x", "mg-metrics-30000-hwf14k8z", "psm_1234"]
    for name in others:
        (tmp / name).mkdir()
    removed = sweep_stale(tmp_dir=str(tmp))
    assert len(removed) == 2 and all(str(dead) in os.path.basename(p) for p in removed)
    left = sorted(os.listdir(tmp))
    assert all(str(live) in n or n in others for n in left) and len(left) == 2 + len(others)
    assert sweep_stale(tmp_dir=str(tmp)) == []


def test_remove_instance_is_complete_and_idempotent(tmp_path):
    run, metrics = tmp_path / "run", tmp_path / "metrics"
    run.mkdir(), metrics.mkdir()
    (metrics / "counter.db").write_bytes(b"x")
    for _ in range(2):
        remove_instance((str(run), str(metrics)))
    assert os.listdir(tmp_path) == []


def test_sglang_instance_files_are_recorded_and_removed(monkeypatch):
    """SGLang's PortArgs names /tmp socket files and a /dev/shm slot file it never removes: mg
    records those built in its process and removes exactly them (a file it did not name stays)."""
    from sglang.srt.managers.load_snapshot import shm_path_for
    from sglang.srt.server_args import PortArgs, ServerArgs

    from mg_server.launch import leftovers

    monkeypatch.setattr(PortArgs, "init_new", PortArgs.__dict__["init_new"])  # restored after the test
    monkeypatch.setattr(leftovers, "_paths", [])
    leftovers.track()
    leftovers.track()  # (once is enough: not wrapped twice)
    args = ServerArgs(model_path="m", device="cpu")
    port_args = PortArgs.init_new(args)
    sockets = [getattr(port_args, n)[len("ipc://"):] for n in
               ("tokenizer_ipc_name", "scheduler_input_ipc_name", "detokenizer_ipc_name", "rpc_ipc_name")]
    slot = shm_path_for(port_args.instance_id)
    open(slot, "wb").close()  # (the scheduler creates it)
    other = slot.replace("sglang_loads_", "sglang_loads_other_")
    open(other, "wb").close()
    try:
        assert all(os.path.exists(p) for p in sockets)
        assert set(sockets) | {slot} <= set(leftovers._paths) and len(leftovers._paths) == len(set(leftovers._paths))
        leftovers.remove()
        leftovers.remove()  # idempotent
        assert not any(os.path.exists(p) for p in [*sockets, slot]) and os.path.exists(other)
    finally:
        os.unlink(other)


def test_sglangs_files_are_listed_in_the_run_folder_and_go_with_it(tmp_path, monkeypatch):
    """A server killed with SIGKILL removes nothing itself: its controller's orphan watch (or the next
    start's sweep) removes the run folder, and with it the SGLang files the folder lists (only
    names of SGLang's patterns: an altered list removes nothing else)."""
    from sglang.srt.managers.load_snapshot import shm_path_for
    from sglang.srt.server_args import PortArgs, ServerArgs

    from mg_server.launch import leftovers
    from mg_server.wire.cleanup import SGLANG_FILES, remove_instance

    monkeypatch.setattr(PortArgs, "init_new", PortArgs.__dict__["init_new"])
    monkeypatch.setattr(leftovers, "_paths", [])
    monkeypatch.setattr(leftovers, "_listing", [])
    run = tmp_path / "mg-run-1-2-x"
    run.mkdir()
    leftovers.track(str(run))
    port_args = PortArgs.init_new(ServerArgs(model_path="m", device="cpu"))
    sockets = [getattr(port_args, n)[len("ipc://"):] for n in ("tokenizer_ipc_name", "scheduler_input_ipc_name")]
    slot = shm_path_for(port_args.instance_id)
    open(slot, "wb").close()
    keep = tmp_path / "not-sglangs"
    keep.write_text("x")
    with open(run / SGLANG_FILES, "a") as f:
        f.write(f"{keep}\n")
    assert all(os.path.exists(p) for p in [*sockets, slot])
    remove_instance((str(run),))
    assert not run.exists() and not any(os.path.exists(p) for p in [*sockets, slot]) and keep.exists()
