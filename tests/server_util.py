"""The server-process helper of tests; it lives in the package (`mg_server.evaluation.server_process`)
because benchmarks and `mg-server calibrate` start servers too."""

from mg_server.evaluation.server_process import ServerProcess, free_port  # noqa: F401


def serving(args: list[str], log_path):
    """The one server fixture body (`yield from`): a real `mg-server serve` with `args`, ready,
    stopped afterwards."""
    srv = ServerProcess(args, log_path)
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


def faulted_server(model, log_path, args: list[str], env: dict[str, str], questions, max_new: int):
    """A fixture body (`yield from`): a server started with test-only environment faults (set for
    its start only), with the chat prompts of `questions` and their verifier-alone greedy
    references: yields (server, tokenizer, prompts, reference token lists)."""
    import os

    from transformers import AutoTokenizer

    from mg_server.prompts import chat_ids
    from mg_server.verifier.reference import greedy_reference, load_engine

    tok = AutoTokenizer.from_pretrained(str(model))
    prompts = [chat_ids(tok, ({"role": "user", "content": q},)) for q in questions]
    refs = greedy_reference(load_engine(str(model)), prompts, max_new, stop_ids=(tok.eos_token_id,))
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        srv = ServerProcess(args, log_path)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    try:
        srv.wait_ready()
        yield srv, tok, prompts, [r.tokens for r in refs]
    finally:
        srv.stop()


def stream_states_and_text(body: str) -> tuple[list[str], str]:
    """A streamed chat answer's mg verdict states (its last event's `mg_verdict`) and its text."""
    import json

    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    verdicts = [c["mg_verdict"] for c in chunks if "mg_verdict" in c]
    assert len(verdicts) == 1 and "mg_verdict" in chunks[-1], body[-2000:]  # one, the last chunk
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    return verdicts[0]["states"], text
