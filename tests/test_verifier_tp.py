"""The verifier's tensor-parallel forward (mg_server/verifier/tp.py) in two CPU processes over
gloo: both ranks return the same logits, a request's logits do not depend on what shares its
forward, and TP-2 is close to (not bit-equal with) TP-1 on the same weights."""

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verifier_helpers import random_checkpoint, served_worker

CFG = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=211,
           max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
A, B = [5, 17, 3, 199, 42, 8, 60], [7, 7, 150, 2, 91]  # two prompts (ids past 105: the second rank's rows)


def _forward(model, spec, pool_spec, requests):
    """One forward of the requests' prompts (each from position 0) -> [R, V] fp32 logits."""
    from mg_server.verifier.model import KVPool, Segment

    pool = KVPool(pool_spec, 64, model.dtype, model.device)
    tokens, positions, slots, segs, row = [], [], [], [], 0
    for k, req in enumerate(requests):
        idx = list(range(20 * k, 20 * k + len(req)))
        segs.append(Segment(row_start=row, n_rows=len(req), q_start=0, kv_indices=torch.tensor(idx)))
        tokens += req
        positions += range(len(req))
        slots += idx
        row += len(req)
    t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return model.forward(t(tokens), t(positions), t(slots), segs, pool)


def _load(ckpt, dtype, rank=None, world=1, pad=1):
    from mg_server.checkpoint import read_checkpoint
    from mg_server.verifier import tp
    from mg_server.verifier.model import VerifierModel, fused_checkpoint
    from safetensors.torch import load_file

    ck = read_checkpoint(ckpt, identify=False)
    spec = ck.require_spec()
    fused = fused_checkpoint(load_file(str(ckpt / "model.safetensors")), spec)
    if rank is None:
        return VerifierModel(spec, fused, dtype, torch.device("cpu"), 64), spec, spec
    ranks = tp.Ranks(rank, world)
    model = VerifierModel(spec, tp.shard(fused, spec, rank, world, pad), dtype, torch.device("cpu"), 64, tp=ranks)
    return model, spec, tp.local_spec(spec, world)


def _rank(rank: int, world: int, ckpt, init: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        model, spec, local = _load(ckpt, torch.bfloat16, rank, world)
        alone = _forward(model, spec, local, [A])
        mixed = _forward(model, spec, local, [B, A])
        padded, _, _ = _load(ckpt, torch.bfloat16, rank, world, pad=64)  # SGLang's padding: 128 rows a rank
        torch.save({"alone": alone, "mixed": mixed, "padded": _forward(padded, spec, local, [A])},
                   f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp")
    ckpt = random_checkpoint(tmp / "ckpt", CFG, seed=3, dtype=torch.bfloat16)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(_rank, args=(2, ckpt, f"file://{tmp}/rendezvous", str(tmp)), nprocs=2, join=True)
    return ckpt, [torch.load(tmp / f"rank{r}.pt") for r in range(2)]


def test_both_ranks_return_the_same_logits(runs):
    _, (r0, r1) = runs
    assert r0["alone"].shape == (len(A), CFG["vocab_size"]) and r0["alone"].dtype == torch.float32
    assert torch.equal(r0["alone"], r1["alone"]) and torch.equal(r0["mixed"], r1["mixed"])


def test_a_requests_logits_do_not_depend_on_its_forwards_other_rows(runs):
    _, (r0, _) = runs
    assert torch.equal(r0["mixed"][len(B):], r0["alone"])


def test_a_shard_padded_as_sglang_pads_it_gives_the_same_logits(runs):
    """Vocabulary shards of 128 rows (211 ids padded to 256, SGLang's multiple of 64) against 106:
    each rank's offset is its shard's row count, the padding columns are cut."""
    _, (r0, r1) = runs
    assert torch.equal(r0["padded"], r0["alone"]) and torch.equal(r1["padded"], r0["alone"])


def test_tp2_is_close_to_tp1_on_the_same_weights(runs):
    """Not bit-equal: each projection's reduction is split over the ranks' shards (docs say so)."""
    ckpt, (r0, _) = runs
    model, spec, local = _load(ckpt, torch.bfloat16)
    one = _forward(model, spec, local, [A])
    assert torch.allclose(one, r0["alone"], atol=0.05 * float(one.abs().max()), rtol=0)
    assert torch.equal(one.argmax(-1), r0["alone"].argmax(-1))


def test_shapes_that_do_not_split_are_refused():
    from mg_server.checkpoint import ModelSpec
    from mg_server.verifier import tp

    spec = ModelSpec.from_hf_config(dict(CFG, num_key_value_heads=1, num_attention_heads=4))
    with pytest.raises(ValueError, match="split evenly"):
        tp.local_heads(spec, 2)


@pytest.fixture(scope="module")
def tp_worker(runs):
    """A served TP-2 verifier (rank 0 the worker, rank 1 its follower) on the runs' checkpoint."""
    import uuid

    from mg_server.verifier.server import VerifierConfig
    from mg_server.wire.liveness import beat_path

    ckpt, _ = runs
    ipc = f"/tmp/mgv-tp-{uuid.uuid4().hex[:8]}.sock"
    cfg = VerifierConfig(model_path=str(ckpt), ipc_path=ipc, max_seq_len=64, max_requests=3, pool_tokens=64,
                         num_threads=1, tp=2)
    yield from served_worker(cfg, timeout_s=120, extra_files=(beat_path(ipc + ".rank1"),))


def test_a_served_tp2_verifier_answers_with_the_tp2_forward(runs, tp_worker):
    """Rank 0's answer is the TP-2 model's (argmax and margin of its last row), alone or beside
    another request, and its kernel id names the degree."""
    _, (r0, _) = runs
    client, info = tp_worker
    assert info.kernel_config_id.endswith("-tp2")
    row = r0["alone"][-1]
    top = torch.topk(row, 2).values
    alone = client.verify("a", len(A) - 1, A)
    assert alone.token == int(row.argmax()) and alone.margin == float(top[0] - top[1])
    assert alone.audit_tokens == r0["alone"][:-1].argmax(-1).tolist()
    client.release(["a"])
    from mg_server.wire import protocol as P

    both = client.verify_many([P.VerifyItem(rid="b", pos=len(B) - 1, tokens=B),
                               P.VerifyItem(rid="a", pos=len(A) - 1, tokens=A)])
    assert (both[1].token, both[1].margin, both[1].audit_tokens) == (alone.token, alone.margin, alone.audit_tokens)
    client.release(["a", "b"])


def test_the_followers_release_and_evict_as_rank_0_does(tp_worker):
    """Releases and LRU evictions (a pool of 64 tokens, 3 requests at most) reach the follower in
    the same order: every later call still runs on both ranks (a rank that held other requests
    would refuse an item and leave rank 0 waiting in a collective) and gives the first answers."""
    client, _ = tp_worker
    prompts = {f"p{k}": [(11 * k + j) % 211 for j in range(9 + k)] for k in range(6)}
    first = {rid: client.verify(rid, len(p) - 1, p) for rid, p in prompts.items()}  # evicts as it goes
    client.release(["p1", "p4"])
    for rid, p in reversed(prompts.items()):  # evicted ones come back from position 0
        again = client.verify(rid, len(p) - 1, p, rewind=True)
        assert (again.token, again.margin) == (first[rid].token, first[rid].margin), rid
    client.release(list(prompts))
