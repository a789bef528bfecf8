"""Chunked catch-up: the tokens a verifier has not seen go to it in calls of bounded size.

A request's first check carries its whole prompt, and every check (or the final audit) carries
the tokens committed fast since the one before. Sent as one call, a 2000-token prompt took the
CPU verifier longer than the verify timeout, so a backlog longer than a chunk goes in chunks,
each call bounded by the timeout on its own; each chunk's result is audited like any catch-up
(its token is the verifier's next-token prediction, checked by the next call). A chunk is as
many rows as one verify call may carry (`Controller._rows_per_call`), so a backlog that fits a
call goes in the check's own item, packed with the other requests' into as few calls as the
verifier accepts: on a GPU a prompt of up to 4,096 tokens takes no call of its own.
"""

from __future__ import annotations

from typing import Callable

from mg_server.wire import protocol as P


def catch_up(st, pos: int, chunk: int, item_at: Callable[[int], P.VerifyItem],
             call: Callable[[list[P.VerifyItem]], list], audit: Callable[[P.VerifyResult], None]) -> str:
    """Send st.tokens[st.verifier_len:] in calls of `chunk` tokens until at most `chunk` are left
    before position pos (the caller's own call sends those); returns an error message or "".
    item_at(p): the item that verifies position p; call(items): their results (VerifyResult or
    ErrorReply); audit(result)."""
    while pos + 1 - st.verifier_len > chunk:
        end = st.verifier_len + chunk  # this call covers positions verifier_len .. end-1
        (res,) = call([item_at(end - 1)])
        if isinstance(res, P.ErrorReply):
            return f"verifier (catch-up): [{res.code}] {res.message}"
        audit(res)
        st.verifier_len = end
    return ""
