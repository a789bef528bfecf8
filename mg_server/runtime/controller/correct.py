"""A missed flip corrected rather than only flagged.

When the audit finds that a fast-committed token differs from the verifier's (a flip whose
margin was above tau), the answer after it is not the reference's: every later token was
computed from the wrong one. For a response that has not left yet (non-streamed), the
controller re-decodes the answer with the verifier from that position, ending it by SGLang's
own token rules (max_new_tokens first, then the stop ids, as `Req.check_finished` does), so
the answer sent equals the verifier-alone reference; the front swaps it into the response.

The verifier has usually released the request's shadow cache by then (after the tail audit), so
the first item resends the agreed prefix t_0 .. t_q from position 0; each later item is one token.
"""

from __future__ import annotations

import time

from mg_server.runtime import protocol as P
from mg_server.runtime.controller.state import ReqState


def complete_answer(vclient, rid: str, st: ReqState, item_timeout_s: float) -> P.Correction:
    """The verifier's completion of `st` from its first missed flip. Raises VerifierError."""
    from mg_server.runtime.verifier.client import VerifierError

    end = st.end
    q = min(st.mismatches)  # t_0 .. t_q agree with the verifier; t_{q+1} was the missed flip
    tokens = list(st.tokens[:q + 1])  # [q + 1] ids: prompt, then the answer up to the flip
    stop = set(end.stop_ids)
    finish = ""
    key = f"{rid}#correct"  # its own shadow cache: never mixes with a live request of the same rid
    vclient.release([key], timeout_s=item_timeout_s)
    try:
        first = True
        while not finish:
            pos = len(tokens) - 1
            sent = list(tokens) if first else tokens[-1:]
            item = P.VerifyItem(rid=key, pos=pos, tokens=sent, prompt_len=st.prompt_len if first else 0,
                                temperature=st.temperature, seed=st.seed,  # the request's own rule
                                deadline_ns=time.time_ns() + int(item_timeout_s * 1e9))
            (res,) = vclient.verify_many([item], timeout_s=item_timeout_s)
            if isinstance(res, P.ErrorReply):
                raise VerifierError(res.code, res.message)
            first = False
            tokens.append(res.token)
            # SGLang's order: the length limit first, then the token rules
            if len(tokens) - st.prompt_len >= end.max_new:
                finish = "length"
            elif res.token in stop:
                finish = "stop"
    finally:
        vclient.release([key], timeout_s=item_timeout_s)
    return P.Correction(original=st.tokens[st.prompt_len:], output=tokens[st.prompt_len:],
                        first=q + 1 - st.prompt_len, finish=finish)


def resume_point(st: ReqState) -> P.Correction:
    """A resumable request's correction (server module doc): its answer up to the first missed
    flip, then the verifier's token there (found by the check or audit that saw the flip). Unless
    that token ends the answer by SGLang's rules, the front resumes it from there on the fast
    path: no verifier decoding here, and the continuation is margin-gated like any request."""
    end = st.end
    q = min(st.mismatches)
    out = st.tokens[st.prompt_len:q + 1] + [st.flip_token]
    finish = "length" if len(out) >= end.max_new else "stop" if st.flip_token in set(end.stop_ids) else ""
    corr = P.Correction(original=st.tokens[st.prompt_len:], output=out, first=q + 1 - st.prompt_len, finish=finish)
    if not finish:
        corr.resume, corr.resume_ids, corr.max_new = True, st.tokens[:q + 1] + [st.flip_token], end.max_new - len(out)
        corr.stop_ids, corr.temperature, corr.seed = list(end.stop_ids), st.temperature, st.seed
    return corr


def can_correct(st: ReqState, mode: str) -> bool:
    """A complete answer with a missed flip whose end rules mg models."""
    e = st.end
    return (mode != "off" and bool(st.mismatches) and not st.error and not st.aborted and e is not None
            and e.correctable and e.max_new > 0 and len(st.tokens) > st.prompt_len
            and (st.flip_token >= 0 or not st.resumable))
