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


def test_the_hosted_controller_flag_needs_the_verifier_there(monkeypatch, prepared_model, capsys):
    """`--mg-controller-in scheduler` (runtime/controller/inproc.py) reaches the config only with
    the verifier in the scheduler too: the direct path calls the verifier in the caller's thread."""
    from mg_server import cli
    from mg_server.sglang_ext import launch

    seen = []
    monkeypatch.setattr(launch, "serve", seen.append)
    base = ["serve", "--model", str(prepared_model), "--device", "cpu", "--mg-commit", "lag"]
    assert cli.main([*base, "--mg-verifier-in", "scheduler", "--mg-controller-in", "scheduler"]) == 0
    assert seen[0].controller_in == "scheduler"
    # auto (the default): beside the verifier when it is in the scheduler, else its own process
    assert cli.main([*base, "--mg-verifier-in", "scheduler"]) == 0 and seen[1].controller_in == "scheduler"
    assert cli.main([*base, "--mg-verifier-in", "scheduler", "--mg-controller-in", "process"]) == 0
    assert seen[2].controller_in == "process"
    assert cli.main([*base]) == 0 and seen[3].controller_in == "process"
    try:
        rc = cli.main([*base, "--mg-controller-in", "scheduler"])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and "--mg-controller-in scheduler needs --mg-verifier-in scheduler" in capsys.readouterr().err


def test_verify_ahead_needs_the_hosted_controller(monkeypatch, prepared_model, capsys):
    """`--mg-verify-ahead on` (runtime/controller/ahead.py): its calls are direct calls from the
    scheduler process, so the controller must be hosted there, on the lagged seam."""
    from mg_server import cli
    from mg_server.sglang_ext import launch

    seen = []
    monkeypatch.setattr(launch, "serve", seen.append)
    base = ["serve", "--model", str(prepared_model), "--device", "cpu", "--mg-commit", "lag", "--mg-verify-ahead", "on"]
    assert cli.main([*base, "--mg-verifier-in", "scheduler"]) == 0 and seen[0].verify_ahead
    assert cli.main(base[:-2]) == 0 and not seen[1].verify_ahead  # off by default
    for flags in (["--mg-verifier-in", "scheduler", "--mg-controller-in", "process"], [],
                  ["--mg-verifier-in", "scheduler", "--mg-seam", "sync"]):
        try:
            rc = cli.main([*base, *flags])
        except SystemExit as e:
            rc = e.code
        assert rc == 2 and "--mg-verify-ahead on needs the controller" in capsys.readouterr().err, flags


def test_a_direct_verifier_client_answers_as_the_socket_would(tmp_path):
    """DirectVerifierClient (the hosted controller's verifier client) against the socket client of
    the same worker: equal results, field by field, for the same items (CPU, the tiny random model)."""
    import json

    import torch
    from safetensors.torch import save_file

    from mg_server.runtime import protocol as P
    from mg_server.runtime.verifier.bench import SHAPES, random_tensors
    from mg_server.runtime.verifier.client import VerifierClient, VerifierError
    from mg_server.runtime.verifier.server import VerifierConfig
    from mg_server.runtime.verifier.thread import DirectVerifierClient, VerifierThread

    d = tmp_path / "tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(SHAPES["tiny"]))
    save_file({k: v.contiguous() for k, v in random_tensors(SHAPES["tiny"], "cpu", torch.bfloat16).items()},
              str(d / "model.safetensors"))
    workers = []
    for name in ("socket", "direct"):
        cfg = VerifierConfig(model_path=str(d), ipc_path=str(tmp_path / f"{name}.sock"),
                             shm_name=f"mgtest{name}{id(d) % 10000}", device="cpu", num_threads=1,
                             max_seq_len=256, pool_tokens=1024)
        workers.append(VerifierThread(cfg).start(serve_socket=name == "socket"))
    sock = VerifierClient(workers[0].cfg.ipc_path, timeout_s=60)
    direct = DirectVerifierClient(workers[1])
    try:
        assert sock.connect(attach_slots=False).kernel_config_id == direct.connect().kernel_config_id
        items = [P.VerifyItem(rid="a", pos=9, tokens=list(range(3, 13)), prompt_len=4),
                 P.VerifyItem(rid="b", pos=5, tokens=list(range(20, 26)), prompt_len=6)]
        got = [c.verify_many(items) for c in (sock, direct)]
        for a, b in zip(*got):
            assert (a.rid, a.pos, a.token, a.margin, a.audit_tokens, a.first_mismatch) == \
                   (b.rid, b.pos, b.token, b.margin, b.audit_tokens, b.first_mismatch)
        assert direct.last_gen == sock.last_gen > 0
        assert direct.release(["a", "b"]) == sock.release(["a", "b"]) == 2
        try:  # a rejected message raises the client's typed error, as the socket client's does
            direct.verify_many([])
        except VerifierError as e:
            assert e.code == P.ErrorCode.BAD_REQUEST
        else:
            raise AssertionError("an empty Verify was accepted")
    finally:
        sock.close()
        for w in workers:
            w.stop()
