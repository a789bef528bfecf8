"""A deterministic stream's verdict and system_fingerprint as `data:` events, through a real ASGI
app (no SGLang): the events SGLang sends, split across body messages as a proxy may split them."""

import json

import pytest
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from mg_server.config import FrontConfig
from mg_server.front.stream import StreamEvents
from test_middleware import NOOP, make_app

DET = {"X-Deterministic": "1"}
CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}


def chat_events(words: list[str]) -> list[bytes]:
    out = [b"data: " + json.dumps({**CHUNK, "choices": [{"index": 0, "delta": {"content": w}}]}).encode() + b"\n\n"
           for w in words]
    return out + [b"data: [DONE]\n\n"]


def split_stream(pieces: list[bytes], media="text/event-stream"):
    async def endpoint(request: Request):
        async def body():
            for p in pieces:
                yield p
        return StreamingResponse(body(), media_type=media)
    return endpoint


def data_events(text: str) -> list[dict]:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    return [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]


@pytest.fixture()
def verdicts(monkeypatch):
    from mg_server.front.verdict import RuntimeView

    answer = {"state": "verified"}

    async def fake(self, rids, correct=False):
        return [(answer["state"], None)] * len(rids)

    monkeypatch.setattr(RuntimeView, "verdicts", fake)
    return answer


def client_for(tmp_path, pieces, path="/v1/chat/completions", fingerprint="fp_abc", kernel="cpu-123"):
    return make_app(FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path), system_fingerprint=fingerprint,
                                kernel_config_id=kernel), [Route(path, split_stream(pieces), methods=["POST"])])


@pytest.mark.parametrize("cut", [None, 5, 17, 40])
def test_every_chunk_has_the_fingerprint_and_the_last_one_the_verdict(tmp_path, verdicts, cut):
    raw = b"".join(chat_events(["Par", "is", "."]))
    pieces = [raw] if cut is None else [raw[i:i + cut] for i in range(0, len(raw), cut)]  # events split anywhere
    verdicts["state"] = "mismatch"
    r = client_for(tmp_path, pieces).post("/v1/chat/completions", json={"messages": [], "stream": True}, headers=DET)
    assert r.headers["x-deterministic-verified"] == "in-stream" and r.headers["x-mg-kernel-config"] == "cpu-123"
    events = data_events(r.text)
    assert ["".join(c["delta"]["content"] for c in e["choices"]) for e in events[:-1]] == ["Par", "is", "."]
    assert all(e["system_fingerprint"] == "fp_abc" for e in events)
    last = events[-1]
    assert last["choices"] == [] and {k: last[k] for k in CHUNK} == CHUNK  # a chunk like the others
    assert last["mg_verdict"]["verified"] is False and last["mg_verdict"]["verdict"] == "mismatch"
    assert last["mg_verdict"]["states"] == ["mismatch"] and last["mg_verdict"]["kernel_config"] == "cpu-123"
    assert last["mg_verdict"]["rids"][0].startswith("mg-") and "#" not in last["mg_verdict"]["rids"][0]
    assert all("mg_verdict" not in e for e in events[:-1])


def test_a_generate_stream_gets_the_verdict_event_and_no_fingerprint_field(tmp_path, verdicts):
    pieces = [b'data: {"text": "Pa", "meta_info": {}}\n\n', b'data: {"text": "Paris", "meta_info": {}}\n\ndata: [DONE]\n\n']
    r = client_for(tmp_path, pieces, path="/generate").post("/generate", json={"text": "x", "stream": True},
                                                            headers=DET)
    events = data_events(r.text)
    assert [e.get("text") for e in events] == ["Pa", "Paris", None]
    assert "system_fingerprint" not in events[0] and r.headers["x-mg-system-fingerprint"] == "fp_abc"
    assert events[-1] == {"mg_verdict": {"verified": True, "verdict": "verified", "rids": events[-1]["mg_verdict"]["rids"],
                                         "states": ["verified"], "kernel_config": "cpu-123"}}


def test_an_error_event_fails_the_stream_even_split_mid_marker(tmp_path, verdicts):
    err = b'data: {"error": {"message": "boom"}}\n\n'
    pieces = [chat_events(["a"])[0] + err[:9], err[9:] + b"data: [DONE]\n\n"]
    r = client_for(tmp_path, pieces).post("/v1/chat/completions", json={"messages": [], "stream": True}, headers=DET)
    assert data_events(r.text)[-1]["mg_verdict"]["verdict"] == "failed"


def test_a_plain_stream_is_untouched(tmp_path, verdicts):
    raw = b"".join(chat_events(["a", "b"]))
    r = client_for(tmp_path, [raw]).post("/v1/chat/completions", json={"messages": [], "stream": True})
    assert r.content == raw


def test_stream_events_keep_bytes_they_cannot_parse():
    s = StreamEvents(openai=True, fingerprint="fp")
    out, tail = s.feed(b": keep-alive\n\ndata: {not json\n\ndata: [1]\n\ndata: {\"choices\": []}\n\ndata: [DO")
    assert out == b': keep-alive\n\ndata: {not json\n\ndata: [1]\n\ndata: {"choices": [], "system_fingerprint": "fp"}\n\n'
    assert tail is None and s.flush() == b"data: [DO"
    out, tail = s.feed(b"NE]\n\n")  # (flush took the partial event: only a body's end flushes)
    assert out == b"NE]\n\n" and tail is None
    out, tail = StreamEvents(openai=True, fingerprint="").feed(b"data: [DONE]\n\nafter")
    assert out == b"" and tail == b"data: [DONE]\n\nafter"
