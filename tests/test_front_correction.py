"""front.correction: a missed flip's completion is swapped into a body only where the body
demonstrably holds the answer SGLang emitted; otherwise None (the verdict stays mismatch)."""

import json

from mg_server.front import correction
from mg_server.wire.protocol import Correction


def apply(body: bytes, path: str, corr: Correction, model_path: str) -> bytes | None:
    """One request's body: the rewritten body, or None where it could not be rewritten."""
    out, (ok,) = correction.apply(body, path, [corr], model_path)
    assert ok or out == body  # never a half-rewrite
    return out if ok else None

CORR = Correction(original=[10, 11, 12, 2], output=[10, 11, 40, 41, 42], first=2, finish="length")


def test_generate_body_gets_the_corrected_ids_and_finish():
    body = json.dumps({"output_ids": [10, 11, 12, 2], "meta_info": {"completion_tokens": 4,
                                                                    "finish_reason": {"type": "stop", "matched": 2}}})
    out = json.loads(apply(body.encode(), "/generate", CORR, ""))
    assert out["output_ids"] == [10, 11, 40, 41, 42]
    assert out["meta_info"] == {"completion_tokens": 5, "finish_reason": {"type": "length", "length": 5}}


def test_a_body_that_does_not_hold_the_original_is_left_alone():
    other = json.dumps({"output_ids": [10, 99, 12, 2]}).encode()
    assert apply(other, "/generate", CORR, "") is None
    assert apply(b"[{}]", "/generate", CORR, "") is None  # a batch answers several requests
    assert apply(b"[{}]", "/v1/completions", CORR, "") is None
    assert apply(b"not json", "/generate", CORR, "") is None
    # text to respell but no tokenizer to spell it with
    assert apply(json.dumps({"output_ids": [10, 11, 12, 2], "text": "x"}).encode(), "/generate", CORR, "") is None
    chat = json.dumps({"choices": [{"message": {"content": "x"}}]}).encode()
    assert apply(chat, "/v1/chat/completions", CORR, "") is None


def test_chat_and_completions_text_is_respelled_with_the_models_tokenizer(prepared_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(prepared_model))
    orig, new = tok.encode("The sky is blue"), tok.encode("The sea is green and wide")
    corr = Correction(original=orig, output=new, first=1, finish="length")
    chat = {"choices": [{"message": {"role": "assistant", "content": tok.decode(orig)}, "finish_reason": "stop",
                         "matched_stop": 2}], "usage": {"prompt_tokens": 7, "completion_tokens": len(orig),
                                                        "total_tokens": 7 + len(orig)}}
    out = json.loads(apply(json.dumps(chat).encode(), "/v1/chat/completions", corr, str(prepared_model)))
    c = out["choices"][0]
    assert c["message"]["content"] == tok.decode(new) and c["finish_reason"] == "length" and c["matched_stop"] is None
    assert out["usage"] == {"prompt_tokens": 7, "completion_tokens": len(new), "total_tokens": 7 + len(new)}
    comp = {"choices": [{"text": tok.decode(orig)}]}
    out = json.loads(apply(json.dumps(comp).encode(), "/v1/completions", corr, str(prepared_model)))
    assert out["choices"][0]["text"] == tok.decode(new)


def test_each_answer_of_a_generate_batch_is_rewritten_on_its_own():
    kept = {"output_ids": [5, 6], "meta_info": {"completion_tokens": 2}}
    held = {"output_ids": [10, 11, 12, 2], "meta_info": {"completion_tokens": 4}}
    other = {"output_ids": [10, 99, 12, 2]}  # does not hold its correction's original
    body = json.dumps([kept, held, other]).encode()
    out, ok = correction.apply(body, "/generate", [None, CORR, CORR], "")
    assert ok == [True, True, False]
    a, b, c = json.loads(out)
    assert a == kept and c == other and b["output_ids"] == CORR.output and b["meta_info"]["completion_tokens"] == 5
    assert correction.apply(body, "/generate", [None, CORR], "") == (body, [True, False])  # counts differ
