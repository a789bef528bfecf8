"""The tokenizer rebuilt from the GGUF must round-trip exactly and match SmolLM2's vocabulary."""

import pytest
from transformers import AutoTokenizer

SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "3.14159265358979 and 1,000,000 and 2026-11-21T06:33:00Z",
    "tabs\t\tand   spaces     and\n\n\nnewlines  \r\n trailing   ",
    "ünïcödé: naïve café, 日本語のテキスト, emoji 🙂👍🏽, Ελληνικά, русский",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "",
    " leading space and  double",
]


@pytest.fixture(scope="module")
def tok(prepared_model):
    return AutoTokenizer.from_pretrained(prepared_model)


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_is_exact(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids(tok):
    assert tok.encode("<|im_start|>", add_special_tokens=False) == [1]
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [2]
    assert tok.encode("<|endoftext|>", add_special_tokens=False) == [0]
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)


def test_digits_are_split_one_by_one(tok):
    ids = tok.encode("12345", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == list("12345")


def test_byte_level_words_use_known_merges(tok):
    # SentencePiece-style conversion (the transformers GGUF bug) splits these into many pieces
    ids = tok.encode(" the", add_special_tokens=False)
    assert len(ids) == 1 and tok.convert_ids_to_tokens(ids) == ["Ġthe"]


def test_chat_template_renders_im_tokens(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n")


def test_prepare_is_idempotent(prepared_model):
    from mg_server.model.prepare import prepare_model

    before = (prepared_model / "model.safetensors").stat().st_mtime_ns
    assert prepare_model(progress=False) == prepared_model
    assert (prepared_model / "model.safetensors").stat().st_mtime_ns == before


def test_two_first_prepares_into_one_folder_convert_once(tmp_path):
    # two first starts at once (or two test workers): one converts, the other waits for it and
    # finds the folder prepared, instead of swapping in its own copy under the first one's feet
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from mg_server.model.prepare import prepare_model; "
            "print(prepare_model(Path(sys.argv[1]), progress=True))")
    out = tmp_path / "m"
    logs = [(tmp_path / f"out{k}", tmp_path / f"err{k}") for k in range(2)]  # (files: no pipe to fill up)
    procs = []
    try:
        for o, e in logs:
            with open(o, "w") as fo, open(e, "w") as fe:
                procs.append(subprocess.Popen([sys.executable, "-c", code, str(out)], stdout=fo, stderr=fe))
        for p in procs:
            p.wait(timeout=300)
    finally:
        for p in procs:
            p.kill()
    results = [(o.read_text(), e.read_text()) for o, e in logs]
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in results]
    assert all(o.strip() == str(out) for o, _ in results)
    converted = ["dequantize weights" in e for _, e in results]
    assert converted.count(True) == 1, converted  # one conversion; the other found it done
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.decode(tok.encode("Hello, world!")) == "Hello, world!"


def test_a_served_folder_is_not_prepared_again_under_the_server(tmp_path, capsys):
    # a running server holds the folder it was started from; `prepare-model --force` into it
    # refuses (exit 2, a message) instead of swapping the folder under the server
    from mg_server.launch import cli
    from mg_server.model.prepare import MARKER, ModelInUse, hold_model, prepare_model

    d = tmp_path / "m"
    d.mkdir()
    (d / MARKER).write_text('{"fingerprint": "x"}')
    (d / "weights").write_text("served")
    held = hold_model(d)
    assert held is not None
    try:
        with pytest.raises(ModelInUse, match="in use by a running mg-server"):
            prepare_model(d, force=True, progress=False)
        assert cli.main(["prepare-model", "--out", str(d), "--force"]) == 2
        assert "in use by a running mg-server" in capsys.readouterr().err
        assert (d / "weights").read_text() == "served"  # untouched
    finally:
        held.close()
    assert hold_model(tmp_path) is None  # a folder mg did not prepare is not held
    # serve and calibrate hold the folder they start from (cli._model_path), for the process's life
    assert cli._model_path(str(d)) == str(d)
    try:
        assert cli.main(["prepare-model", "--out", str(d), "--force"]) == 2
    finally:
        while cli._HELD:
            f = cli._HELD.pop()
            if f is not None:
                f.close()


def test_prepare_refuses_only_while_a_server_holds_the_folder(tmp_path, monkeypatch):
    # once the server is gone the swap goes ahead (the conversion itself stubbed: a real one is
    # test_two_first_prepares_into_one_folder_convert_once's)
    from mg_server.model import prepare

    d = tmp_path / "m"
    d.mkdir()
    (d / prepare.MARKER).write_text('{"fingerprint": "x"}')
    done = []
    monkeypatch.setattr(prepare, "_convert", lambda g, out, fp, progress: done.append(out) or out)
    held = prepare.hold_model(d)
    with pytest.raises(prepare.ModelInUse):
        prepare.prepare_model(d, gguf_path=d / prepare.MARKER, force=True, progress=False)
    held.close()
    assert prepare.prepare_model(d, gguf_path=d / prepare.MARKER, force=True, progress=False) == d
    assert done == [d]
