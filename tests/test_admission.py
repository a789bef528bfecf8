"""front.admission: deterministic requests beyond the verifier's capacity wait in a bounded FIFO
queue, past it a 429; one request larger than the capacity is a 400; a shutdown refuses the
queued ones and cuts the running ones with an answer, never a silent close."""

import asyncio
import json

import pytest

from mg_server.front.admission import Admission, Guard, Refused


def run(coro):
    return asyncio.run(coro)


def test_requests_beyond_capacity_wait_in_order_then_run():
    async def main():
        adm, order = Admission(capacity=2, queue_size=4), []

        async def one(name, slots, hold):
            t = await adm.enter(slots, "n")
            order.append(name)
            await asyncio.sleep(hold)
            adm.leave(t, slots)

        tasks = [asyncio.create_task(one("a", 2, 0.05))]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(one("b", 1, 0.01)), asyncio.create_task(one("c", 2, 0.01))]
        await asyncio.sleep(0.01)
        assert order == ["a"] and len(adm.waiting) == 2  # b and c queued behind a
        await asyncio.gather(*tasks)
        assert order == ["a", "b", "c"] and adm.used == 0 and adm.drained()

    run(main())


def test_a_full_queue_is_a_429_and_too_large_a_request_a_400():
    async def main():
        adm = Admission(capacity=2, queue_size=1)
        t = await adm.enter(2, "n")
        waiter = asyncio.create_task(adm.enter(1, "n"))
        await asyncio.sleep(0)
        with pytest.raises(Refused) as e:
            await adm.enter(1, "n")
        assert e.value.status == 429 and e.value.retry_after >= 1 and "--mg-queue 1" in str(e.value)
        with pytest.raises(Refused) as e:
            await adm.enter(3, "sampling_params.n")
        assert e.value.status == 400 and e.value.param == "sampling_params.n" and "at most 2" in str(e.value)
        adm.leave(t, 2)
        adm.leave(await waiter, 1)
        assert adm.drained()

    run(main())


def test_a_client_that_leaves_the_queue_gives_its_place_back():
    async def main():
        adm = Admission(capacity=1, queue_size=2)
        t = await adm.enter(1, "n")
        gone = asyncio.create_task(adm.enter(1, "n"))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.sleep(0)
        assert not adm.waiting
        adm.leave(t, 1)
        adm.leave(await adm.enter(1, "n"), 1)
        assert adm.used == 0

    run(main())


def test_stop_refuses_the_queued_and_new_requests():
    async def main():
        adm = Admission(capacity=1, queue_size=4)
        t = await adm.enter(1, "n")
        queued = asyncio.create_task(adm.enter(1, "n"))
        await asyncio.sleep(0)
        adm.stop()
        with pytest.raises(Refused) as e:
            await queued
        assert e.value.status == 503
        with pytest.raises(Refused) as e:
            await adm.enter(1, "n")
        assert e.value.status == 503 and "shutting down" in str(e.value)
        assert not adm.drained()  # the running one still holds its slot
        adm.leave(t, 1)
        assert adm.drained()

    run(main())


def _sink():
    sent = []

    async def send(message):
        sent.append(message)

    return sent, send


def test_a_cut_answers_an_unstarted_response_with_503_and_ends_a_started_stream():
    refused = [(b"x-mg-verdict", b"failed")]

    async def waits_for_verdict(send):  # a non-streamed answer: nothing sent until its verdict
        await asyncio.sleep(30)

    async def streams(send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await asyncio.sleep(30)

    async def main(app):
        adm = Admission(capacity=4, queue_size=0)
        sent, send = _sink()
        guard = Guard(send, refused)
        t = await adm.enter(1, "n")
        adm.on_cut(t, guard.cut)
        runner = asyncio.create_task(guard.run(app(guard.tracked)))
        await asyncio.sleep(0.01)
        assert adm.cut() == 1
        await asyncio.wait_for(runner, 5)
        adm.leave(t, 1)
        return sent

    sent = run(main(waits_for_verdict))
    assert sent[0]["status"] == 503 and (b"x-mg-verdict", b"failed") in sent[0]["headers"]
    assert "stopped" in json.loads(sent[1]["body"])["message"]
    sent = run(main(streams))
    assert sent[0]["status"] == 200 and sent[-1]["more_body"] is False
    assert json.loads(sent[-1]["body"].decode().removeprefix("data: "))["error"]["mg_verdict"] == "failed"


def test_a_streams_slots_come_back_at_its_last_message_not_when_the_app_call_returns(tmp_path, monkeypatch):
    """SGLang's streamed /generate returns from its app call 2 s after the stream's end (a
    background disconnect check); a batch posted right after must not wait for that."""
    from mg_server.config import FrontConfig
    from mg_server.front.middleware import DeterministicMiddleware
    from mg_server.front.verdict import RuntimeView

    async def verified(self, rids, correct=False):
        return [("verified", None)] * len(rids)

    monkeypatch.setattr(RuntimeView, "verdicts", verified)

    monkeypatch.setattr(RuntimeView, "problem", lambda self: "")  # a runtime that is up
    background = asyncio.Event()  # set: the first request's background part may end

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": b'data: {"text": "a"}\n\ndata: [DONE]\n\n', "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        if scope["n"] == 0:
            await background.wait()

    async def post(mw, n, ended):
        body = json.dumps({"input_ids": [[1, 2], [3, 4]], "stream": True}).encode()
        sent = iter([{"type": "http.request", "body": body, "more_body": False}])

        async def receive():
            return next(sent, {"type": "http.disconnect"})

        async def send(m):
            if m["type"] == "http.response.body" and not m.get("more_body", False):
                ended.set()
        scope = {"type": "http", "method": "POST", "path": "/generate", "query_string": b"", "n": n,
                 "headers": [(b"x-deterministic", b"1"), (b"content-type", b"application/json")]}
        await mw(scope, receive, send)

    async def main():
        mw = DeterministicMiddleware(app, FrontConfig(noop_processor='{"callable": "00"}', metrics_dir=str(tmp_path),
                                                      controller_ipc="ipc:///unused", max_deterministic=2))
        first_end, second_end = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(post(mw, 0, first_end))
        await asyncio.wait_for(first_end.wait(), 5)
        second = asyncio.create_task(post(mw, 1, second_end))  # 2 + 2 rows > capacity 2 unless the first left
        await asyncio.wait_for(second_end.wait(), 5)
        assert not first.done()  # its app call still runs: the slots came back at its last message
        background.set()
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert mw.admission.used == 0 and mw.admission.drained()

    run(main())
