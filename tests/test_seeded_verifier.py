"""Seeded sampling in the verifier (CPU, tiny model): the verifier-alone sampled reference does
not depend on its batch, differs per seed, and the catch-up audit judges emitted tokens by the
request's own rule. Plus system_fingerprint: stable for the same files and kernels, changed by
a weight's content or the kernel configuration."""

from __future__ import annotations

import shutil

import pytest
import torch

from verifier_helpers import make_tiny

from mg_server.verifier.engine import VerifierEngine
from mg_server.verifier.model import VerifierModel
from mg_server.verifier.reference import greedy_reference
from mg_server.checkpoint import read_checkpoint
from mg_server.wire.fingerprint import system_fingerprint
from mg_server.wire.protocol import VerifyItem

T = 0.8


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    make_tiny("llama", d, dtype=torch.bfloat16, seed=3)
    model = VerifierModel.load(d, torch.bfloat16, "cpu", max_positions=128)
    engine = VerifierEngine(model, max_requests=16, pool_tokens=4096, max_seq_len=128)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.spec.vocab, (5 + 3 * i,), generator=g).tolist() for i in range(4)]
    return d, engine, prompts


def test_sampled_reference_is_batch_invariant_and_seed_dependent(setup):
    _, engine, prompts = setup
    alone = greedy_reference(engine, prompts[:1], 24, temperature=T, seeds=[5])[0]
    mixed = greedy_reference(engine, prompts, 24, temperature=T, seeds=[5, 9, 9, 1])
    assert mixed[0].tokens == alone.tokens and mixed[0].margins == alone.margins
    other_seed = greedy_reference(engine, prompts[:1], 24, temperature=T, seeds=[6])[0]
    greedy = greedy_reference(engine, prompts[:1], 24)[0]
    assert other_seed.tokens != alone.tokens and greedy.tokens != alone.tokens
    assert all(m >= 0 for m in alone.margins)
    with pytest.raises(ValueError):
        greedy_reference(engine, prompts[:2], 4, temperature=T, seeds=[1])


def test_catch_up_audits_with_the_requests_rule(setup):
    _, engine, prompts = setup
    p = prompts[1]
    ref = greedy_reference(engine, [p], 16, temperature=T, seeds=[42])[0]
    seq = p + ref.tokens
    last = len(seq) - 2  # one catch-up item over the whole answer: positions 0 .. last
    (out,) = engine.step([VerifyItem(rid="s", pos=last, tokens=seq[:last + 1], prompt_len=len(p),
                                     temperature=T, seed=42)])
    assert out.first_mismatch == -1 and out.token == seq[-1]
    assert out.audit_tokens[len(p) - 1:] == ref.tokens[:-1]
    engine.release("s")
    # the same tokens judged greedily, or with another seed: the audit finds the sampled choices
    for kw in ({}, {"temperature": T, "seed": 43}):
        (out,) = engine.step([VerifyItem(rid="g", pos=last, tokens=seq[:last + 1], prompt_len=len(p), **kw)])
        assert out.first_mismatch >= len(p) - 1
        engine.release("g")


def test_system_fingerprint_is_stable_and_names_weights_and_kernels(setup, tmp_path, monkeypatch):
    from mg_server.verifier.kernels import config as kc

    def identity(folder):
        return read_checkpoint(folder).identity

    d = setup[0]
    w = identity(d)
    kid = kc.kernel_config_id("cpu")
    fp = system_fingerprint(w, kid)
    assert fp.startswith("fp_") and fp == system_fingerprint(identity(d), kc.kernel_config_id("cpu"))
    # a weight changed in place (same names, same sizes): another fingerprint
    copy = tmp_path / "copy"
    shutil.copytree(d, copy)
    f = next(copy.glob("*.safetensors"))
    data = bytearray(f.read_bytes())
    data[-1] ^= 1
    f.write_bytes(bytes(data))
    assert identity(copy) != w and system_fingerprint(identity(copy), kid) != fp
    # another kernel configuration: another id, another fingerprint
    monkeypatch.setitem(kc.KERNEL_CONFIG, "cpu", {**kc.KERNEL_CONFIG["cpu"], "max_bits": 23})
    kid2 = kc.kernel_config_id("cpu")
    assert kid2 != kid and system_fingerprint(w, kid2) != fp
    # the same checkpoint in a folder of another name: the same identity
    renamed = tmp_path / "another-name"
    shutil.copytree(d, renamed)
    assert identity(renamed) == w
    assert system_fingerprint("", kid) == ""  # mode off: no verifier, no promise
