"""evaluation.server_process: a server started from another checkout (`tree`: the benchmarks' A/B
of two versions in one run) runs that checkout's package, and without it this tree's."""
from __future__ import annotations

import shutil
from pathlib import Path

from mg_server.evaluation.server_process import ServerProcess

PACKAGE = Path(__file__).resolve().parents[1] / "mg_server"


def _log_of(args: list[str], log: Path, tree: Path | None = None) -> str:
    srv = ServerProcess(args, log, tree=tree)
    try:
        assert srv.proc.wait(120) == 0, log.read_text()
    finally:
        srv.stop()
    return log.read_text()


def test_a_server_of_another_tree_runs_that_trees_package(tmp_path):
    other = tmp_path / "other"
    shutil.copytree(PACKAGE, other / "mg_server", ignore=shutil.ignore_patterns("__pycache__"))
    main = other / "mg_server" / "__main__.py"
    main.write_text('print("entry:", __file__, flush=True)\n' + main.read_text())
    got = _log_of(["--help"], tmp_path / "other.log", tree=other)
    assert f"entry: {other.resolve() / 'mg_server' / '__main__.py'}" in got and "usage: mg-server serve" in got
    assert "entry:" not in _log_of(["--help"], tmp_path / "here.log")
