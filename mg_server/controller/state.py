"""A protected request's bookkeeping in the controller, and its verdict.

The verdict is a small state machine: `running` from the request's first step until its Finish
and tail audit, then exactly one of `failed` (mg could not serve it deterministically),
`mismatch` (the audit found a token the verifier would not have emitted), `aborted` (cut short
before its natural end: client, /abort_request, mg; its answer is incomplete), `verified`
(complete, every emitted token checked; or, after a missed flip, the answer completed by the
verifier from that position, which the front sends instead of SGLang's) or, in mode off,
`unverified`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mg_server.wire.protocol import Correction, Finish
from mg_server.wire.protocol import VerdictState as S


@dataclass
class ReqState:
    tokens: list[int] = field(default_factory=list)  # t_0 .. t_{n-1}: the prompt, then every decided token
    prompt_len: int = 0  # the first step's tokens are the prompt (not audited)
    temperature: float = 0.0  # decoding rule (protocol module doc): 0 greedy, > 0 seeded sampling
    seed: int = 0
    verifier_len: int = 0  # the verifier has been sent t_0 .. t_{verifier_len-1}
    verified: list[int] = field(default_factory=list)  # positions computed by the verifier
    repairs: list[int] = field(default_factory=list)  # verified positions where it disagreed
    mismatches: list[int] = field(default_factory=list)  # positions q whose t_{q+1} was a missed flip
    error: str = ""
    finished_at: float = 0.0  # monotonic time of Finish; 0 while running
    aborted: str = ""  # why SGLang aborted it ("" = it ended normally): its answer is incomplete
    audit_pending: bool = False  # finished, tail audit not run yet
    end: Finish | None = None  # how SGLang ended it (max_new, stop ids), from its Finish
    correction: Correction | None = None  # the verifier's completion after a missed flip
    pred: int = -1  # the verifier's latest prediction: its token t_{verifier_len} (-1: none yet)
    pred_margin: float = 0.0  # and the margin it chose it with
    flip_token: int = -1  # the verifier's token at the first missed flip (t_{min(mismatches)+1})
    epoch: int = 0  # rollbacks so far (its Step rows carry the epoch the seam applied)
    checked: int = 0  # answer tokens checked by the verifier
    released: int = 0  # a stream: answer tokens the seam let leave before their check
    rewind: bool = False  # the verifier holds positions past a rollback: the next item drops them
    last_rollback: object = None  # the latest protocol.Rollback (the finish barrier re-tells it)
    due_from: int | None = None  # a held end's length: the answer index of its first surplus row
    margins: list[float] = field(default_factory=list)  # the fast margin of each answer token (-1: the verifier's)
    arrived_at: float = 0.0  # monotonic time of its Arrive while no step has come (0: it has stepped)
    freed: bool = False  # its verifier K/V released before its Finish (a checked held end: controller/pool.py)
    block_keys: tuple[int, ...] | None = None  # its prompt's whole blocks (controller/pool.prompt_blocks)

    @classmethod
    def of_prompt(cls, prompt: list[int], temperature: float, seed: int, **fields) -> "ReqState":
        """A request's state from its prompt and decoding rule (its Arrive, or its first step)."""
        return cls(tokens=list(prompt), prompt_len=len(prompt), temperature=temperature, seed=seed, **fields)

    @property
    def steps(self) -> int:
        return len(self.tokens) - self.prompt_len

    def state(self, mode: str) -> str:
        if self.error:
            return S.FAILED
        if not self.finished_at or self.audit_pending:
            return S.RUNNING
        if self.mismatches:
            return S.VERIFIED if self.correction is not None and not self.aborted else S.MISMATCH
        if self.aborted:  # a cut answer is never `verified`, however many of its tokens were checked
            return S.ABORTED
        return S.VERIFIED if mode != "off" else S.UNVERIFIED

    def reconcile_cut(self, output: list[int], index: int) -> None:
        """An aborted answer's emitted tokens against the decided ones up to answer index `index`,
        where a rollback the seam never applied cut mg's copy (a difference sets `error`)."""
        if self.tokens[self.prompt_len:self.prompt_len + index] != output[:index]:
            self.error = "an aborted answer differs from mg's before its last rollback"

    def reconcile(self, output: list[int]) -> int:
        """Check SGLang's emitted tokens against the decided ones (a difference sets `error`);
        returns how many decided steps it dropped: the overlap scheduler's look-ahead forward(s)
        after the last token, whose tokens SGLang never emits."""
        decided = self.tokens[self.prompt_len:]
        if len(decided) < len(output):
            self.error = f"mg decided {len(decided)} tokens but SGLang emitted {len(output)}: a step was not seen"
            return 0
        if decided[:len(output)] != output:
            q = next(k for k, (a, b) in enumerate(zip(decided, output)) if a != b)
            self.error = f"emitted token {q} differs from the one mg decided"
            return 0
        extra = len(decided) - len(output)
        if extra:
            n = len(self.tokens) - extra
            del self.tokens[n:]
            self.verified = [q for q in self.verified if q <= n - 2]
            self.repairs = [q for q in self.repairs if q <= n - 2]
            self.mismatches = [q for q in self.mismatches if q <= n - 2]
            del self.margins[n - self.prompt_len:]
        return extra
