"""The request surface under random input (mg_server.evaluation.fuzz): the front alone over a fake
app (thousands of bodies, no SGLang), then a real server for a bounded time: no 5xx, no dropped
connection, the server still up, and every `verified` token-id answer equal to the verifier-alone
reference."""

import random

import pytest
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient
from test_middleware import NOOP, make_app

from mg_server.config import FrontConfig
from mg_server.evaluation import fuzz

SERVER_SECONDS = 40  # the CI's share; the closing notes record longer runs of the same function


async def answer(request: Request):
    """An OpenAI-shaped answer (a /generate one for /generate), whatever was asked."""
    body = await request.json()
    one = {"text": "", "meta_info": {"completion_tokens": 0}, "output_ids": []}
    if request.url.path == "/generate":
        n = len(body["text"] if isinstance(body.get("text"), list) else body.get("input_ids") or [[]]) \
            if isinstance(body.get("rid"), list) else 1
        return JSONResponse([one] * n if isinstance(body.get("rid"), list) else one)
    return JSONResponse({"choices": [{"index": 0, "text": ""}], "usage": {"prompt_tokens": 1, "completion_tokens": 0}})


def test_the_front_answers_every_random_body_without_an_error_of_its_own(tmp_path):
    routes = [Route(p, answer, methods=["POST", "PUT"]) for p in ("/v1/chat/completions", "/v1/completions",
                                                                  "/generate", "/other")]
    client: TestClient = make_app(FrontConfig(noop_processor=NOOP, metrics_dir=str(tmp_path), request_mark="m" * 32,
                                              vocab_size=50000, served_models=("/models/x",)), routes)
    rng = random.Random(5)
    statuses = {}
    for _ in range(3000):
        _, path = rng.choice(fuzz.ROUTES)
        path = path if path in ("/v1/chat/completions", "/v1/completions", "/generate") else "/other"
        body = fuzz._mutate(rng, fuzz._valid(rng, path, [1, 2, 3]))
        flag = rng.choice(fuzz.FLAGS + [None])
        r = client.post(path, json=body, headers={"X-Deterministic": flag} if flag is not None else {})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, flag, body, r.text)
    assert statuses.get(400, 0) > 100 and statuses.get(200, 0) > 100, statuses  # both sides were exercised


@pytest.mark.server
def test_a_real_server_survives_a_fuzz_run_and_verifies_only_the_reference(tmp_path, prepared_model):
    from server_util import serving

    from mg_server.verifier.reference import load_engine

    prompts = [[1, 504, 3060, 314, 260], [1, 9690, 198, 2683, 359, 253], [28, 1219, 30, 216]]
    for srv in serving([], tmp_path / "server.log"):
        rep = fuzz.run(srv.url, prompts, SERVER_SECONDS, seed=3)
        print(rep.to_json())
        assert rep.alive and srv.proc.poll() is None
        assert rep.server_errors == [], rep.server_errors[:5]
        assert rep.verdicts.get("verified", 0) > 0 and rep.verified
    engine = load_engine(str(prepared_model), device="cpu", max_seq_len=512, pool_tokens=4096)
    assert fuzz.mismatches(engine, rep.verified) == []
