"""Chunked catch-up: the tokens a verifier has not seen go to it in calls of bounded size.

A request's first verified step carries its whole prompt, and in margin mode a verified step
(or the final audit) carries every fast-committed token since the last one. Sent as one call,
a 2000-token prompt took the CPU verifier longer than the verify timeout. Sent in chunks of
`chunk` tokens, each call is bounded by the timeout on its own; each chunk's result is audited
like any catch-up (its token is the verifier's next-token prediction, checked by the next call).
"""

from __future__ import annotations

from typing import Callable

from mg_server.wire import protocol as P


def catch_up(vclient, item_at: Callable[[int], P.VerifyItem], audit: Callable[[P.VerifyResult], None],
             st, pos: int, chunk: int) -> str:
    """Send st.tokens[st.verifier_len:] in chunks until at most `chunk` tokens are left before
    position pos (the caller's own call sends those); returns an error message or ""."""
    from mg_server.verifier.client import VerifierError

    while pos + 1 - st.verifier_len > chunk:
        end = st.verifier_len + chunk  # this call covers positions verifier_len .. end-1
        try:
            (res,) = vclient.verify_many([item_at(end - 1)])
            if isinstance(res, P.ErrorReply):
                raise VerifierError(res.code, res.message)
        except VerifierError as e:
            return f"verifier (catch-up): [{e.code}] {e.message}"
        audit(res)
        st.verifier_len = end
    return ""
