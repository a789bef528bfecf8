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

from mg_server.controller.state import ReqState
from mg_server.wire import protocol as P


class AnswerCompletion:
    """The verifier's completion of `st` from its first missed flip, a few verify calls at a time.

    Why in slices: the controller is single-threaded, and a completion is one verify call per
    token (hundreds on a long answer: ~0.2 s on an H100, seconds on a CPU). Run in one go, it would
    hold up every deterministic forward's Step meanwhile. The front asks for the verdict again
    every 10 ms while it reads `running`, so each ask advances the completion by one slice and
    Steps are served in between (controller.audit._verdict)."""

    def __init__(self, rid: str, st: ReqState, item_timeout_s: float):
        self.st, self.item_timeout_s = st, item_timeout_s
        self.q = min(st.mismatches)  # t_0 .. t_q agree with the verifier; t_{q+1} was the missed flip
        self.tokens = list(st.tokens[:self.q + 1])  # [q + 1] ids: prompt, then the answer up to the flip
        self.stop = set(st.end.stop_ids)
        self.finish = ""
        self.key = f"{rid}#correct"  # its own shadow cache: never mixes with a live request of the same rid
        self.calls = 0

    def advance(self, vclient, budget_s: float = float("inf")) -> P.Correction | None:
        """Verify calls until the answer is complete (-> its Correction) or `budget_s` has passed
        (-> None; at least one call is made). Raises VerifierError (the shadow cache released)."""
        from mg_server.verifier.client import VerifierError

        st, end = self.st, self.st.end
        t_end = time.monotonic() + budget_s
        try:
            if self.calls == 0:
                vclient.release([self.key], timeout_s=self.item_timeout_s)
            while not self.finish:
                pos = len(self.tokens) - 1
                first = self.calls == 0
                sent = list(self.tokens) if first else self.tokens[-1:]
                item = P.VerifyItem(rid=self.key, pos=pos, tokens=sent, prompt_len=st.prompt_len if first else 0,
                                    temperature=st.temperature, seed=st.seed,  # the request's own rule
                                    deadline_ns=time.time_ns() + int(self.item_timeout_s * 1e9))
                (res,) = vclient.verify_many([item], timeout_s=self.item_timeout_s)
                if isinstance(res, P.ErrorReply):
                    raise VerifierError(res.code, res.message)
                self.calls += 1
                self.tokens.append(res.token)
                # SGLang's order: the length limit first, then the token rules
                if len(self.tokens) - st.prompt_len >= end.max_new:
                    self.finish = "length"
                elif res.token in self.stop:
                    self.finish = "stop"
                if not self.finish and time.monotonic() >= t_end:
                    return None
        except BaseException:
            self.release(vclient)
            raise
        self.release(vclient)
        return P.Correction(original=st.tokens[st.prompt_len:], output=self.tokens[st.prompt_len:],
                            first=self.q + 1 - st.prompt_len, finish=self.finish)

    def release(self, vclient) -> None:
        """Free the completion's shadow cache (also for one given up on)."""
        try:
            vclient.release([self.key], timeout_s=self.item_timeout_s)
        except Exception:  # noqa: BLE001 - the verifier evicts idle caches anyway
            pass


def can_correct(st: ReqState, mode: str) -> bool:
    """A complete answer with a missed flip whose end rules mg models."""
    e = st.end
    return (mode != "off" and bool(st.mismatches) and not st.error and not st.aborted and e is not None
            and e.correctable and e.max_new > 0 and len(st.tokens) > st.prompt_len)
