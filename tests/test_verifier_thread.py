"""The verifier's move into SGLang's scheduler process (CUDA servers; here on a CPU, tiny model):
the controller stops its worker process on the seam's Handover, reads the verifier as down until
the worker thread serves, then connects to it and verifies through it."""

from __future__ import annotations

import time

import torch
from verifier_helpers import make_tiny

from mg_server.controller.client import ControllerClient
from mg_server.controller.server import ControllerConfig, start_controller
from mg_server.verifier.client import VerifierClient
from mg_server.verifier.server import VerifierConfig
from mg_server.verifier.thread import VerifierThread
from mg_server.wire import protocol as P

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


def _verifier_pid(controller_pid: int) -> int:
    with open(f"/proc/{controller_pid}/task/{controller_pid}/children") as f:
        pids = [int(p) for p in f.read().split()]
    assert len(pids) == 1, pids  # the controller's one child: the worker process
    return pids[0]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _controller(tmp_path):
    """A controller (mode always) with its worker process on a tiny model: (worker cfg, cfg, process)."""
    d, _ = make_tiny("llama", tmp_path / "tiny", dtype=torch.bfloat16)
    vcfg = VerifierConfig(model_path=str(d), ipc_path=str(tmp_path / "v.sock"), max_seq_len=64, max_requests=4,
                          pool_tokens=256, num_threads=1)
    ccfg = ControllerConfig(ipc_path=str(tmp_path / "c.sock"), mode="always", tau=0.0,
                            metrics_dir=str(tmp_path / "metrics"), verifier=vcfg)
    (tmp_path / "metrics").mkdir()
    return vcfg, ccfg, start_controller(ccfg)


def _thread_cfg(vcfg: VerifierConfig, tmp_path) -> VerifierConfig:
    # num_threads 0, as the launcher's: a thread leaves its host process's torch threads alone
    return VerifierConfig(**{**vcfg.__dict__, "ipc_path": str(tmp_path / "t.sock"), "shm_name": "", "num_threads": 0})


def test_handover_stops_the_process_and_connects_to_the_thread(tmp_path):
    vcfg, ccfg, proc = _controller(tmp_path)
    worker = None
    try:
        with ControllerClient(ccfg.ipc_path, timeout_s=120) as c:
            before = c.hello()
            before_pid = _verifier_pid(proc.pid)
            assert before.verifier_up and before.shm.name == vcfg.shm_base
            probe = VerifierClient(vcfg.ipc_path, timeout_s=60)
            ref = probe.verify("ref", len(PROMPT) - 1, PROMPT)  # the process's answer
            probe.close()
            tcfg = _thread_cfg(vcfg, tmp_path)
            c.handover(tcfg.ipc_path)
            assert not c.hello().verifier_up  # the process is gone, the thread not there yet
            assert not _alive(before_pid)
            worker = VerifierThread(tcfg).start()
            deadline = time.monotonic() + 30
            while not (info := c.hello()).verifier_up and time.monotonic() < deadline:
                time.sleep(0.1)
            assert info.verifier_up and info.shm.name == tcfg.shm_base
            assert info.kernel_config_id == before.kernel_config_id
            # the controller's checks now go to the thread: a step, the answer's end, its verdict
            c.report([P.StepRow(rid="r", pos=len(PROMPT) - 1, prompt=PROMPT, margin=0.0, fast_token=ref.token)])
            c.finish(P.Finish(rid="r", output=[ref.token]))
            verdict = c.verdict("r", timeout_s=60)
            assert verdict.state == P.VerdictState.VERIFIED, verdict
            c.shutdown()
        proc.join(30)
        assert proc.exitcode == 0
        worker.thread.join(10)
        assert not worker.thread.is_alive()  # the controller's Shutdown stopped the thread's server too
    finally:
        if proc.is_alive():
            proc.kill()


def test_a_thread_computing_other_bits_is_not_connected(tmp_path, monkeypatch):
    # the front reports the process's kernel configuration id; a thread whose id differs (another
    # table, another torch state) stays down instead of serving checks
    from mg_server.verifier import ops

    vcfg, ccfg, proc = _controller(tmp_path)
    worker = None
    try:
        with ControllerClient(ccfg.ipc_path, timeout_s=120) as c:
            assert c.hello().verifier_up
            monkeypatch.setattr(ops, "config_id", lambda device: "cpu-other")
            tcfg = _thread_cfg(vcfg, tmp_path)
            c.handover(tcfg.ipc_path)
            worker = VerifierThread(tcfg).start()
            time.sleep(3)  # the controller's connect attempts (one a second)
            assert not c.hello().verifier_up
            c.shutdown()
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
        if worker is not None:
            worker.server.running = False
            worker.thread.join(10)  # (a serving thread left at the interpreter's exit aborted it)
