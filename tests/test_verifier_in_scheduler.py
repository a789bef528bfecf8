"""`--mg-verifier-in scheduler`: the verifier worker as a thread of SGLang's scheduler process
(runtime/verifier/server.py, "Placement"). The flag's checks here; a real CPU server with it is
tests/test_lag.py's (forced flips corrected by the in-process verifier, every answer `verified`),
the controller's side tests/test_runtime_ipc.py's, and the CUDA server tests/test_gpu_serving.py's.
"""


def test_the_flag_reaches_the_config_and_needs_commit_lag(monkeypatch, prepared_model, capsys):
    from mg_server import cli
    from mg_server.sglang_ext import launch

    seen = []
    monkeypatch.setattr(launch, "serve", seen.append)
    base = ["serve", "--model", str(prepared_model), "--device", "cpu"]
    assert cli.main([*base, "--mg-commit", "lag", "--mg-verifier-in", "scheduler"]) == 0
    assert seen[0].verifier_in == "scheduler"
    assert cli.main(base) == 0 and seen[1].verifier_in == "process"  # the default
    bad = [(["--mg-commit", "hold"], "needs --mg-commit lag"), (["--mg-commit", "resume"], "needs --mg-commit lag"),
           (["--mg-commit", "lag", "--mg-verifier-memory-gb", "4"], "--mg-verifier-memory-gb"),
           (["--mg-commit", "lag", "--mg-ipc-spin-us", "50"], "--mg-ipc-spin-us")]
    for flags, why in bad:
        try:
            rc = cli.main([*base, *flags, "--mg-verifier-in", "scheduler"])
        except SystemExit as e:
            rc = e.code
        assert rc == 2 and why in capsys.readouterr().err, flags
