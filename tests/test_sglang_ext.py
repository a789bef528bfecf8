"""SGLang integration pieces that need no running server."""

import json
import subprocess
import sys

import pytest

from mg_server.config import ServeConfig


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_cpu_compat_makes_sglang_importable_in_a_fresh_process():
    r = _run(
        "from mg_server.sglang_ext import cpu_compat\n"
        "rep = cpu_compat.install()\n"
        "import sglang.srt.entrypoints.http_server\n"
        "import sgl_kernel.kvcacheio as kv\n"
        "try:\n"
        "    kv.transfer_kv_all_layer()\n"
        "    print('NO-RAISE')\n"
        "except RuntimeError as e:\n"
        "    print('RAISED', 'CPU stand-in' in str(e))\n"
        "import os; print('OMP', os.environ['OMP_NUM_THREADS'], os.environ['MG_CPU_COMPAT'])\n"
        "print('REPORT', rep.summary())\n"
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RAISED True" in r.stdout
    assert "OMP 1 1" in r.stdout


def test_without_fix_sglang_import_fails():
    # proves the fixes are needed (if this starts passing, cpu_compat must report "not needed")
    r = _run("import sglang.srt.entrypoints.http_server")
    assert r.returncode != 0


def test_seams_match_installed_sglang():
    r = _run("from mg_server.sglang_ext import cpu_compat, seams\ncpu_compat.install()\nprint(seams.check())")
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("0.5.10.post1")


def test_seams_refuse_other_version():
    r = _run(
        "from mg_server.sglang_ext import cpu_compat, seams\ncpu_compat.install()\n"
        "import sglang; sglang.__version__ = '9.9.9'\n"
        "try:\n    seams.check()\nexcept seams.SeamMismatch as e:\n    print('MISMATCH', e)\n"
    )
    assert "MISMATCH" in r.stdout and "9.9.9" in r.stdout


def _cfg(*extra) -> ServeConfig:
    return ServeConfig(model_path="/m", host="127.0.0.1", port=1, cpu=True, metrics_dir="/tmp/x", sglang_args=tuple(extra))


def test_argv_user_flags_override_cpu_defaults_and_hook_is_attached():
    from mg_server.sglang_ext.launch import sglang_argv

    argv = sglang_argv(_cfg("--max-total-tokens", "1024"))
    assert argv.index("--max-total-tokens", argv.index("--disable-overlap-schedule")) > 0
    assert argv[-3] == "--enable-custom-logit-processor"
    spec = json.loads(argv[-1])
    assert spec[0]["target_modules"] == ["logits_processor"]
    assert spec[0]["hook_factory"] == "mg_server.sglang_ext.hook:make_hook"


@pytest.mark.parametrize("flag", ["--forward-hooks", "--enable-custom-logit-processor"])
def test_argv_refuses_owned_flags(flag):
    from mg_server.sglang_ext.launch import sglang_argv

    with pytest.raises(ValueError, match="set by mg-server"):
        sglang_argv(_cfg(flag, "[]"))
