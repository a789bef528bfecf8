"""Control messages between mg processes (msgspec structs over zmq; one module, one version).

Wire format: one zmq frame holding the msgpack encoding of a tagged `Message` union. Messages
carry token ids, positions and margins: never tensors or pickles (SGLang's weights reach the
verifier once, through wire.weights).

Positions (the convention every mg process uses):
  A request's tokens are t_0 .. t_{n-1} (prompt) then the emitted tokens. The decode step at
  position p reads input token t_p, writes the **K/V column of position p** (the K after RoPE and
  the V that the model computes for the input token t_p at position p, for every layer) and
  produces the logits that choose t_{p+1}. The prefill's last position is the first step.

Decoding rule (per request): greedy (temperature 0: t_{p+1} = argmax of the logits at p) or
seeded sampling (temperature > 0 with a seed: t_{p+1} = argmax of logits / T + Gumbel noise of
(seed, p), `mg_server.verifier.sampling`); margins are then T * (top1 - top2) of those scores.
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 17  # 4: seeded sampling (temperature, seed), weights_digest; 5: Finish end rules, corrections;
# 10: window commit (StepRow.epoch, Rollback, CheckTail); 11: the window commit is the only one: Step is
# one-way (no StepReply), WindowNews replaces Stops, and the other commits' fields and messages are gone;
# 12: Finish.epoch, Finish one-way, ControllerInfo.verifier_max_requests; 13: a K/V column only on
# request (VerifyItem.want_column); 14: StepRow.due (a held end's surplus); 15: no K/V slot buffer (ShmSpec,
# want_column, slot/gen gone), the verifier on SGLang's weights (HelloReply.shared_weights,
# ControllerInfo.verifier_dtype); 16: one model identity (model_id; weights_digest gone); 17: the prefix cache
# (VerifyResult.reused, StatsReply.cached_tokens / reused_rows) and Arrive (a prompt at its arrival)


class ErrorCode:
    """Typed error codes of `ErrorReply` (strings on the wire, so logs stay readable)."""

    BAD_REQUEST = "bad_request"  # undecodable or malformed message
    PROTOCOL_MISMATCH = "protocol_mismatch"  # client and server speak different versions
    MODEL_MISMATCH = "model_mismatch"  # the client expected another model / kernel config
    UNKNOWN_REQUEST = "unknown_request"  # no shadow cache for rid and the message is not a start
    POSITION_MISMATCH = "position_mismatch"  # caller and verifier disagree on the prefix length
    TOO_LONG = "too_long"  # pos + 1 > max_seq_len
    NO_CAPACITY = "no_capacity"  # out of request entries or K/V pool tokens
    DEADLINE = "deadline"  # the request's deadline passed before the verifier started it
    LOAD_FAILED = "load_failed"  # the verifier could not load the model (start-up fails with this)
    TIMEOUT = "timeout"  # client side: no reply in time (never sent by the server)
    PEER_DOWN = "peer_down"  # client side: the serving process died or stopped beating (liveness)
    INTERNAL = "internal"  # unexpected exception in the worker (it keeps serving)


class Message(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    msg_id: int = 0  # chosen by the client; echoed in the reply (stale replies are dropped)


class Hello(Message):
    protocol_version: int
    client: str = ""
    expect_model_id: str = ""  # "" = accept any
    expect_kernel_config_id: str = ""


class HelloReply(Message):
    protocol_version: int
    model_id: str  # mg_server.checkpoint.model_identity: the description and the weights' content
    kernel_config_id: str
    family: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    dtype: str
    device: str
    max_seq_len: int
    max_requests: int
    pool_tokens: int = 0  # shadow K/V pool capacity (tokens, all requests)
    memory_bytes: int = 0  # device memory the worker holds after loading (CUDA; 0 on CPU)
    shared_weights: bool = False  # it computes on SGLang's own tensors (CUDA), not on a copy
    ready: bool = True  # False: its K/V pool is allocated, SGLang's weights not yet mapped (verifier.server)


class VerifyItem(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Verify the step at position `pos` of request `rid`.

    `tokens` are t_start .. t_pos, with start = pos + 1 - len(tokens): the tokens the verifier has
    not seen yet (the first item for a request carries the whole prompt, start = 0). The verifier
    teacher-forces them, then answers for position pos. start must equal the verifier's known
    length, except with `rewind`, which first drops the verifier's positions >= start.
    """

    rid: str
    pos: int
    tokens: list[int]
    rewind: bool = False
    prompt_len: int = 0  # first item only: prompt tokens (not audited); 0 = all of this item's tokens
    want_digest: bool = False  # reply with a blake2b digest of the fp32 logits row of pos
    temperature: float = 0.0  # decoding rule of every position of this item: 0 greedy, > 0 seeded sampling
    seed: int = 0  # the sampling seed (mod 2**64), with temperature > 0
    deadline_ns: int = 0  # time.time_ns() after which the worker answers DEADLINE unstarted


class Verify(Message):
    """One or more items; the worker serves them in batched forwards (one rid per forward)."""

    items: list[VerifyItem]


class VerifyResult(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    rid: str
    pos: int
    token: int  # the verifier's token t_{pos+1} under the item's rule (argmax, ties -> lower id)
    margin: float  # top1 - top2 logit at pos, fp32 (sampling: T * (top1 - top2) of the scores)
    audit_tokens: list[int] = []  # verifier argmax at positions start .. pos-1 (predicts start+1..pos);
    #                               sampling: of the scores, except at positions < prompt_len - 1 (greedy)
    audit_margins: list[float] = []  # their margins
    first_mismatch: int = -1  # first q in [start-1, pos-1], q+1 >= prompt_len, whose verifier
    #                           token != the caller's t_{q+1} (a missed flip), -1 if none
    digest: bytes = b""
    reused: int = 0  # leading positions of the item mapped from the verifier's prefix cache (their
    #                 audit entries: -1 / NaN, prompt rows decide nothing)
    batch_rows: int = 0  # rows computed in the forward that served this item (for tests and metrics)
    batch_requests: int = 0  # requests in that forward
    forward_ms: float = 0.0


class ErrorReply(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    code: str
    message: str
    rid: str = ""
    expected_pos: int = -1  # POSITION_MISMATCH: the position the verifier expects next (= start)


class VerifyReply(Message):
    results: list[VerifyResult | ErrorReply]  # one per item, in order


class Release(Message):
    """Free the shadow caches of finished or aborted requests (unknown rids are ignored)."""

    rids: list[str]


class Stats(Message):
    pass


class StatsReply(Message):
    requests: int
    pool_tokens_used: int
    pool_tokens: int
    served_items: int
    forwards: int
    errors: int
    cached_tokens: int = 0  # pool slots held by the prefix cache's blocks no request maps now
    reused_rows: int = 0  # positions mapped from the prefix cache so far (rows not computed)


class Shutdown(Message):
    pass


class Ack(Message):
    n: int = 0


class Error(Message):
    """A message-level error (the whole request failed)."""

    error: ErrorReply



# ---- hook / front <-> controller ---------------------------------------------------------


class ControllerHello(Message):
    protocol_version: int
    client: str = ""


class ControllerInfo(Message):
    protocol_version: int
    mode: str  # "off" | "margin" | "always"
    tau: float
    verifier_up: bool
    kernel_config_id: str = ""
    model_id: str = ""  # the verifier's model identity (OpenAI's system_fingerprint hashes it)
    verifier_device: str = ""
    verifier_dtype: str = ""  # its model and K/V dtype: SGLang's K/V pool must be the same (seam/hook.py)
    verifier_pool_tokens: int = 0
    verifier_max_requests: int = 0  # shadow caches the verifier holds at once (the front admits that many)
    verifier_memory_bytes: int = 0


class StepRow(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One protected request's step in a fast-path forward (positions as in the module doc)."""

    rid: str
    pos: int  # position of the input token of this step; the logits choose t_{pos+1}
    prompt: list[int] = []  # t_0 .. t_pos on the request's first step only; later t_pos is the
    #                         token decided at the previous step, which the controller holds
    margin: float  # fast path's top1 - top2 logit at pos (fp32; sampling: of the perturbed scores, x T)
    fast_token: int  # fast path's argmax at pos (sampling: of the perturbed scores)
    temperature: float = 0.0  # first step only, with the prompt: the request's decoding rule
    seed: int = 0  #            (see the module doc); 0 = greedy
    # The row was committed fast and its request is rolled back in place where the verifier
    # disagrees; `epoch` counts the request's rollbacks the seam has applied (a row of an older
    # epoch belongs to a timeline the controller has cut already, and is dropped).
    epoch: int = 0
    # A streamed request: this step's token may leave before it is checked (every step since the
    # last checked one had margin >= tau); a disagreement there is a missed flip.
    released: bool = False
    # A held end's surplus (seam/rollback.py): SGLang ended the request with unchecked tokens and
    # decodes on while they are checked; the controller checks them at once.
    due: bool = False


class Arrive(Message):
    """A deterministic request reached SGLang's scheduler (one way, before its first forward): the
    controller has the verifier compute its prompt now, beside SGLang's prefill, so that its first
    answer token is checked when its first step comes."""

    rid: str
    prompt: list[int]  # t_0 .. t_{n-1}
    temperature: float = 0.0  # its decoding rule (as StepRow's)
    seed: int = 0


class Step(Message):
    """One fast-path forward's protected rows, every one committed fast by the seam (one-way:
    nothing is sent back; the controller checks them behind, controller/window.py)."""

    rows: list[StepRow]


class Finish(Message):
    """A protected request ended. `output` is every token SGLang emitted for it; the controller
    checks it against the tokens it decided (under the overlap scheduler it may have decided
    one step more than SGLang kept: the look-ahead forward after the last token)."""

    rid: str
    output: list[int]
    aborted: bool = False  # ended by an abort (client, /abort_request, shutdown, mg): a cut answer
    reason: str = ""  # the abort's message, for the verdict
    epoch: int = 0  # the rollbacks the seam applied: an abort can land before it applied the latest
    # How SGLang ends this request (its check_finished, token rules only), so the controller can
    # complete a missed flip's answer from the verifier the way SGLang would have ended it.
    max_new: int = 0  # max_new_tokens (0: unknown, no correction)
    stop_ids: list[int] = []  # token ids that end it (empty with ignore_eos)
    correctable: bool = False  # False: stop strings / regexes or a grammar end it (text rules mg does not model)


class Correction(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A missed flip's answer completed by the verifier: what the front puts in the response."""

    original: list[int]  # the answer SGLang emitted (the front checks the response holds it)
    output: list[int]  # the corrected answer: SGLang's up to the missed flip, then the verifier's
    first: int  # index in the answer of the first replaced token
    finish: str  # "stop" (a stop token ended it) or "length" (max_new tokens)


class WindowNews(Message):
    """The seam asks for the controller's news: rollbacks to apply, how much is checked."""


class Rollback(msgspec.Struct, kw_only=True):
    """A request's disagreement: answer index `index` becomes the verifier's `token`, the answer
    after it is dropped, and the request's later steps carry `epoch`."""

    rid: str
    index: int
    token: int
    epoch: int


class WindowNewsReply(Message):
    rollbacks: list[Rollback] = []  # requests to roll back (each named once)
    # live requests: rid -> [epoch, answer tokens the verifier checked in that epoch]
    verified: dict[str, list[int]] = {}


class CheckTail(Message):
    """The seam's finish barrier: check every decided token of a request now."""

    rid: str


class TailReply(Message):
    rollback: Rollback | None = None  # a disagreement (also one not yet told in a StopsReply)
    epoch: int = 0
    verified: int = 0  # answer tokens checked in `epoch`
    error: str = ""  # the request failed (its verdict says so)


class Verdict(Message):
    rid: str
    # The asker can replace the answer (a non-streamed response): a request whose audit found a
    # missed flip is then completed from that position by the verifier instead of `mismatch`.
    correct: bool = False


class VerdictState:
    """The states of a request's verdict (strings on the wire). A request is `running` until its
    Finish and tail audit; then exactly one of the others. Only `verified` says that the answer is
    complete and every token of it was checked against the verifier."""

    UNKNOWN = "unknown"  # the controller never saw the request (or forgot it)
    RUNNING = "running"
    VERIFIED = "verified"
    MISMATCH = "mismatch"  # complete, but the audit found a token the verifier would not emit
    FAILED = "failed"  # mg could not serve it deterministically (verifier down, timeout, ...)
    ABORTED = "aborted"  # cut short before its natural end: its answer is incomplete
    UNVERIFIED = "unverified"  # mode off: nothing checked the tokens


class VerdictReply(Message):
    rid: str
    state: str  # one of VerdictState
    steps: int = 0
    verified_steps: int = 0
    repairs: int = 0
    mismatch_positions: list[int] = []
    error: str = ""
    correction: Correction | None = None  # with state verified: the answer to send instead of SGLang's


AnyMessage = (Hello | HelloReply | Verify | VerifyReply | Release | Stats | StatsReply | Shutdown
              | Ack | Error | ControllerHello | ControllerInfo | Arrive | Step | Finish | Verdict
              | VerdictReply | WindowNews | WindowNewsReply | CheckTail | TailReply)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMessage)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    return _decoder.decode(data)
