"""mg's step seam (the Sampler pre-hook) on SGLang's real KV pool class, no server: step
classification by position (prefill chunks, overlap look-ahead, missed steps), token forcing,
K/V column repair, failures."""

import threading
from array import array
from types import SimpleNamespace

import pytest
import torch

from mg_server.config import DETERMINISTIC_PARAM, HookConfig
from mg_server.runtime import protocol as P
from mg_server.runtime.policy import Policy


@pytest.fixture(scope="module")
def hook_mod():
    from mg_server.sglang_ext import compat

    compat.install("cpu")
    from mg_server.sglang_ext import hook

    return hook


LAYERS, HEADS, DIM, VOCAB = 3, 2, 8, 50


@pytest.fixture()
def runner():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(size=64, page_size=1, dtype=torch.bfloat16, head_num=HEADS, head_dim=DIM,
                            layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    req_to_token = torch.zeros(4, 32, dtype=torch.int64)
    req_to_token[0, :20] = torch.arange(10, 30)  # request in pool row 0: position p in slot 10 + p
    return SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=SimpleNamespace(req_to_token=req_to_token))


class FakeReq:
    """The attributes of SGLang's Req that the seam reads (its output list an int64 array)."""

    def __init__(self, rid, prompt, pool_idx=0, **sampling):
        self.rid, self.origin_input_ids, self.kv = rid, list(prompt), SimpleNamespace(req_pool_idx=pool_idx)
        self.output_ids, self.to_finish, self.finished_reason = array("q"), None, None
        self.grammar, self.return_logprob, self.lora_id = None, False, None
        self.sampling_params = SimpleNamespace(**{**dict(frequency_penalty=0.0, presence_penalty=0.0,
                                                         repetition_penalty=1.0, min_new_tokens=0,
                                                         logit_bias=None, custom_params=None, watermark=None,
                                                         beam_width=None), **sampling})

    def finished(self):
        return False


class ScriptedClient:
    """Answers each Step with the decisions `decide(row)` returns; records the rows (and the
    one-way reports of fast commits separately)."""

    def __init__(self, decide):
        self.decide, self.rows, self.reported = decide, [], []

    def step(self, rows):
        self.rows += rows
        return [self.decide(r) for r in rows]

    def report(self, rows):
        self.reported += rows


class Columns:
    def __init__(self):
        self.col = torch.randn(LAYERS, 2, HEADS, DIM).to(torch.bfloat16)

    def read(self, slot, gen, out=None):
        assert (slot, gen) == (5, 9)
        return self.col.clone() if out is None else out.copy_(self.col)


def make_seam(hook_mod, runner, decide, tmp_path, monkeypatch, policy=Policy("always", 0.0)):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    seam = hook_mod.StepSeam(HookConfig(metrics_dir=str(tmp_path)), runner)
    seam.link = SimpleNamespace(client=ScriptedClient(decide), slots=Columns(), tracked={}, lock=threading.Lock(),
                                rpc_lock=threading.Lock(), policy=policy)
    return seam


def entry(processor):
    """A SamplingBatchInfo.custom_logit_processor value (SGLang's ProcessorEntry)."""
    return SimpleNamespace(processor=processor, rows=[], indices=None)


def sampler_args(reqs_flags, logits, positions):
    """The Sampler.forward positional args the seam reads: (logits_output, sampling_info, ..., positions)."""
    from mg_server.sglang_ext.processor import MgFlagProcessor

    params = [({DETERMINISTIC_PARAM: flag, "__req__": req} if flag is not None else None) for req, flag in reqs_flags]
    flagged = any(p is not None for p in params)
    info = SimpleNamespace(has_custom_logit_processor=flagged, custom_params=params,
                           custom_logit_processor={1: entry(MgFlagProcessor())} if flagged else None)
    return (SimpleNamespace(next_token_logits=logits), info, False, [], [], torch.tensor(positions))


def fast(row):
    return P.StepDecision(rid=row.rid, token=row.fast_token)


def test_prefill_chunks_are_skipped_and_steps_follow_positions(hook_mod, runner, tmp_path, monkeypatch):
    seam = make_seam(hook_mod, runner, fast, tmp_path, monkeypatch)
    req = FakeReq("a", [1, 2, 3, 4, 5])
    plain = FakeReq("p", [9])
    logits = torch.randn(2, VOCAB)
    # chunk of a prefill: last position 2 < 4 -> not a step, logits untouched
    before = logits.clone()
    seam(None, sampler_args([(req, True), (plain, None)], logits, [2, 0]))
    assert seam.link.client.rows == [] and torch.equal(logits, before)
    # final chunk: position 4 = the prompt's last -> a step carrying the prompt
    logits = torch.randn(2, VOCAB)
    want = int(logits[0].argmax())
    plain_row = logits[1].clone()
    seam(None, sampler_args([(req, True), (plain, None)], logits, [4, 0]))
    (row,) = seam.link.client.rows
    assert (row.rid, row.pos, row.prompt, row.fast_token) == ("a", 4, [1, 2, 3, 4, 5], want)
    assert int(logits[0].argmax()) == want and torch.isinf(logits[0]).sum() == VOCAB - 1  # forced
    assert torch.equal(logits[1], plain_row)  # a plain row is never touched
    # decode: the next position, no prompt resent; mg's own token list grows
    logits = torch.randn(1, VOCAB)
    seam(None, sampler_args([(req, True)], logits, [5]))
    assert seam.link.client.rows[-1].pos == 5 and seam.link.client.rows[-1].prompt == []
    assert seam.link.tracked["a"].tokens == [1, 2, 3, 4, 5, want, int(logits[0].argmax())]


def test_a_tracked_request_is_not_rebuilt_at_each_step(hook_mod, runner, tmp_path, monkeypatch):
    """mg's state of a request (a copy of its prompt) is made at its first step only: building it
    at every step of every row cost time in proportion to the prompt, on the scheduler's thread."""
    seam = make_seam(hook_mod, runner, fast, tmp_path, monkeypatch)
    made = []
    build = seam.new_tracked
    monkeypatch.setattr(seam, "new_tracked", lambda req: made.append(req.rid) or build(req))
    req = FakeReq("a", [1, 2, 3])
    for pos in range(2, 6):
        seam(None, sampler_args([(req, True)], torch.randn(1, VOCAB), [pos]))
    assert made == ["a"] and len(seam.link.tracked["a"].tokens) == 3 + 4


def test_verified_disagreement_forces_the_verifier_token_and_repairs_the_column(hook_mod, runner, tmp_path,
                                                                               monkeypatch):
    def verify(row):
        return P.StepDecision(rid=row.rid, token=(row.fast_token + 1) % VOCAB, verified=True, repair=True,
                              slot=5, gen=9)

    seam = make_seam(hook_mod, runner, verify, tmp_path, monkeypatch)
    req = FakeReq("b", [7, 8, 9])
    logits = torch.randn(1, VOCAB)
    fast_tok = int(logits[0].argmax())
    pool = runner.token_to_kv_pool
    before = [b.clone() for b in pool.k_buffer]
    seam(None, sampler_args([(req, True)], logits, [2]))
    assert int(logits[0].argmax()) == (fast_tok + 1) % VOCAB
    slot = 10 + 2  # position 2 of pool row 0
    for layer in range(LAYERS):
        assert torch.equal(pool.k_buffer[layer][slot], seam.link.slots.col[layer, 0])
        assert torch.equal(pool.v_buffer[layer][slot], seam.link.slots.col[layer, 1])
        changed = (pool.k_buffer[layer] != before[layer]).any(dim=(1, 2)).nonzero().flatten()
        assert changed.tolist() == [slot]  # nothing else touched
    assert req.to_finish is None


def test_margin_mode_commits_high_margins_locally_and_waits_only_for_low_ones(hook_mod, runner, tmp_path,
                                                                          monkeypatch):
    seam = make_seam(hook_mod, runner, fast, tmp_path, monkeypatch, policy=Policy("margin", 0.5))
    req = FakeReq("m", [1, 2])
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 3] = 5.0, 1.0  # margin 4 >= tau: no round trip
    seam(None, sampler_args([(req, True)], logits, [1]))
    assert seam.link.client.rows == [] and [r.fast_token for r in seam.link.client.reported] == [7]
    assert int(logits[0].argmax()) == 7 and torch.isinf(logits[0]).sum() == VOCAB - 1
    logits = torch.zeros(1, VOCAB)
    logits[0, 9], logits[0, 4] = 1.1, 1.0  # margin 0.1 < tau: the controller decides
    seam(None, sampler_args([(req, True)], logits, [2]))
    assert [r.pos for r in seam.link.client.rows] == [2] and len(seam.link.client.reported) == 1
    assert seam.link.tracked["m"].tokens == [1, 2, 7, 9]


def test_a_skipped_position_fails_the_request(hook_mod, runner, tmp_path, monkeypatch):
    from mg_server.sglang_ext.reasons import INTERNAL_REASON

    seam = make_seam(hook_mod, runner, fast, tmp_path, monkeypatch)
    req = FakeReq("c", [1, 2])
    seam(None, sampler_args([(req, True)], torch.randn(1, VOCAB), [1]))
    seam(None, sampler_args([(req, True)], torch.randn(1, VOCAB), [3]))  # position 2 never sampled
    # the client is told briefly; mg's positions stay in the log
    assert req.to_finish is not None and req.to_finish.message.endswith(INTERNAL_REASON)
    assert "position" not in req.to_finish.message


def test_controller_errors_and_unreachable_controller_fail_the_row(hook_mod, runner, tmp_path, monkeypatch):
    seam = make_seam(hook_mod, runner, lambda r: P.StepDecision(rid=r.rid, error="verifier: [timeout] x"),
                     tmp_path, monkeypatch)
    req = FakeReq("d", [1])
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    seam(None, sampler_args([(req, True)], logits, [0]))
    assert "verifier failed" in req.to_finish.message and torch.equal(logits, before)
    # the abort lands a step later (overlap look-ahead): that forward is ignored, the reason kept
    n_rows = len(seam.link.client.rows)
    seam(None, sampler_args([(req, True)], torch.randn(1, VOCAB), [1]))
    assert len(seam.link.client.rows) == n_rows and "verifier failed" in req.to_finish.message

    def down(row):
        raise TimeoutError("no reply")

    seam.link.client.decide = down
    req2 = FakeReq("e", [1])
    seam(None, sampler_args([(req2, True)], torch.randn(1, VOCAB), [0]))
    assert req2.to_finish.message == "deterministic decoding failed: mg controller unavailable"  # no socket path


@pytest.mark.parametrize("why,req_kw", [
    ("grammar", dict(grammar=object())),
    ("penalties", dict(frequency_penalty=0.5)),
    ("penalties", dict(repetition_penalty=1.2)),
    ("min_new_tokens", dict(min_new_tokens=4)),
    ("logit_bias", dict(logit_bias={"3": 9.0})),
    ("logprobs", dict(return_logprob=True)),
])
def test_what_the_verifier_does_not_model_fails_at_the_first_step(hook_mod, runner, tmp_path, monkeypatch, why,
                                                                     req_kw):
    # however mg's flag got there (the front refuses these with a 400): never a verdict on other tokens
    seam = make_seam(hook_mod, runner, fast, tmp_path, monkeypatch)
    req = FakeReq("u", [1, 2], **{k: v for k, v in req_kw.items() if k not in ("grammar", "return_logprob")})
    req.grammar, req.return_logprob = req_kw.get("grammar"), req_kw.get("return_logprob", False)
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    seam(None, sampler_args([(req, True)], logits, [1]))
    assert seam.link.client.rows == [] and torch.equal(logits, before)
    assert why in req.to_finish.message


def test_off_mode_counts_but_never_edits(hook_mod, runner, tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    seam = hook_mod.StepSeam(HookConfig(metrics_dir=str(tmp_path)), runner)
    assert seam.link is None
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    seam(None, sampler_args([(FakeReq("f", [1, 2, 3]), True)], logits, [2]))
    assert torch.equal(logits, before)


def test_seeded_rows_sample_by_the_shared_rule_and_send_it_with_the_prompt(hook_mod, runner, tmp_path,
                                                                          monkeypatch):
    from mg_server.config import SEED_PARAM, TEMPERATURE_PARAM
    from mg_server.kernels import sampled_choice

    seam = make_seam(hook_mod, runner, fast, tmp_path, monkeypatch)
    req = FakeReq("s", [1, 2, 3], custom_params={DETERMINISTIC_PARAM: True, TEMPERATURE_PARAM: 0.8, SEED_PARAM: 11})
    picked = set()
    for pos in (2, 3, 4, 5):
        logits = torch.zeros(1, VOCAB)  # all tied: greedy would always pick id 0
        tok, margin = sampled_choice(logits[0].clone(), 0.8, 11, pos)
        seam(None, sampler_args([(req, True)], logits, [pos]))
        row = seam.link.client.rows[-1]
        assert (row.fast_token, row.margin) == (tok, margin) and int(logits[0].argmax()) == tok  # forced
        assert (row.temperature, row.seed) == ((0.8, 11) if pos == 2 else (0.0, 0))  # with the prompt only
        picked.add(tok)
    assert len(picked) > 1  # the noise, not the (tied) logits, chose


def test_off_mode_forces_seeded_rows_to_their_fast_sample(hook_mod, runner, tmp_path, monkeypatch):
    from mg_server.config import SEED_PARAM, TEMPERATURE_PARAM
    from mg_server.kernels import sampled_choice

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    seam = hook_mod.StepSeam(HookConfig(metrics_dir=str(tmp_path)), runner)
    seeded = FakeReq("s", [1, 2, 3], custom_params={DETERMINISTIC_PARAM: True, TEMPERATURE_PARAM: 0.8, SEED_PARAM: 3})
    greedy = FakeReq("g", [1, 2, 3])
    logits = torch.randn(2, VOCAB)
    tok, _ = sampled_choice(logits[0].clone(), 0.8, 3, 2)
    untouched = logits[1].clone()
    seam(None, sampler_args([(seeded, True), (greedy, True)], logits, [2, 2]))
    assert int(logits[0].argmax()) == tok and torch.equal(logits[1], untouched)


def test_repair_refuses_a_column_of_another_shape(hook_mod, runner):
    with pytest.raises(RuntimeError, match="does not fit"):
        hook_mod.write_kv_column(runner.token_to_kv_pool, runner.req_to_token_pool.req_to_token, 0, 3,
                                 torch.zeros(LAYERS + 1, 2, HEADS, DIM))


def test_top2_margin(hook_mod):
    margin, arg = hook_mod.top2(torch.tensor([[1.0, 3.0, 2.5], [0.0, 0.0, -1.0]]))
    assert arg[0] == 1 and margin.tolist() == [0.5, 0.0]


def test_factory_refuses_to_attach_without_sglangs_model_runner_in_reach(hook_mod):
    with pytest.raises(RuntimeError, match="model runner in reach"):
        hook_mod.make_hook({"metrics_dir": "/tmp/x"})


def test_the_synchronous_seam_reports_resumable_low_margin_steps_without_waiting(hook_mod, runner, tmp_path,
                                                                                 monkeypatch):
    from mg_server.config import RESUME_PARAM

    seam = make_seam(hook_mod, runner, fast, tmp_path, monkeypatch, policy=Policy("margin", 0.5))
    req = FakeReq("r", [3, 4], custom_params={RESUME_PARAM: True}, stop_strs=None)
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 8] = 1.0, 0.95  # margin 0.05 < tau
    seam(None, sampler_args([(req, True)], logits, [1]))
    assert seam.link.client.rows == [] and [r.resumable for r in seam.link.client.reported] == [True]
    assert int(logits[0].argmax()) == 7 and seam.link.tracked["r"].tokens == [3, 4, 7]


def test_a_diverged_resumable_request_ends_as_if_at_its_length_limit(hook_mod, tmp_path, monkeypatch):
    from mg_server.config import RESUME_PARAM

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    link = object.__new__(hook_mod.ControllerLink)  # no controller: only the bookkeeping is used
    link.lock, link.stopped = threading.Lock(), hook_mod.metrics.resume_stops()
    lazy = FakeReq("a", [1], custom_params={RESUME_PARAM: True}, stop_strs=None)
    lazy.output_ids = array("q", [4, 5, 6])
    held, failed = FakeReq("b", [1]), FakeReq("c", [1], custom_params={RESUME_PARAM: True}, stop_strs=None)
    seam = object.__new__(hook_mod.StepSeam)
    seam.config = hook_mod.HookConfig(metrics_dir=str(tmp_path))
    link.tracked = {"a": seam.new_tracked(lazy), "b": seam.new_tracked(held), "c": seam.new_tracked(failed)}
    link.tracked["c"].failed = True
    link.end_fast_path(["a", "b", "c", "gone"])
    assert type(lazy.to_finish).__name__ == "FINISH_LENGTH" and lazy.to_finish.length == 3
    assert held.to_finish is None and failed.to_finish is None  # not resumable; already failed
