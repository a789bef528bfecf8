"""The verifier's benchmark script runs end to end on the CPU (tiny shape) and writes its numbers."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "verifier.py"


def run(tmp_path, *args) -> dict:
    out = tmp_path / f"{args[0]}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(out)], cwd=tmp_path, env=env, check=True,
                   timeout=600)
    return json.loads(out.read_text())


def test_calls_and_windows_on_cpu(tmp_path):
    calls = run(tmp_path, "calls", "--models", "tiny", "--device", "cpu", "--ctx", "16", "--iters", "1")
    assert calls["models"]["tiny"]["verify_gap64_x8_ms"] > 0
    assert calls["ipc"]["model"] == "tiny" and calls["ipc"]["ipc_verify_gap0_ms"] > 0
    win = run(tmp_path, "windows", "--model", "tiny", "--device", "cpu", "--ctx", "16", "--requests", "2",
              "--iters", "1", "--cases", "1x1,2x3", "--profile", "")
    assert set(win["cases"]) == {"1x1", "2x3"} and all(c["ms"] > 0 for c in win["cases"].values())


def test_unknown_subcommand_fails(tmp_path):
    r = subprocess.run([sys.executable, str(SCRIPT), "nope"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode != 0 and "usage: verifier.py" in r.stderr
