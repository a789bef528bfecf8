"""The forward hook's repair primitives on SGLang's real KV pool class (no server)."""

from types import SimpleNamespace

import pytest
import torch


@pytest.fixture(scope="module")
def hook_mod():
    from mg_server.sglang_ext import cpu_compat

    cpu_compat.install()
    from mg_server.sglang_ext import hook

    return hook


@pytest.fixture()
def batch():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    layers, heads, dim = 3, 2, 8
    pool = MHATokenToKVPool(size=64, page_size=1, dtype=torch.bfloat16, head_num=heads, head_dim=dim,
                            layer_num=layers, device="cpu", enable_memory_saver=False)
    req_to_token = torch.zeros(4, 32, dtype=torch.int64)
    req_to_token[0, :10] = torch.arange(10, 20)  # request 0: positions 0..9 in slots 10..19
    req_to_token[1, :10] = torch.arange(10, 20)  # request 1 shares that prefix (radix cache) ...
    req_to_token[1, 10] = 30  # ... and owns slot 30 for its own position 10
    fb = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
                         req_pool_indices=torch.tensor([0, 1]),
                         out_cache_loc=torch.tensor([19, 30]))  # this forward wrote pos 9 of req 0, pos 10 of req 1
    return fb, (layers, heads, dim)


def test_repair_writes_every_layer_of_the_owned_slot(hook_mod, batch):
    fb, (layers, heads, dim) = batch
    col = torch.randn(layers, 2, heads, dim).to(torch.bfloat16)
    before = [b.clone() for b in fb.token_to_kv_pool.k_buffer]
    hook_mod.write_kv_column(fb, 1, 10, col)
    for layer in range(layers):
        assert torch.equal(fb.token_to_kv_pool.k_buffer[layer][30], col[layer, 0])
        assert torch.equal(fb.token_to_kv_pool.v_buffer[layer][30], col[layer, 1])
        changed = (fb.token_to_kv_pool.k_buffer[layer] != before[layer]).any(dim=(1, 2)).nonzero().flatten()
        assert changed.tolist() == [30]  # nothing else touched


def test_repair_refuses_a_slot_this_forward_did_not_allocate(hook_mod, batch):
    fb, (layers, heads, dim) = batch
    col = torch.zeros(layers, 2, heads, dim, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="not written by this forward"):
        hook_mod.write_kv_column(fb, 1, 5, col)  # position 5 lives in a shared prefix slot


def test_repair_refuses_a_column_of_another_shape(hook_mod, batch):
    fb, (layers, heads, dim) = batch
    with pytest.raises(RuntimeError, match="does not fit"):
        hook_mod.write_kv_column(fb, 0, 9, torch.zeros(layers + 1, 2, heads, dim))


def test_force_token_makes_greedy_pick_it(hook_mod):
    logits = torch.randn(3, 50)
    hook_mod.force_token(logits, 1, 7)
    assert logits.argmax(-1)[1] == 7 and torch.isinf(logits[1]).sum() == 49


def test_top2_margin(hook_mod):
    margin, arg = hook_mod.top2(torch.tensor([[1.0, 3.0, 2.5], [0.0, 0.0, -1.0]]))
    assert arg[0] == 1 and margin.tolist() == [0.5, 0.0]
