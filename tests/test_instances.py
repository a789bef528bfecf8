"""Client request ids reused: mg's bookkeeping is per request instance.

The front stamps each deterministic request with a fresh instance id (custom_params), asks for
its verdict by `rid#instance`, and the seam keys its token lists the same way; so a second
request with the id of a finished one can neither be failed by, nor be given, the first one's
state. No server, no controller (a fake verdict source)."""

import json
import threading
from types import SimpleNamespace

import pytest
import torch
from starlette.testclient import TestClient

from mg_server.config import DETERMINISTIC_PARAM, INSTANCE_PARAM, MARK_PARAM, FrontConfig, HookConfig
from mg_server.env import MARK_VAR
from mg_server.front.middleware import DeterministicMiddleware
from mg_server.policy import Policy
from mg_server.seam.link import StepDecision
from test_hook import FakeReq

DET = {"X-Deterministic": "1"}


@pytest.fixture()
def front(tmp_path, monkeypatch):
    """A front with a controller that knows one finished instance of rid "x": `verified`."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from mg_server.front.verdict import RuntimeView

    asked, bodies = [], []
    known = {}

    async def verdicts(self, rids, correct=False):
        asked.extend(rids)
        return [(known.get(r, "unknown"), None) for r in rids]

    monkeypatch.setattr(RuntimeView, "verdicts", verdicts)

    monkeypatch.setattr(RuntimeView, "problem", lambda self: "")  # a runtime that is up

    async def generate(request: Request):
        body = json.loads(await request.body())
        bodies.append(body)
        def one(rid):
            return {"text": "", "meta_info": {"id": rid, "completion_tokens": 0, "finish_reason": {"type": "abort"}}}

        rid = body["rid"]
        return JSONResponse([one(r) for r in rid] if isinstance(rid, list) else one(rid))

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
    app.add_middleware(DeterministicMiddleware, config=FrontConfig(
        noop_processor="{}", metrics_dir=str(tmp_path), controller_ipc=str(tmp_path / "controller.sock")))
    return SimpleNamespace(client=TestClient(app), asked=asked, bodies=bodies, known=known)


def test_a_reused_rid_never_gets_the_earlier_instances_verdict(front):
    body = {"text": "hi", "rid": "x", "sampling_params": {"max_new_tokens": 4}}
    r1 = front.client.post("/generate", json=body, headers=DET)
    key1 = front.asked[-1]
    front.known[key1] = "verified"  # the first instance finished, verified
    # the second instance is aborted before mg saw a step: the controller knows nothing of it
    r2 = front.client.post("/generate", json=body, headers=DET)
    key2 = front.asked[-1]
    assert key1 != key2 and key1.startswith("x#") and key2.startswith("x#")
    assert r1.headers["x-mg-verdict"] == "unknown" and r2.headers["x-mg-verdict"] == "unknown"
    assert r2.headers["x-deterministic-verified"] == "false"
    sent = [b["sampling_params"]["custom_params"] for b in front.bodies]
    assert [s[DETERMINISTIC_PARAM] for s in sent] == [True, True]
    assert {s[INSTANCE_PARAM] for s in sent} == {key1.partition("#")[2], key2.partition("#")[2]}
    assert all(b["rid"] == "x" for b in front.bodies)  # SGLang (and the client) keep the client's id


def test_batch_rids_share_one_instance_and_empty_answers_stay_settled(front):
    body = {"text": ["a", "b"], "rid": ["p", "q"], "sampling_params": [{"max_new_tokens": 0}, {}]}
    r = front.client.post("/generate", json=body, headers=DET)
    (key_q,) = front.asked  # p asks for no token: settled without the controller
    inst = front.bodies[0]["sampling_params"][1]["custom_params"][INSTANCE_PARAM]
    assert key_q == f"q#{inst}" and front.bodies[0]["sampling_params"][0]["custom_params"][INSTANCE_PARAM] == inst
    assert r.headers["x-mg-verdict"] == "unknown"


@pytest.fixture(scope="module")
def hook_mod():
    from mg_server.launch import compat

    compat.install("cpu")
    from mg_server.seam import hook

    return hook



def test_the_seam_keeps_two_instances_of_one_rid_apart(hook_mod, tmp_path, monkeypatch):
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.setenv(MARK_VAR, "mark")
    seam = hook_mod.StepSeam(HookConfig(metrics_dir=str(tmp_path)), None)
    rows = []
    client = SimpleNamespace(step=lambda rs: [StepDecision(rid=r.rid, token=r.fast_token) for r in rs],
                             report=rows.extend)
    seam.link = SimpleNamespace(client=client, tracked={}, lock=threading.Lock(), rpc_lock=threading.Lock(),
                                policy=Policy("margin", 0.0), info=SimpleNamespace(verifier_pool_tokens=0))
    first, second = FakeReq("x", [1, 2, 3]), FakeReq("x", [1, 2, 3])  # the first is still held (no Finish yet)
    seam(None, (SimpleNamespace(next_token_logits=torch.randn(1, 20)),
                SimpleNamespace(has_custom_logit_processor=True,
                                custom_params=[{DETERMINISTIC_PARAM: True, MARK_PARAM: "mark", INSTANCE_PARAM: "i1",
                                                "__req__": first}]),
                False, [], [], torch.tensor([2])))
    seam(None, (SimpleNamespace(next_token_logits=torch.randn(1, 20)),
                SimpleNamespace(has_custom_logit_processor=True,
                                custom_params=[{DETERMINISTIC_PARAM: True, MARK_PARAM: "mark", INSTANCE_PARAM: "i2",
                                                "__req__": second}]),
                False, [], [], torch.tensor([2])))
    assert second.to_finish is None and first.to_finish is None
    assert [r.rid for r in rows] == ["x#i1", "x#i2"] and rows[1].prompt == [1, 2, 3]
    assert set(seam.link.tracked) == {"x#i1", "x#i2"}
