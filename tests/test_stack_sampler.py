"""The benchmarks' stack sampler (benchmarks/stacks): phases split a process's time, and the
summary names the function that spent it."""

import os
import subprocess
import sys
from pathlib import Path

STACKS = Path(__file__).resolve().parents[1] / "benchmarks" / "stacks"

CHILD = """
import time
from pathlib import Path
phase = Path({phase!r})

def spin_here(s):
    end = time.perf_counter() + s
    while time.perf_counter() < end:
        sum(range(200))

def sleep_here(s):
    time.sleep(s)

phase.write_text("busy"); time.sleep(0.2); spin_here(0.6)  # (the sampler reads the phase every 50 ms)
phase.write_text("quiet"); time.sleep(0.2); sleep_here(0.6)
phase.write_text("idle"); time.sleep(0.2)
"""


def test_phases_split_the_time_and_the_summary_names_the_function(tmp_path):
    out = tmp_path / "stacks"
    env = dict(os.environ, STACK_SAMPLES_DIR=str(out), PYTHONPATH=os.pathsep.join([str(STACKS),
                                                                                 os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", CHILD.format(phase=str(out / "phase"))], env=env, check=True, timeout=60)
    busy, = out.glob("*-busy.txt")
    quiet, = out.glob("*-quiet.txt")

    def seconds(path, func):
        return sum(float(line.rpartition(" ")[2]) for line in path.read_text().splitlines()[1:]
                   if func in line.rpartition(" ")[0].split(";"))

    # time-weighted: a thread asleep (no GIL held) is counted as fully as one running Python
    assert 0.4 < seconds(busy, "<string>:spin_here") < 0.8 and seconds(busy, "<string>:sleep_here") == 0
    assert 0.4 < seconds(quiet, "<string>:sleep_here") < 0.8 and seconds(quiet, "<string>:spin_here") == 0
    text = subprocess.run([sys.executable, str(STACKS / "sitecustomize.py"), str(out), "quiet", "--under",
                           "<string>:<module>"], capture_output=True, text=True, check=True, timeout=60).stdout
    assert "<string>:sleep_here" in text and "under <string>:<module>" in text


def test_off_without_its_variable(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(STACKS))
    env.pop("STACK_SAMPLES_DIR", None)
    names = subprocess.run([sys.executable, "-c", "import threading; print([t.name for t in threading.enumerate()])"],
                           env=env, capture_output=True, text=True, check=True, timeout=60).stdout
    assert "stack-sampler" not in names
