"""seam/guard.py on SGLang's own classes (no server): SGLang never unpickles a client's processor,
and no Req runs that names one, names mg's without the server's mark, or carries a field Req
itself refuses (it is aborted instead of raising in the scheduler)."""

import pytest

from mg_server.config import DETERMINISTIC_PARAM, MARK_PARAM, SEED_PARAM, TEMPERATURE_PARAM

MARK = "0123456789abcdef"


@pytest.fixture(scope="module")
def sglang():
    from mg_server.launch import compat

    compat.install("cpu")
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.sampling import custom_logit_processor as clp
    from sglang.srt.sampling.sampling_params import SamplingParams

    from mg_server.seam import guard

    guard.install(MARK)
    return Req, SamplingParams, clp, get_parallel


def created(sglang, processor, params):
    Req, SamplingParams, _, get_parallel = sglang
    with get_parallel().override(tp_rank=0):
        return Req("r", "hi", [1, 2, 3], SamplingParams(custom_params=params), custom_logit_processor=processor)


class Marker:
    ran = False


class Evil:
    def __reduce__(self):  # unpickling this runs code: it must never happen
        return (setattr, (Marker, "ran", True))


def test_no_processor_string_but_mgs_is_ever_unpickled(sglang):
    import json

    import dill

    from mg_server.seam.processor import MgFlagProcessor, serialized

    _, _, clp, _ = sglang
    payload = json.dumps({"callable": dill.dumps(Evil()).hex()})
    for s in (payload, '{"callable": "00"}', "not json"):
        with pytest.raises(ValueError):
            clp.CustomLogitProcessor.from_str(s)
    assert not Marker.ran
    assert isinstance(clp.CustomLogitProcessor.from_str(serialized()), MgFlagProcessor)


@pytest.mark.parametrize("processor,params", [
    ('{"callable": "00"}', {DETERMINISTIC_PARAM: True, MARK_PARAM: MARK}),  # a foreign processor
    ("ours", {DETERMINISTIC_PARAM: True}),  # mg's processor without the mark: a forged deterministic request
    ("ours", {DETERMINISTIC_PARAM: True, MARK_PARAM: "guess"}),
    ("ours", {DETERMINISTIC_PARAM: True, MARK_PARAM: MARK, SEED_PARAM: "abc", TEMPERATURE_PARAM: 0.8}),
    ("ours", {DETERMINISTIC_PARAM: True, MARK_PARAM: MARK, TEMPERATURE_PARAM: 50}),  # an int: not the front's float
    ("ours", None),
])
def test_a_request_that_names_a_processor_is_aborted_unless_the_front_made_it(sglang, processor, params):
    from mg_server.seam.processor import serialized

    req = created(sglang, serialized() if processor == "ours" else processor, params)
    assert req.to_finish is not None and req.to_finish.status_code == 400
    assert req.custom_logit_processor is None and req.sampling_params.custom_params is None


def test_the_fronts_requests_and_plain_ones_are_created_as_they_are(sglang):
    from mg_server.seam.processor import serialized

    params = {DETERMINISTIC_PARAM: True, MARK_PARAM: MARK, TEMPERATURE_PARAM: 0.8, SEED_PARAM: 7}
    req = created(sglang, serialized(), params)
    assert req.to_finish is None and req.custom_logit_processor == serialized()
    assert req.sampling_params.custom_params[MARK_PARAM] == MARK
    plain = created(sglang, None, None)
    assert plain.to_finish is None and plain.custom_logit_processor is None


def test_a_field_sglangs_req_refuses_aborts_that_request_not_the_scheduler(sglang):
    Req, SamplingParams, _, get_parallel = sglang
    with get_parallel().override(tp_rank=0):
        req = Req("r", "hi", [1, 2, 3], SamplingParams(), return_hidden_states=[], stream=True)
    assert req.to_finish is not None and "return_hidden_states" in req.to_finish.message
    assert req.rid == "r" and req.stream
