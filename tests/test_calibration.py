"""`mg-server calibrate`: the fast-path measurement (rollback, logprob reading), the tau sweep,
the profile and its check, the prompt files, tau profiles in `serve`; and one small real
calibration on this CPU (marked `server`)."""

import json
import math
import subprocess
import sys
import tempfile

import numpy as np
import pytest

from mg_server.calibration import fastpath, plot, profile, sweep
from mg_server.checkpoint import read_checkpoint
from mg_server.config import CalibrationConfig
from mg_server.calibration.fastpath import MeasurementError, Trace
from mg_server.calibration.sweep import SetData
from mg_server.policy import PROFILE_DIR, Policy, read_profile, resolve_tau
from mg_server.prompts import load_prompt_set, read_jsonl_prompts

# ---- the fast path's rows ------------------------------------------------------------------


def _meta(ids, tops):
    return {"output_ids": ids, "meta_info": {"output_top_logprobs": [[[lp, i, None] for lp, i in t] for t in tops]}}


def test_row_margin_is_top1_minus_top2_snapped_to_the_bf16_difference():
    row = fastpath._row(_meta([3725, 5], [[(-0.8283424377441406, 3725), (-1.0783424377441406, 1604), (-3.0, 9)],
                                          [(-0.01, 5), (-4.5, 6), (-6.0, 7)]]), 2)
    assert row.margins[0] == 0.25  # fp32 logprob rounding removed: exactly the bf16 logit gap
    assert row.seconds == [1604, 6] and row.tokens == [3725, 5]
    assert abs(row.margins[1] - 4.49) < 1e-4


def test_row_tie_listed_in_either_order_is_margin_zero():
    # argmax took the lower id 1003; the top-k list put 1620 first with the same logprob
    row = fastpath._row(_meta([1003], [[(-0.7, 1620), (-0.7, 1003), (-2.0, 4)]]), 1)
    assert row.margins == [0.0] and row.seconds == [1620]


def test_row_refuses_a_token_that_is_not_the_top1():
    with pytest.raises(MeasurementError, match="not a top-1"):
        fastpath._row(_meta([9], [[(-0.1, 5), (-0.2, 9), (-3.0, 4)]]), 1)
    with pytest.raises(MeasurementError, match="asked for 2 tokens"):
        fastpath._row(_meta([5], [[(-0.1, 5), (-0.2, 9)]]), 2)


# ---- rollback measurement against a scripted fast path -------------------------------------

K, T = 5, 12
PROMPTS = [[100 + i, 7] for i in range(K)]
REFS = [[1000 * (i + 1) + p for p in range(T)] for i in range(K)]
FLIPS_AT = {(0, 3), (0, 4), (2, 11), (4, 0)}  # (prompt, position) where the fast path differs


def _scripted(calls):
    def generate_rows(url, rows, max_new, timeout_s):
        calls.append((len(rows), max_new))
        out = []
        for row in rows:
            i = next(k for k, p in enumerate(PROMPTS) if row[:2] == p)
            start = len(row) - 2
            assert row[2:] == REFS[i][:start], "a resumed row must carry the reference's prefix"
            toks, margins, seconds, diverged = [], [], [], False
            for k in range(max_new):
                pos = start + k
                if diverged or pos >= T:  # its own continuation after a flip, or past max_tokens
                    toks.append(5), margins.append(9.0), seconds.append(6)
                elif (i, pos) in FLIPS_AT:
                    toks.append(5), margins.append(0.125 * (pos % 3)), seconds.append(REFS[i][pos])
                    diverged = True
                else:
                    toks.append(REFS[i][pos]), margins.append(2.0 + pos), seconds.append(6)
            out.append(fastpath.Row(toks, margins, seconds))
        return out

    return generate_rows


@pytest.mark.parametrize("bs", [1, 2, 4, 8])
def test_measure_rolls_back_onto_the_reference_and_measures_every_position(monkeypatch, bs):
    calls = []
    monkeypatch.setattr(fastpath, "generate_rows", _scripted(calls))
    seen = []
    traces = fastpath.measure("http://x", PROMPTS, REFS, bs, T, 1.0, progress=seen.append)
    assert sum(seen) == K * T  # every position measured exactly once
    assert all(n == bs for n, _ in calls)  # neighbours fill every batch to its size
    for tr in traces:
        assert not any(math.isnan(m) for m in tr.margins)
        assert {(tr.prompt, p) for p, f in enumerate(tr.flips) if f} == {f for f in FLIPS_AT if f[0] == tr.prompt}
        resumed = sum(1 for i, p in FLIPS_AT if i == tr.prompt and p + 1 < T)
        assert tr.rounds == 1 + resumed
    assert traces[0].second_tokens[3] == REFS[0][3] and traces[0].fast_tokens[3] == 5
    assert Trace.from_json(json.loads(json.dumps(traces[0].to_json()))) == traces[0]


def test_neighbours_are_other_prompts_when_there_are_enough():
    assert fastpath._neighbours([0, 1], 5, 3) == [2, 3, 4]
    assert fastpath._neighbours([3, 4], 5, 2) == [0, 1]
    assert fastpath._neighbours([0], 1, 2) == [0, 0]  # a one-prompt set repeats itself


# ---- sweep -----------------------------------------------------------------------------------


def _set(name="a", seed=0, n_prompts=6, bss=(1, 4)) -> SetData:
    """Synthetic measurements: margins from a seeded distribution, flips only at small margins,
    a reference margin near the fast one."""
    rng = np.random.default_rng(seed)
    refs = [[int(x) for x in rng.integers(0, 50, T)] for _ in range(n_prompts)]
    ref_margins = [[float(x) for x in rng.exponential(2.0, T)] for _ in range(n_prompts)]
    traces = {}
    for bs in bss:
        trs = []
        for i in range(n_prompts):
            margins = [round(max(0.0, r + rng.normal(0, 0.1)) * 16) / 16 for r in ref_margins[i]]
            flips = [m < 0.2 and rng.random() < 0.5 for m in margins]
            fast = [refs[i][p] + 1 if f else refs[i][p] for p, f in enumerate(flips)]
            trs.append(Trace(i, bs, margins, flips, fast, list(refs[i]), 1 + sum(flips)))
        traces[bs] = trs
    return SetData(name, name, [[1, 2]] * n_prompts, refs, ref_margins, traces)


def test_trigger_is_the_policy_rule():
    margins = np.array([0.0, 0.1, 0.25, 0.5, math.nan, 3.0])
    for tau in (0.0, 0.1, 0.25, 0.3, 5.0, math.inf):
        assert sweep.triggered(margins, tau).tolist() == [Policy("margin", tau).should_verify(m) for m in margins]


def test_sweep_by_hand():
    tr = [Trace(0, 1, [0.0, 0.5, 2.0], [True, False, False], [1, 2, 3], [0, 0, 0], 2),
          Trace(1, 1, [1.0, 0.25, 3.0], [False, True, False], [1, 2, 3], [0, 0, 0], 2),
          Trace(2, 1, [4.0, 4.0, 4.0], [False, False, False], [1, 2, 3], [0, 0, 0], 1)]
    st = sweep.flatten({1: tr}, [[0.1, 0.4, 2.0], [1.1, 0.1, 3.0], [4.0, 4.0, 4.0]])
    assert sweep.at_tau(st, 0.0) == {"tau": 0.0, "trigger": 0.0, "recall": 0.0, "determinism": 1 / 3, "missed_flips": 2}
    r = sweep.at_tau(st, 0.25)  # margin 0.25 is not < 0.25: the second flip is missed
    assert (r["trigger"], r["recall"], r["determinism"]) == (1 / 9, 0.5, 2 / 3)
    r = sweep.at_tau(st, 0.375)
    assert (r["trigger"], r["recall"], r["determinism"]) == (2 / 9, 1.0, 1.0)
    assert sweep.max_flip_margin(st) == 0.25 and sweep.tau100(st) == 0.375
    assert sweep.by_batch_size(st)["1"] == {"steps": 9, "flips": 2, "flip_rate": 2 / 9, "sequences": 3,
                                            "sequences_with_flips": 2}
    c = sweep.choose_tau(st)  # near-tie stable steps: ref margins 0.4 (fast 0.5), 0.1... shift 0.1
    assert c["tau100"] == 0.375 and c["tau"] == 0.375 and c["safety_factor"] == 1.0
    assert sweep.choose_tau(st, 2.0)["tau"] == 0.75


def test_derived_safety_covers_the_largest_near_tie_shift():
    st = sweep.flatten(_set().traces, _set().ref_margins)
    c = sweep.choose_tau(st)
    d = sweep.near_tie_shift(st).max()
    assert c["tau"] >= max(c["tau100"], d) and c["tau"] - max(c["tau100"], d) < 1 / 64
    assert sweep.at_tau(st, c["tau"])["recall"] == 1.0


# ---- profile ---------------------------------------------------------------------------------

SERVING = {"sglang_version": "0.5.10.post1", "dtype": "bfloat16", "device": "cpu", "attention_backend": "torch_native"}


def _profile(tmp_path, sets):
    cfg = CalibrationConfig(model_path=str(tmp_path / "SmolLM2-135M-Instruct"), prompt_sets=tuple(s.name for s in sets),
                            batch_sizes=(1, 4), max_tokens=T, limit=6, out_dir=str(tmp_path))
    return profile.build(cfg, SERVING, "cpu-test", sets)


def test_profile_is_consistent_json_and_the_check_catches_damage(tmp_path):
    prof = _profile(tmp_path, [_set("a", 0), _set("b", 1)])
    assert profile.check(prof) == []
    text = json.dumps(prof, allow_nan=False)  # strict JSON: inf is the string "inf"
    assert json.loads(text)["sets"]["a"]["sweep"][-1]["tau"] == "inf"
    assert {(t["from"], t["to"]) for t in prof["transfer"]} == {("a", "b"), ("b", "a")}
    assert prof["tau"] == prof["sets"]["a"]["own_tau"]

    bad = json.loads(text)
    rows = bad["sets"]["a"]["sweep"]
    rows[1]["trigger"], rows[-2]["trigger"] = rows[-2]["trigger"], rows[1]["trigger"]
    assert any("trigger not monotone" in p for p in profile.check(bad))
    bad = json.loads(text)
    bad["sets"]["b"]["sweep"].pop()
    assert any("up to inf" in p for p in profile.check(bad))
    bad = json.loads(text)
    bad["sets"]["a"]["flip_list"].pop()
    assert any("flip list" in p for p in profile.check(bad))
    bad = json.loads(text)
    bad["tau"] = 0.0
    assert any("does not catch every flip" in p for p in profile.check(bad))


def test_profile_without_flips(tmp_path):
    d = _set("a", 0)
    for trs in d.traces.values():
        for tr in trs:
            tr.flips = [False] * len(tr.flips)
            tr.fast_tokens = [d.refs[tr.prompt][p] for p in range(len(tr.flips))]
    prof = _profile(tmp_path, [d])
    assert profile.check(prof) == [] and json.dumps(prof, allow_nan=False)
    c = prof["tau_choice"]
    assert c["tau100"] == 0.0 and c["max_flip_margin"] == "-inf" and c["safety_factor"] == "inf"
    assert prof["tau"] >= c["near_tie_shift_max"]  # no flip seen: the shift bound alone


def test_plot_writes_a_png(tmp_path):
    prof = _profile(tmp_path, [_set("a", 0), _set("b", 1)])
    plot.write(prof, tmp_path / "c.png")
    data = (tmp_path / "c.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_shipped_profiles_are_consistent_calibrations(device):
    prof = json.loads((PROFILE_DIR / f"SmolLM2-135M-Instruct.{device}.json").read_text())
    assert profile.check(prof) == []
    assert prof["model"] == "SmolLM2-135M-Instruct" and prof["schema"] == profile.SCHEMA
    assert prof["device"] == device and prof["sglang"]["device"] == device
    assert "humaneval" in prof["sets"] and prof["max_tokens"] >= 64 and prof["limit"] >= 48
    assert prof["batch_sizes"][0] == 1 and prof["batch_sizes"][-1] == 16


# ---- prompt files, tau profiles in serve, CLI errors ------------------------------------------


def test_jsonl_prompts(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n\n{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}\n')
    assert read_jsonl_prompts(f) == [({"role": "user", "content": "hi"},),
                                     ({"role": "system", "content": "s"}, {"role": "user", "content": "u"})]
    assert load_prompt_set(str(f), 1).chats == (({"role": "user", "content": "hi"},),)
    assert load_prompt_set(str(f), 9).name == "p"
    f.write_text('{"prompt": "hi"}\n{"text": "no"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: expected"):
        read_jsonl_prompts(f)
    f.write_text('{"prompt": "hi"\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: not JSON"):
        read_jsonl_prompts(f)
    with pytest.raises(ValueError, match="unknown prompt set"):
        load_prompt_set("mmlu", 3)
    assert len(load_prompt_set("humaneval", 3).chats) == 3


def test_tau_profile_files(tmp_path):
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"model": "SmolLM2-135M-Instruct", "model_id": "abc", "tau": 0.4375}))
    assert resolve_tau("abc", None, "margin", str(f)) == (0.4375, f"profile {f}")
    assert resolve_tau("abc", 0.1, "margin", str(f)) == (0.1, "flag")
    assert resolve_tau("abc", None, "margin", str(f), profile={"tau": 0.25}) == (0.25, f"profile {f}")  # read once
    tau, source = resolve_tau("other", None, "margin", str(f))
    assert tau == 0.4375 and "calibrated for 'SmolLM2-135M-Instruct' (id abc), not this model (other)" in source
    for text, match in (("{", "not JSON"), ('{"tau": -1}', "finite number"), ('{"tau": true}', "finite number"),
                        ('{"model": "x"}', "finite number"), ("[1]", "finite number")):
        f.write_text(text)
        with pytest.raises(ValueError, match=match):
            read_profile(f)
    with pytest.raises(ValueError, match="cannot read"):
        resolve_tau("x", None, "always", str(tmp_path / "missing.json"))  # checked in every mode


def test_serve_profile_flag_reaches_the_config(monkeypatch, tmp_path, prepared_model):
    from mg_server.launch import cli, launcher

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the instance folders serve would remove
    seen = []
    monkeypatch.setattr(launcher, "serve", seen.append)
    f = tmp_path / "t.json"
    f.write_text('{"tau": 0.3}')
    assert cli.main(["serve", "--model", str(prepared_model), "--profile", str(f), "--device", "cpu"]) == 0
    assert seen[0].tau_profile == str(f) and seen[0].mg_tau is None
    assert seen[0].tau_profile_doc == {"tau": 0.3}  # read once, by the command line
    assert cli.main(["serve", "--profile", str(tmp_path / "nope.json")]) == 2


@pytest.mark.parametrize("args", [["--prompts", "nope"], ["--batch-sizes", "1,x"], ["--batch-sizes", "0"],
                                  ["--limit", "0"], ["--prompts", "/does/not/exist.jsonl"], ["--safety-factor", "0.5"],
                                  ["--model", "/does/not/exist"], ["--unknown-flag"]])
def test_calibrate_bad_input_exits_2(tmp_path, args, capsys):
    from mg_server.launch import cli

    try:
        rc = cli.main(["calibrate", "--out", str(tmp_path / "o"), *args])
    except SystemExit as e:  # argparse's own errors
        rc = e.code
    assert rc == 2 and capsys.readouterr().err.strip()  # a message, not a traceback
    assert not (tmp_path / "o").exists()  # nothing started


# ---- a real calibration on this CPU ----------------------------------------------------------


@pytest.mark.server
def test_small_calibration_end_to_end(tmp_path, prepared_model):
    out = tmp_path / "cal"
    cmd = [sys.executable, "-m", "mg_server", "calibrate", "--prompts", "humaneval", "--batch-sizes", "1,4",
           "--max-tokens", "24", "--limit", "4", "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    prof = json.loads((out / "profile.json").read_text())
    assert profile.check(prof) == []
    assert (out / "calibration.png").read_bytes()[:4] == b"\x89PNG"
    s = prof["sets"]["humaneval"]
    assert s["steps"] == 2 * 4 * 24 and set(s["by_batch_size"]) == {"1", "4"}
    rows = s["sweep"]
    assert [r["trigger"] for r in rows] == sorted(r["trigger"] for r in rows)  # monotone in tau
    assert rows[-1]["tau"] == "inf" and rows[-1]["determinism"] == 1.0 and rows[-1]["trigger"] == 1.0
    assert rows[0]["tau"] == 0.0 and rows[0]["trigger"] == 0.0
    # asking for logprobs did not change the tokens (checked by the run on a batch of 4)
    assert prof["sglang"]["logprobs_check"] == {"rows": 4, "tokens": 24, "equal": True}
    assert prof["sglang"]["disable_radix_cache"] is True and prof["dtype"] == "bfloat16"
    assert read_profile(out / "profile.json")["tau"] == prof["tau"]  # loadable by `serve --profile`
    assert prof["model_id"] == read_checkpoint(prepared_model).identity  # what a shipped profile is found by
    # a rerun is served from the cache: no server, seconds
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "fast path from" in again.stderr and "starting" not in again.stderr
    assert json.loads((out / "profile.json").read_text())["sets"] == prof["sets"]


def test_the_fast_path_server_takes_the_served_logits_on_each_device():
    """On CUDA mg serves its fast path with fp32 logits, so a GPU calibration measures that path:
    its server gets the same switch (and its cache key and recorded flags change with it)."""
    from mg_server.calibration import run
    from mg_server.config import FP32_LOGITS_ARGS

    def cfg(device):
        return CalibrationConfig(model_path="/m", prompt_sets=("humaneval",), batch_sizes=(1,), max_tokens=4,
                                 limit=1, out_dir="/x", device=device)

    assert run._server_flags(cfg("cuda")) == (*run.SERVER_FLAGS, *FP32_LOGITS_ARGS)
    assert run._server_flags(cfg("cpu")) == run.SERVER_FLAGS
