"""The verifier worker over its process boundary (tiny random model): handshake, shared slots,
batching, typed errors, and that the worker keeps serving after every bad request."""

from __future__ import annotations

import time
import uuid

import pytest
import torch
import zmq

from verifier_helpers import make_tiny, served_worker

from mg_server.verifier.client import VerifierClient, VerifierError
from mg_server.verifier.server import VerifierConfig, start_verifier
from mg_server.wire import protocol as P

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    d, _ = make_tiny("llama", tmp_path_factory.mktemp("tiny"), dtype=torch.bfloat16)
    ipc = f"/tmp/mgv-test-{uuid.uuid4().hex[:8]}.sock"
    cfg = VerifierConfig(model_path=str(d), ipc_path=ipc, max_seq_len=64, max_requests=4, pool_tokens=256,
                         max_batch_items=5, num_threads=1)
    for client, info in served_worker(cfg):
        yield cfg, client, info


def alive(client: VerifierClient) -> None:
    r = client.verify(f"alive-{uuid.uuid4().hex[:6]}", len(PROMPT) - 1, PROMPT)
    client.release([r.rid])


def test_hello_reports_identity(worker):
    from mg_server.verifier.kernels import kernel_config_id
    from mg_server.checkpoint import read_checkpoint

    cfg, _, info = worker
    assert info.protocol_version == P.PROTOCOL_VERSION
    assert info.model_id == read_checkpoint(cfg.model_path).identity
    assert info.kernel_config_id == kernel_config_id("cpu")
    assert (info.family, info.n_layers, info.n_kv_heads, info.head_dim) == ("llama", 2, 2, 16)
    assert info.pool_tokens == 256 and info.ready and not info.shared_weights  # a CPU worker loads its own copy


def test_verify_roundtrip_and_rewind(worker):
    _, c, _ = worker
    r = c.verify("a", len(PROMPT) - 1, PROMPT, want_digest=True)
    assert len(r.audit_tokens) == len(PROMPT) - 1 and len(r.digest) == 16
    r2 = c.verify("a", len(PROMPT), [r.token])
    assert r2.first_mismatch == -1 and r2.audit_tokens == []
    # rewind to the first step: the same answer
    r3 = c.verify("a", len(PROMPT) - 1, PROMPT[-3:], rewind=True, want_digest=True)
    assert (r3.token, r3.margin, r3.digest) == (r.token, r.margin, r.digest)
    assert c.release(["a"]) == 1 and c.release(["a"]) == 0


def test_batched_message_equals_separate_calls(worker):
    _, c, _ = worker
    prompts = {f"b{i}": [(7 * i + j) % 200 for j in range(5 + 3 * i)] for i in range(3)}
    alone = {}
    for rid, p in prompts.items():
        alone[rid] = c.verify(rid, len(p) - 1, p, want_digest=True)
    c.release(list(prompts))
    items = [P.VerifyItem(rid=rid, pos=len(p) - 1, tokens=p, want_digest=True) for rid, p in prompts.items()]
    res = c.verify_many(items)
    for r in res:
        a = alone[r.rid]
        assert r.batch_requests == 3 and r.batch_rows == sum(len(p) for p in prompts.values())
        assert (r.token, r.margin, r.digest, r.audit_tokens, r.audit_margins) == (
            a.token, a.margin, a.digest, a.audit_tokens, a.audit_margins)
    c.release(list(prompts))


def test_same_rid_twice_in_one_message_is_sequential(worker):
    _, c, _ = worker
    first = c.verify("s", len(PROMPT) - 1, PROMPT)
    c.release(["s"])
    res = c.verify_many([P.VerifyItem(rid="s", pos=len(PROMPT) - 1, tokens=PROMPT),
                         P.VerifyItem(rid="s", pos=len(PROMPT), tokens=[first.token])])
    assert res[0].token == first.token and res[1].pos == len(PROMPT)
    c.release(["s"])


@pytest.mark.parametrize("case", ["unknown", "position", "too_long", "bad_token", "empty", "capacity"])
def test_bad_requests_get_typed_errors_and_worker_survives(worker, case):
    _, c, _ = worker
    if case == "unknown":
        with pytest.raises(VerifierError) as e:
            c.verify("nobody", 10, [1, 2])
        assert e.value.code == P.ErrorCode.UNKNOWN_REQUEST
    elif case == "position":
        c.verify("p", len(PROMPT) - 1, PROMPT)
        with pytest.raises(VerifierError) as e:
            c.verify("p", len(PROMPT) + 3, [1])  # caller thinks 3 more tokens were seen
        assert e.value.code == P.ErrorCode.POSITION_MISMATCH and e.value.expected_pos == len(PROMPT)
        with pytest.raises(VerifierError) as e:
            c.verify("p", 2, [1, 2, 3])  # a restart without rewind
        assert e.value.code == P.ErrorCode.POSITION_MISMATCH
        c.verify("p", len(PROMPT), [1])  # the request itself is intact
        c.release(["p"])
    elif case == "too_long":
        with pytest.raises(VerifierError) as e:
            c.verify("long", 99, list(range(100)))
        assert e.value.code == P.ErrorCode.TOO_LONG
    elif case == "bad_token":
        with pytest.raises(VerifierError) as e:
            c.verify("tok", 1, [5, 10**6])
        assert e.value.code == P.ErrorCode.BAD_REQUEST
    elif case == "empty":
        with pytest.raises(VerifierError) as e:
            c.verify("e", 0, [])
        assert e.value.code == P.ErrorCode.BAD_REQUEST
    elif case == "capacity":
        rids = [f"cap{i}" for i in range(4)]
        res = c.verify_many([P.VerifyItem(rid=r, pos=1, tokens=[1, 2]) for r in rids + ["cap-x"]])
        assert [type(r).__name__ for r in res] == ["VerifyResult"] * 4 + ["ErrorReply"], res
        assert res[-1].code == P.ErrorCode.NO_CAPACITY
        assert c.release(rids) == 4
    alive(c)
    assert c.stats().requests == 0


def test_malformed_bytes_and_wrong_protocol(worker):
    cfg, c, _ = worker
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(cfg.endpoint)
    try:
        s.send(b"\xc1 not msgpack")
        assert s.poll(10000)
        reply = P.decode(s.recv())
        assert isinstance(reply, P.Error) and reply.error.code == P.ErrorCode.BAD_REQUEST
        s.send(P.encode(P.Hello(msg_id=5, protocol_version=P.PROTOCOL_VERSION + 1)))
        assert s.poll(10000)
        reply = P.decode(s.recv())
        assert reply.msg_id == 5 and reply.error.code == P.ErrorCode.PROTOCOL_MISMATCH
    finally:
        s.close(0)
    alive(c)


def test_model_mismatch_at_hello(worker):
    cfg, _, info = worker
    with VerifierClient(cfg.ipc_path, timeout_s=30) as c:
        with pytest.raises(VerifierError) as e:
            c.connect(expect_model_id="0" * 24)
        assert e.value.code == P.ErrorCode.MODEL_MISMATCH
        with pytest.raises(VerifierError) as e:
            c.connect(expect_kernel_config_id="cpu-000000000000")
        assert e.value.code == P.ErrorCode.MODEL_MISMATCH
        assert c.connect(expect_model_id=info.model_id, expect_kernel_config_id=info.kernel_config_id)
        c.verify("relay", 1, [1, 2])
        c.release(["relay"])


def test_deadline_and_items_per_message(worker):
    _, c, _ = worker
    res = c.verify_many([P.VerifyItem(rid="late", pos=1, tokens=[1, 2], deadline_ns=time.time_ns() - 1)])
    assert res[0].code == P.ErrorCode.DEADLINE
    with pytest.raises(VerifierError) as e:  # more items than one message may carry
        c.verify_many([P.VerifyItem(rid=f"m{i}", pos=0, tokens=[1]) for i in range(6)])
    assert e.value.code == P.ErrorCode.BAD_REQUEST


def test_client_timeout_without_worker(tmp_path):
    with VerifierClient(str(tmp_path / "nobody.sock"), timeout_s=0.3) as c:
        t0 = time.monotonic()
        with pytest.raises(VerifierError) as e:
            c.connect()
        assert e.value.code == P.ErrorCode.TIMEOUT and time.monotonic() - t0 < 5


def test_worker_with_unloadable_model_answers_errors(tmp_path):
    ipc = str(tmp_path / "bad.sock")
    proc = start_verifier(VerifierConfig(model_path=str(tmp_path / "missing"), ipc_path=ipc))
    with VerifierClient(ipc, timeout_s=60) as c:
        with pytest.raises(VerifierError) as e:
            c.connect()
        assert e.value.code == P.ErrorCode.LOAD_FAILED and "failed to load" in str(e.value)
        c.shutdown()
    proc.join(20)
    assert proc.exitcode == 0


@pytest.mark.gpu
def test_cuda_workers_on_shared_weights_match_the_in_process_reference(tmp_path):
    """Two CUDA worker processes computing on weights another process holds (shared over CUDA IPC
    as mg's seam shares SGLang's): tokens, margins and logits digests equal (bitwise) the
    in-process engine's on its own copy of the checkpoint."""
    import hashlib

    from verifier_helpers import drive, smollm2_shaped

    from mg_server.seam.export import export_tensors
    from mg_server.verifier.engine import VerifierEngine
    from mg_server.checkpoint import read_checkpoint
    from mg_server.verifier.model import VerifierModel, fused_checkpoint

    d = smollm2_shaped(tmp_path / "m")
    prompt = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    n_gen = 16
    engine = VerifierEngine(VerifierModel.load(d, torch.bfloat16, "cuda", 128), 2, 256, 128)
    ref, seq = drive(engine, "r", prompt, list(range(len(prompt) - 1, len(prompt) + n_gen - 1)))
    del engine
    from safetensors.torch import load_file

    spec = read_checkpoint(d).spec
    held = {k: v.cuda() for k, v in fused_checkpoint(load_file(str(d / "model.safetensors")), spec).items()}
    for k in range(2):
        run = tmp_path / f"run{k}"
        run.mkdir()
        export_tensors(held, str(run))
        ipc = str(run / "verifier.sock")
        proc = start_verifier(VerifierConfig(model_path=str(d), ipc_path=ipc, device="cuda", max_seq_len=128,
                                             pool_tokens=4096))
        with VerifierClient(ipc, timeout_s=300) as c:
            try:
                first = c.connect()
                assert first.shared_weights and not first.ready and first.pool_tokens == 4096
                assert c.connect().ready  # the second hello: once it computes on the shared weights
                s = list(prompt)
                for i in range(n_gen):
                    p = len(s) - 1
                    r = c.verify("r", p, s if i == 0 else s[-1:], want_digest=True)
                    assert (r.token, r.margin) == ref.pred[p]
                    want = hashlib.blake2b(ref.logits[p].numpy().tobytes(), digest_size=16).digest()
                    assert r.digest == want
                    s.append(r.token)
                assert s == seq
            finally:
                c.shutdown()
        proc.join(60)
        assert proc.exitcode == 0
