"""SGLang integration pieces that need no running server."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from mg_server.config import ServeConfig


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_cpu_compat_makes_sglang_importable_in_a_fresh_process():
    r = _run(
        "from mg_server.launch import compat\n"
        "rep = compat.install('cpu')\n"
        "import sglang.srt.entrypoints.http_server\n"
        "import sgl_kernel.kvcacheio as kv\n"
        "try:\n"
        "    kv.transfer_kv_all_layer()\n"
        "    print('NO-RAISE')\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', 'import stand-in' in str(e))\n"
        "import os; print('OMP', os.environ['OMP_NUM_THREADS'], os.environ['MG_COMPAT'])\n"
        "print('REPORT', rep.summary())\n"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RAISED True" in r.stdout
    assert "OMP 1 cpu" in r.stdout


def test_without_fix_sglang_import_fails():
    # proves the fixes are needed (if this starts passing, compat must report "not needed")
    r = _run("import sglang.srt.entrypoints.http_server")
    assert r.returncode != 0


def test_seams_match_installed_sglang():
    from importlib.metadata import version
    from pathlib import Path

    from mg_server.launch import sglang_facts

    r = _run("from mg_server.launch import compat, sglang_facts\ncompat.install('cpu')\nsglang_facts.check_window()\n"
             "print(sglang_facts.check())")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == version("sglang") and version("sglang") in sglang_facts.TESTED
    # what `make` installs is the default the docs and the image name
    nodeps = (Path(__file__).resolve().parent.parent / "requirements" / "nodeps.txt").read_text()
    assert f"sglang=={sglang_facts.DEFAULT}\n" in nodeps and sglang_facts.DEFAULT in sglang_facts.TESTED


def test_a_held_end_counts_in_sglangs_admission_reserve():
    """rollback.install wraps SGLang's own count of a running request's tokens still to come:
    a held length end reserves what it may still decode, a request mg does not hold is unchanged."""
    r = _run(
        "from mg_server.launch import compat\ncompat.install('cpu')\n"
        "import threading\nfrom types import SimpleNamespace as NS\n"
        "from sglang.srt.managers.schedule_policy import PrefillAdder\n"
        "from mg_server.seam import rollback\nrollback.install()\n"
        "adder = NS(new_token_ratio=0.5)\n"
        "class Req:  # (a Req is weakly referenced by its hold)\n"
        "    def __init__(self, n):\n"
        "        self.sampling_params, self.output_ids = NS(max_new_tokens=4, ignore_eos=True), list(range(n))\n"
        "plain, held = Req(6), Req(6)\n"
        "h = rollback.hold(held, None, threading.Lock())\nh.end = (4, None)\n"
        "f = PrefillAdder._get_running_request_total_token_offset\n"
        "print('OFFSETS', f(adder, plain), f(adder, held), rollback.SURPLUS_MAX)\n"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    plain, held, surplus_max = r.stdout.split("OFFSETS")[1].split()
    assert float(plain) == -2 and float(held) == int(surplus_max) - 2


def test_seams_refuse_an_untested_version_unless_it_is_named():
    r = _run(
        "from mg_server.launch import compat, sglang_facts\ncompat.install('cpu')\n"
        "import sglang; sglang.__version__ = '9.9.9'\n"
        "try:\n    sglang_facts.check()\nexcept sglang_facts.SeamMismatch as e:\n    print('MISMATCH', e)\n"
        "try:\n    sglang_facts.check(allow='9.9.8')\nexcept sglang_facts.SeamMismatch as e:\n    print('OTHER', e)\n"
        "print('ALLOWED', sglang_facts.check(allow='9.9.9'))\n"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    mismatch = r.stdout[r.stdout.index("MISMATCH"):r.stdout.index("OTHER")]
    assert "SGLang 9.9.9 is installed" in mismatch and "0.5.22 to 0.5.23" in mismatch
    assert "--mg-allow-sglang 9.9.9" in mismatch
    assert "OTHER" in r.stdout and "ALLOWED 9.9.9" in r.stdout  # only the version named is let through


def test_seams_name_each_changed_internal():
    """A changed internal is refused with its name, whatever the version (here: the fact that the
    scheduler adds a decode step's tokens with extend, which the window commit's output hold and
    rollback rely on)."""
    r = _run(
        "from mg_server.launch import compat, sglang_facts\ncompat.install('cpu')\n"
        "import inspect\nfrom sglang.srt.managers.scheduler_components import batch_result_processor as b\n"
        "src = inspect.getsource(b).replace('req.output_ids.extend(next_token_id)', 'req.output_ids += next_token_id')\n"
        "inspect.getsource = lambda obj, _real=inspect.getsource: src if obj is b else _real(obj)\n"
        "try:\n    sglang_facts.check()\nexcept sglang_facts.SeamMismatch as e:\n    print('MISMATCH', e)\n"
        "try:\n    sglang_facts.check_window()\nexcept sglang_facts.SeamMismatch as e:\n    print('WINDOW', e)\n"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "batch_result_processor no longer contains 'req.output_ids.extend(next_token_id)'" in r.stdout
    # the window commit's rollback relies on the same fact (its own check, run whenever mg is on)
    assert "WINDOW SGLang seams of the window commit do not match" in r.stdout


def test_sglang_children_are_sglangs_own_entry_points_wrapped():
    # what the launcher passes to launch_server: SGLang's defaults, wrapped, picklable (SGLang spawns them)
    r = _run(
        "from mg_server.launch import compat, shutdown\ncompat.install('cpu')\nimport pickle\n"
        "from sglang.srt.entrypoints.http_server import launch_server\n"
        "from sglang.srt.managers.scheduler import run_scheduler_process as s\n"
        "from sglang.srt.managers.detokenizer_manager import run_detokenizer_process as d\n"
        "kw = {k: pickle.loads(pickle.dumps(v)) for k, v in shutdown.sglang_children(launch_server).items()}\n"
        "print('WRAPPED', sorted(kw), [(f.func is shutdown._sglang_child, f.args) == (True, (e,))"
        " for f, e in ((kw['run_scheduler_process_func'], s), (kw['run_detokenizer_process_func'], d))])\n"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "WRAPPED ['run_detokenizer_process_func', 'run_scheduler_process_func'] [True, True]" in r.stdout


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_an_sglang_child_ignores_a_signal_to_the_group(sig):
    # the wrapped entry signals its own process: ignored, it ends normally (exit code 0)
    import multiprocessing
    import signal
    from functools import partial

    from mg_server.launch import shutdown

    proc = multiprocessing.get_context("spawn").Process(
        target=partial(shutdown._sglang_child, signal.raise_signal), args=(getattr(signal, sig),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0


def test_bare_cuda_profile_patches_sglang_right_after_import():
    # The cuda-bare profile's fixes, checked on this host (they are device-agnostic).
    r = _run(
        "from mg_server.launch import compat\n"
        "compat.fix_torchvision()\n"
        "rep = compat.install('cuda-bare')\n"
        "import os, torch\n"
        "from sglang.kernels.fused_op import get_fused_op_backend\n"
        "from sglang.srt.layers.layernorm import RMSNorm\n"
        "from sglang.srt.mem_cache import memory_pool as mpool\n"
        "n = RMSNorm(8)\n"
        "print('NATIVE', torch.equal(n(torch.ones(2, 8)), n.forward_native(torch.ones(2, 8))),"
        " get_fused_op_backend().value)\n"
        "print('STORE', mpool.can_use_store_cache(64, 64))\n"
        "from sglang.srt.layers.dual_gemm import DualGemm\n"
        "print('DUAL', DualGemm._select_mode(None, None, 576))\n"
        "from sglang.srt.layers.attention import triton_backend as tb\n"
        "print('PDL', tb.is_arch_support_pdl())\n"
        "import flashinfer.sampling as fs; print('FI', getattr(fs, 'MG_STANDIN', False))\n"
        "print('ENV', os.environ['SGLANG_IS_FLASHINFER_AVAILABLE'], os.environ['MG_COMPAT'],"
        " os.environ['SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND'])\n"
        "print(rep.summary())\n"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for line in ("NATIVE True torch", "STORE False", "DUAL None", "PDL False", "FI True", "ENV false cuda-bare python"):
        assert line in r.stdout, r.stdout


def _cfg(*extra, profile="cpu") -> ServeConfig:
    return ServeConfig(model_path="/m", host="127.0.0.1", port=1, profile=profile, metrics_dir="/tmp/x",
                       sglang_args=tuple(extra))


def test_argv_user_flags_override_engine_defaults_and_hook_is_attached():
    from mg_server.launch.launcher import sglang_argv

    argv = sglang_argv(_cfg("--max-total-tokens", "1024"))
    assert argv.index("--max-total-tokens", argv.index("--cuda-graph-backend-decode")) > 0
    assert argv[-3] == "--enable-custom-logit-processor"
    spec = json.loads(argv[-1])
    assert spec[0]["hook_factory"] == "mg_server.seam.hook:make_hook"


def test_argv_per_host_profile():
    from mg_server.launch.launcher import sglang_argv

    bare = sglang_argv(_cfg(profile="cuda-bare"))
    assert "triton" in bare and "--disable-prefill-cuda-graph" in bare
    full = sglang_argv(_cfg(profile="cuda"))
    # a normal GPU install keeps every SGLang default: CUDA graphs and the overlap scheduler on
    for flag in ("--disable-cuda-graph", "--cuda-graph-backend-decode", "--disable-overlap-schedule"):
        assert flag not in full and flag not in bare
    assert "--disable-overlap-schedule" not in sglang_argv(_cfg())  # the CPU runs the overlap scheduler too
    assert "--attention-backend" not in full and "--device" not in full


def test_fp32_logits_only_with_mg_on_a_cuda_host_whose_sglang_has_them_free():
    """The fast path's fp32 logits: the installed SGLang's fp32 LM head is its bf16 GEMM with an
    fp32 output (a source fact), and the flag goes to CUDA servers with mg on, never to mode off
    (plain SGLang stays plain) or a CPU host; an SGLang without the free path keeps bf16."""
    r = _run(
        "from mg_server.launch import compat\ncompat.install('cpu')\nfrom unittest import mock\n"
        "from mg_server.config import ServeConfig\nfrom mg_server.launch import launcher, sglang_facts\n"
        "print('FREE', sglang_facts.fp32_logits_in_place())\n"
        "def cfg(profile, mode): return ServeConfig(model_path='/m', host='h', port=1, profile=profile, "
        "metrics_dir='/x', mg_mode=mode)\n"
        "for p, m in (('cuda', 'margin'), ('cuda-bare', 'always'), ('cuda', 'off'), ('cpu', 'margin')):\n"
        "    print('WANT', p, m, launcher.wants_fp32_logits(cfg(p, m)))\n"
        "with mock.patch.object(sglang_facts, 'fp32_logits_in_place', return_value=False):\n"
        "    print('UNFREE', launcher.wants_fp32_logits(cfg('cuda', 'margin')))\n"
        "from sglang.srt.layers.logits_processor import LogitsProcessor\n"
        "def upcast(self, hidden_states, lm_head, embedding_bias=None, *, out=None):\n"
        "    return hidden_states.float() @ lm_head.weight.float().T\n"
        "with mock.patch.object(LogitsProcessor, '_compute_lm_head', upcast):\n"
        "    print('UPCAST', sglang_facts.fp32_logits_in_place())\n"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for line in ("FREE True", "WANT cuda margin True", "WANT cuda-bare always True", "WANT cuda off False",
                 "WANT cpu margin False", "UNFREE False", "UPCAST False"):
        assert line in r.stdout, r.stdout


def test_fp32_logits_flag_is_added_once_before_the_users_flags():
    from mg_server.config import FP32_LOGITS_ARGS
    from mg_server.launch.launcher import sglang_argv

    cfg = _cfg("--max-total-tokens", "1024", profile="cuda")
    assert FP32_LOGITS_ARGS[0] not in sglang_argv(cfg)
    argv = sglang_argv(cfg, fp32_logits=True)
    assert argv.count(FP32_LOGITS_ARGS[0]) == 1 and argv.index(FP32_LOGITS_ARGS[0]) < argv.index("--max-total-tokens")


@pytest.mark.parametrize("profile", ["cpu", "cuda-bare", "cuda"])
def test_every_profiles_flags_are_the_installed_sglangs(profile):
    """mg's engine flags for each host profile parse with the installed SGLang's own parser (a
    flag SGLang renamed would otherwise stop a server on that host only)."""
    r = _run(
        "from mg_server.launch import compat\ncompat.install('cpu')\nimport argparse, json\n"
        "from mg_server.config import ServeConfig\nfrom mg_server.launch.launcher import sglang_argv\n"
        "from sglang.srt.server_args import ServerArgs\n"
        "p = argparse.ArgumentParser(exit_on_error=False)\nServerArgs.add_cli_args(p)\n"
        f"cfg = ServeConfig(model_path='/m', host='h', port=1, profile={profile!r}, metrics_dir='/x')\n"
        f"ns, unknown = p.parse_known_args(sglang_argv(cfg, fp32_logits={profile != 'cpu'}))\n"
        "print('UNKNOWN', json.dumps(unknown))\n"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "UNKNOWN []" in r.stdout, r.stdout


def test_a_cpu_scheduler_sleeps_when_idle():
    # without it an idle CPU server's scheduler spins a whole core in its socket polls
    from mg_server.launch.launcher import sglang_argv

    assert "--sleep-on-idle" in sglang_argv(_cfg())
    assert "--sleep-on-idle" not in sglang_argv(_cfg(profile="cuda"))


def test_cpu_has_no_grammar_backend_and_refuses_xgrammar():
    # xgrammar's token masks are GPU kernels: on a CPU its first grammar request stopped the server
    from mg_server.launch.launcher import refuse_on_host, sglang_argv

    argv = sglang_argv(_cfg())
    assert argv[argv.index("--grammar-backend") + 1] == "none"
    assert "--grammar-backend" not in sglang_argv(_cfg(profile="cuda"))
    with pytest.raises(ValueError, match="xgrammar"):
        refuse_on_host(SimpleNamespace(grammar_backend="xgrammar"), "cpu")
    refuse_on_host(SimpleNamespace(grammar_backend="none"), "cpu")
    refuse_on_host(SimpleNamespace(grammar_backend="xgrammar"), "cuda")


@pytest.mark.parametrize("flag", ["--forward-hooks", "--enable-custom-logit-processor"])
def test_argv_refuses_owned_flags(flag):
    from mg_server.launch.launcher import sglang_argv

    with pytest.raises(ValueError, match="set by mg-server"):
        sglang_argv(_cfg(flag, "[]"))


def _args(**over):
    base = dict(speculative_algorithm=None, tp_size=1, pp_size=1, dp_size=1, attn_dp_size=None, attn_cp_size=None,
                dcp_size=None, enable_dp_attention=False, kv_cache_dtype="auto", dtype="auto",
                enable_hierarchical_cache=False, startup_weight_load_mode="serial", enable_memory_saver=False,
                weight_cache_mode="off", cpu_offload_gb=0, quantization=None, enable_lora=False, lora_paths=None)
    return SimpleNamespace(**{**base, **over})


@pytest.mark.parametrize("over,needle", [
    (dict(speculative_algorithm="EAGLE"), "speculative"),
    (dict(tp_size=2), "--tp 2 on a GPU"),
    (dict(attn_dp_size=2), "parallelism"),
    (dict(dcp_size=2), "parallelism"),
    (dict(kv_cache_dtype="fp8_e4m3"), "kv-cache-dtype"),
    (dict(dtype="float16"), "--dtype"),
    (dict(enable_hierarchical_cache=True), "hierarchical"),
    (dict(enable_memory_saver=True), "memory-saver"),
    (dict(cpu_offload_gb=4), "cpu-offload"),
    (dict(quantization="fp8"), "quantization"),
    (dict(lora_paths=["a"]), "lora"),
    (dict(weight_cache_mode="host"), "weight-cache"),
])
def test_unsupported_configurations_are_refused_unless_mg_is_off(over, needle):
    from mg_server.launch.launcher import refuse_unsupported

    refuse_unsupported(_args(), "margin")  # the defaults pass
    with pytest.raises(ValueError, match=needle):
        refuse_unsupported(_args(**over), "margin")
    refuse_unsupported(_args(**over), "off")
    if over == dict(tp_size=2):  # tensor parallelism: on a CPU (seam/ranks.py, verifier/ranks.py)
        refuse_unsupported(_args(**over), "margin", cpu=True)
    else:
        with pytest.raises(ValueError, match=needle):
            refuse_unsupported(_args(**over), "margin", cpu=True)


@pytest.mark.parametrize("config_dtype,flag,ok", [
    ("bfloat16", "auto", True), ("float32", "auto", False), ("float16", "auto", False),
    ("float32", "bfloat16", True), (None, "auto", False),
])
def test_the_served_dtype_must_be_the_verifiers(tmp_path, config_dtype, flag, ok):
    # SGLang's --dtype auto follows the model's config (float32 -> float16); the
    # verifier runs bfloat16, so such a start is refused instead of casting K/V columns silently
    import json

    from mg_server.launch import compat

    compat.install("cpu")
    from mg_server.launch.launcher import refuse_dtype_mismatch

    from mg_server.checkpoint import read_checkpoint

    conf = {"model_type": "llama", **({"dtype": config_dtype} if config_dtype else {})}
    (tmp_path / "config.json").write_text(json.dumps(conf))
    model = read_checkpoint(tmp_path, identify=False)
    args = SimpleNamespace(model_path=str(tmp_path), dtype=flag)
    refuse_dtype_mismatch(args, "off", model)
    refuse_dtype_mismatch(args, "margin", None)  # no local checkpoint: the seam checks the runner's pool
    if ok:
        refuse_dtype_mismatch(args, "margin", model)
    else:
        with pytest.raises(ValueError, match="--dtype bfloat16"):
            refuse_dtype_mismatch(args, "margin", model)


def test_the_seam_refuses_a_kv_pool_of_another_dtype():
    import torch

    from mg_server.launch import compat

    compat.install("cpu")
    from mg_server.seam.hook import check_dtype

    runner = SimpleNamespace(token_to_kv_pool=SimpleNamespace(k_buffer=[torch.zeros(1, dtype=torch.float16)]))
    with pytest.raises(RuntimeError, match="float16"):
        check_dtype(runner, "bfloat16")
    check_dtype(SimpleNamespace(token_to_kv_pool=SimpleNamespace(k_buffer=[torch.zeros(1, dtype=torch.bfloat16)])),
                "bfloat16")
