"""The verifier on the real SmolLM2-135M (CPU): invariance, catch-up, batching, processes, Paris.

One reference trajectory (prompt in one chunk, then gap-1 greedy steps) and several other ways
to reach the same positions; everything must be bitwise equal to the reference.
"""

from __future__ import annotations

import threading
import uuid

import pytest
import torch

from verifier_helpers import assert_same, drive, schedule, smollm2_dir

N_GEN = 40  # generated tokens; with the ~37-token chat prompt, a 64-token catch-up fits
QUESTION = "What is the capital of France?"
OTHER_PROMPTS = ["Write a haiku about the sea.", "List three prime numbers.", "Who wrote Hamlet?",
                 "def fib(n):", "Translate 'good morning' to French.", "2 + 2 =", "Name a color.",
                 "The quick brown fox"]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: the 2-core CI machine also runs the worker processes of these tests
    (results do not depend on the thread count; only the wall time does)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model_dir():
    return smollm2_dir()


@pytest.fixture(scope="module")
def tok(model_dir):
    from verifier_helpers import import_transformers

    return import_transformers().AutoTokenizer.from_pretrained(model_dir)


def chat_ids(tok, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                  tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="module")
def engine(model_dir):
    from mg_server.verifier.engine import VerifierEngine
    from mg_server.verifier.model import VerifierModel

    model = VerifierModel.load(model_dir, torch.bfloat16, "cpu", max_positions=512)
    return VerifierEngine(model, max_requests=16, pool_tokens=4096, max_seq_len=512)


@pytest.fixture(scope="module")
def prompt(tok):
    return chat_ids(tok, QUESTION)


@pytest.fixture(scope="module")
def reference(engine, prompt):
    n = len(prompt)
    tr, seq = drive(engine, "ref", prompt, list(range(n - 1, n + N_GEN - 1)))
    assert len(seq) == n + N_GEN
    return tr, seq


def test_says_paris(reference, prompt, tok):
    _, seq = reference
    text = tok.decode(seq[len(prompt):], skip_special_tokens=True)
    assert "Paris" in text, text


@pytest.mark.parametrize("chunks", [[5, 11], [1, 1, 14], [20]], ids=["5+11+rest", "1+1+14+rest", "20+rest"])
def test_prompt_chunking_is_invariant(engine, reference, prompt, chunks):
    ref, seq = reference
    chunks = chunks + [len(prompt) - sum(chunks)]
    got, _ = drive(engine, "chunked", seq, schedule(len(prompt), len(seq), 8, chunks))
    assert_same(ref, got)


@pytest.mark.parametrize("gap", [7, 64])
def test_catch_up_gap_is_invariant(engine, reference, prompt, gap):
    ref, seq = reference
    chunks = [len(prompt)] if gap < 64 else [len(seq) - 1 - 64, len(prompt) - (len(seq) - 1 - 64)]
    if gap == 64:  # one 64-token catch-up that crosses the prompt/generation boundary
        got, _ = drive(engine, "gap", seq, [chunks[0] - 1, len(seq) - 2])
    else:
        got, _ = drive(engine, "gap", seq, schedule(len(prompt), len(seq), gap))
    assert_same(ref, got)
    assert set(got.pred) == set(range(len(seq) - 1)), "the audit covers every caught-up position"


@pytest.mark.parametrize("n_others", [1, 8])
def test_batching_with_other_requests_is_invariant(engine, reference, prompt, tok, n_others):
    ref, seq = reference
    others = [(f"o{i}", chat_ids(tok, OTHER_PROMPTS[i])) for i in range(n_others)]
    gap = 1 if n_others == 1 else 7  # keep CPU time bounded: 8 neighbours on gap-7 catch-ups
    got, _ = drive(engine, "batched", seq, schedule(len(prompt), len(seq), gap), others=others)
    assert_same(ref, got)
    assert max(got.batch_requests) == n_others + 1


def test_two_fresh_processes_agree(model_dir, reference, prompt, tmp_path):
    """Two worker processes, driven concurrently over IPC, reproduce the in-process reference."""
    from mg_server.verifier.client import VerifierClient
    from mg_server.verifier.server import VerifierConfig, start_verifier

    ref, seq = reference
    outs: dict[int, list] = {}

    def run(k: int) -> None:
        ipc = str(tmp_path / f"v{k}-{uuid.uuid4().hex[:6]}.sock")
        cfg = VerifierConfig(model_path=str(model_dir), ipc_path=ipc, max_seq_len=512, pool_tokens=1024,
                             max_requests=4, num_threads=1)
        proc = start_verifier(cfg)
        with VerifierClient(ipc, timeout_s=120) as c:
            try:
                c.connect()
                res = []
                s = list(prompt)
                for i in range(N_GEN):
                    r = c.verify("r", len(s) - 1, s if i == 0 else s[-1:], want_digest=True)
                    res.append((r.token, r.margin, r.digest))
                    s.append(r.token)
                outs[k] = res
            finally:
                c.shutdown()
                proc.join(30)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert set(outs) == {0, 1}
    n = len(prompt)
    for k in range(2):
        for i, (token, margin, digest) in enumerate(outs[k]):
            assert (token, margin) == ref.pred[n - 1 + i]
            assert digest == outs[0][i][2]


def test_close_to_transformers_on_the_real_checkpoint(model_dir, reference, prompt):
    """Loading sanity on real weights (tied embeddings, rope theta): the bf16 verifier tracks
    transformers' fp32 forward of the same checkpoint."""
    from verifier_helpers import import_transformers

    ref, seq = reference
    hf = import_transformers().AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([seq])).logits[0]  # [S, V] fp32
    n = len(prompt)
    gen = range(n - 1, len(seq) - 1)
    agree = sum(int(logits[p].argmax()) == ref.pred[p][0] for p in gen)
    assert agree >= 0.9 * len(gen), agree
    err = max((logits[p] - ref.logits[p]).abs().max().item() for p in gen)
    assert err < 1.5, err
