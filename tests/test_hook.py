"""mg's step seam (the Sampler pre-hook) on SGLang's real KV pool class, no server: step
classification by position (prefill chunks, overlap look-ahead, missed steps), token forcing,
the one-way report of every step, failures."""

import threading
from array import array
from types import SimpleNamespace

import pytest
import torch

from mg_server.config import DETERMINISTIC_PARAM, MARK_PARAM, HookConfig
from mg_server.env import MARK_VAR
from mg_server.policy import Policy

MARK = "the-servers-mark"  # what the front would set (seam/guard.py)


@pytest.fixture(autouse=True)
def marked_server(monkeypatch):
    monkeypatch.setenv(MARK_VAR, MARK)


@pytest.fixture(scope="module")
def hook_mod():
    from mg_server.launch import compat

    compat.install("cpu")
    from mg_server.seam import hook

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
        self.stream = False
        self.grammar, self.return_logprob, self.lora_id = None, False, None
        self.sampling_params = SimpleNamespace(**{**dict(frequency_penalty=0.0, presence_penalty=0.0,
                                                         repetition_penalty=1.0, min_new_tokens=0,
                                                         logit_bias=None, custom_params=None, watermark=None,
                                                         beam_width=None, max_new_tokens=16), **sampling})

    def finished(self):
        return False


class ScriptedClient:
    """Records the one-way step reports; raises `down` instead while it is set (no controller)."""

    def __init__(self):
        self.rows, self.down = [], None

    def report(self, rows):
        if self.down is not None:
            raise self.down
        self.rows += rows


def make_seam(hook_mod, runner, tmp_path, monkeypatch, policy=Policy("always", 0.0), pool_tokens=1024):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    seam = hook_mod.StepSeam(HookConfig(metrics_dir=str(tmp_path)), runner)
    seam.link = SimpleNamespace(client=ScriptedClient(), tracked={}, lock=threading.Lock(), published_tracked=-1,
                                rpc_lock=threading.Lock(), policy=policy,
                                info=SimpleNamespace(verifier_pool_tokens=pool_tokens))
    return seam


def entry(processor):
    """A SamplingBatchInfo.custom_logit_processor value (SGLang's ProcessorEntry)."""
    return SimpleNamespace(processor=processor, rows=[], indices=None)


def sampler_args(reqs_flags, logits, positions, mark=MARK):
    """The Sampler.forward positional args the seam reads: (logits_output, sampling_info, ..., positions)."""
    from mg_server.seam.processor import MgFlagProcessor

    params = [({**(req.sampling_params.custom_params or {}), DETERMINISTIC_PARAM: flag, MARK_PARAM: mark,
                "__req__": req} if flag is not None else None) for req, flag in reqs_flags]
    flagged = any(p is not None for p in params)
    info = SimpleNamespace(has_custom_logit_processor=flagged, custom_params=params,
                           custom_logit_processor={1: entry(MgFlagProcessor())} if flagged else None)
    return (SimpleNamespace(next_token_logits=logits), info, False, [], [], torch.tensor(positions))


def test_prefill_chunks_are_skipped_and_steps_follow_positions(hook_mod, runner, tmp_path, monkeypatch):
    seam = make_seam(hook_mod, runner, tmp_path, monkeypatch)
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
    seam = make_seam(hook_mod, runner, tmp_path, monkeypatch)
    made = []
    build = seam.new_tracked
    monkeypatch.setattr(seam, "new_tracked", lambda req: made.append(req.rid) or build(req))
    req = FakeReq("a", [1, 2, 3])
    for pos in range(2, 6):
        seam(None, sampler_args([(req, True)], torch.randn(1, VOCAB), [pos]))
    assert made == ["a"] and len(seam.link.tracked["a"].tokens) == 3 + 4


def test_every_step_is_committed_fast_and_reported_whatever_its_margin(hook_mod, runner, tmp_path, monkeypatch):
    """The window commit: a low-margin step is committed fast too (checked behind by the
    controller), with its margin and the request's epoch in the report."""
    seam = make_seam(hook_mod, runner, tmp_path, monkeypatch, policy=Policy("margin", 0.5))
    req = FakeReq("m", [1, 2])
    logits = torch.zeros(1, VOCAB)
    logits[0, 7], logits[0, 3] = 5.0, 1.0  # margin 4 >= tau
    seam(None, sampler_args([(req, True)], logits, [1]))
    assert int(logits[0].argmax()) == 7 and torch.isinf(logits[0]).sum() == VOCAB - 1
    logits = torch.zeros(1, VOCAB)
    logits[0, 9], logits[0, 4] = 1.1, 1.0  # margin 0.1 < tau: committed fast as well
    seam(None, sampler_args([(req, True)], logits, [2]))
    rows = seam.link.client.rows
    assert [(r.pos, r.fast_token, r.epoch, r.released) for r in rows] == [(1, 7, 0, False), (2, 9, 0, False)]
    assert [r.margin for r in rows] == pytest.approx([4.0, 0.1])
    assert int(logits[0].argmax()) == 9 and seam.link.tracked["m"].tokens == [1, 2, 7, 9]
    assert seam.link.tracked["m"].hold is not None  # its output is held until checked (rollback.py)


def test_a_skipped_position_fails_the_request(hook_mod, runner, tmp_path, monkeypatch):
    from mg_server.seam.reasons import INTERNAL_REASON

    seam = make_seam(hook_mod, runner, tmp_path, monkeypatch)
    req = FakeReq("c", [1, 2])
    seam(None, sampler_args([(req, True)], torch.randn(1, VOCAB), [1]))
    seam(None, sampler_args([(req, True)], torch.randn(1, VOCAB), [3]))  # position 2 never sampled
    # the client is told briefly; mg's positions stay in the log
    assert req.to_finish is not None and req.to_finish.message.endswith(INTERNAL_REASON)
    assert "position" not in req.to_finish.message


def test_an_unreachable_controller_fails_the_row(hook_mod, runner, tmp_path, monkeypatch):
    seam = make_seam(hook_mod, runner, tmp_path, monkeypatch)
    seam.link.client.down = TimeoutError("no reply")
    req = FakeReq("e", [1])
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    seam(None, sampler_args([(req, True)], logits, [0]))
    assert req.to_finish.message == "deterministic decoding failed: mg controller unavailable"  # no socket path
    assert torch.equal(logits, before)
    # the abort lands a step later (overlap look-ahead): that forward is ignored, the reason kept
    seam.link.client.down = None
    seam(None, sampler_args([(req, True)], torch.randn(1, VOCAB), [1]))
    assert seam.link.client.rows == [] and req.to_finish.message.endswith("mg controller unavailable")


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
    seam = make_seam(hook_mod, runner, tmp_path, monkeypatch)
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
    from mg_server.verifier.sampling import sampled_choice

    seam = make_seam(hook_mod, runner, tmp_path, monkeypatch)
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
    from mg_server.verifier.sampling import sampled_choice

    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    seam = hook_mod.StepSeam(HookConfig(metrics_dir=str(tmp_path)), runner)
    seeded = FakeReq("s", [1, 2, 3], custom_params={DETERMINISTIC_PARAM: True, TEMPERATURE_PARAM: 0.8, SEED_PARAM: 3})
    greedy = FakeReq("g", [1, 2, 3])
    logits = torch.randn(2, VOCAB)
    tok, _ = sampled_choice(logits[0].clone(), 0.8, 3, 2)
    untouched = logits[1].clone()
    seam(None, sampler_args([(seeded, True), (greedy, True)], logits, [2, 2]))
    assert int(logits[0].argmax()) == tok and torch.equal(logits[1], untouched)


def test_top2_margin(hook_mod):
    margin, arg = hook_mod.top2(torch.tensor([[1.0, 3.0, 2.5], [0.0, 0.0, -1.0]]))
    assert arg[0] == 1 and margin.tolist() == [0.5, 0.0]


def test_factory_refuses_to_attach_without_sglangs_model_runner_in_reach(hook_mod):
    with pytest.raises(RuntimeError, match="model runner in reach"):
        hook_mod.make_hook({"metrics_dir": "/tmp/x"})


def test_a_flagged_row_without_the_servers_mark_is_plain(hook_mod, runner, tmp_path, monkeypatch):
    """A client that smuggled mg's flag (or guessed at the mark) is not protected: no report, no edit."""
    seam = make_seam(hook_mod, runner, tmp_path, monkeypatch)
    for mark in ("", "guess", MARK[:-1]):
        logits = torch.randn(1, VOCAB)
        before = logits.clone()
        seam(None, sampler_args([(FakeReq(f"x{mark}", [1, 2, 3]), True)], logits, [2], mark=mark))
        assert torch.equal(logits, before)
    assert seam.link.client.rows == [] and seam.link.tracked == {}


def test_an_error_inside_the_seam_fails_its_rows_not_the_scheduler(hook_mod, runner, tmp_path, monkeypatch):
    """Nothing a row carries raises out of the Sampler hook (that would stop SGLang's scheduler):
    a malformed seed fails its own request with a reason."""
    from mg_server.config import SEED_PARAM, TEMPERATURE_PARAM

    seam = make_seam(hook_mod, runner, tmp_path, monkeypatch)
    bad = FakeReq("bad", [1, 2, 3], custom_params={TEMPERATURE_PARAM: 0.8, SEED_PARAM: "abc"})
    assert seam(None, sampler_args([(bad, True)], torch.randn(1, VOCAB), [2])) is None
    assert bad.to_finish is not None and "deterministic decoding failed" in bad.to_finish.message


def test_a_request_longer_than_the_verifiers_pool_is_refused_with_a_400(hook_mod, runner, tmp_path, monkeypatch):
    """Prompt + length limit over the verifier's whole K/V pool: a 400 naming the budget flag at the
    first step (no report, so no check that could only be evicted again); one that fits is reported."""
    seam = make_seam(hook_mod, runner, tmp_path, monkeypatch, pool_tokens=20)
    long, fits = FakeReq("long", [1, 2, 3], max_new_tokens=18), FakeReq("fits", [1, 2, 3], max_new_tokens=17)
    seam(None, sampler_args([(long, True), (fits, True)], torch.randn(2, VOCAB), [2, 2]))
    assert long.to_finish is not None and long.to_finish.status_code == 400
    assert "--mg-kv-budget-gb" in long.to_finish.message and "21 tokens" in long.to_finish.message
    assert fits.to_finish is None and [r.rid for r in seam.link.client.rows] == ["fits"]
