"""Chunked catch-up: the tokens a verifier has not seen go to it in calls of bounded size.

A request's first check carries its whole prompt, and every check (or the final audit) carries
the tokens committed fast since the one before. Sent as one call, a 2000-token prompt took the
CPU verifier longer than the verify timeout, so a backlog longer than a chunk goes in chunks, each
call bounded by the timeout on its own; each chunk's result is audited like any catch-up (its
token is the verifier's next-token prediction, checked by the next call). The requests checked
together catch up in rounds: each round sends every request's next chunk, packed into as few
calls as the verifier accepts (the caller's `call`), so many long prompts share forwards, one
read of the weights per call, instead of taking their calls one request after another.
"""

from __future__ import annotations

from typing import Callable

from mg_server.wire import protocol as P


def catch_up(todo: list[tuple[str, object, int]], chunk: int, item_at: Callable[[str, object, int], P.VerifyItem],
             call: Callable[[list[P.VerifyItem]], list], audit: Callable[[str, object, P.VerifyResult], None]) -> None:
    """For each (rid, st, pos) of todo send st.tokens[st.verifier_len:] until at most `chunk`
    tokens are left before position pos (the caller's own call sends those). item_at(rid, st, p):
    the item that verifies position p; call(items): their results (VerifyResult or ErrorReply),
    in order; audit(rid, st, result). A failed chunk sets its request's `error` and ends its
    catch-up; the others go on."""
    while behind := [(rid, st) for rid, st, pos in todo if not st.error and pos + 1 - st.verifier_len > chunk]:
        ends = [st.verifier_len + chunk for _, st in behind]  # a call covers verifier_len .. end-1
        results = call([item_at(rid, st, end - 1) for (rid, st), end in zip(behind, ends)])
        for (rid, st), end, res in zip(behind, ends, results):
            if isinstance(res, P.ErrorReply):
                st.error = f"verifier (catch-up): [{res.code}] {res.message}"
                continue
            audit(rid, st, res)
            st.verifier_len = end
