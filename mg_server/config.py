"""Frozen configurations handed to each process entry point (never read from globals).

One config per process (the verifier, the controller, the front, the seam's hook), the command's
own (`ServeConfig`, `CalibrationConfig`), and every default written once here: a setting that
several configs carry takes its default from the process that uses it, and `launch/cli.py`'s
flags take theirs from these fields.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mg_server.checkpoint import Checkpoint

# The key mg sets in a request's `custom_params`; SGLang carries it to the model forward.
DETERMINISTIC_PARAM = "mg_deterministic"
# Seeded sampling of a deterministic request (temperature > 0): the front sets both, SGLang itself
# then decodes greedily (temperature 0) over the logits mg forces to its sampled token.
TEMPERATURE_PARAM = "mg_temperature"
SEED_PARAM = "mg_seed"  # int in [0, 2**64)

# The key of one request instance (set by the front beside the flag): mg's bookkeeping (the
# seam's token lists, the controller's states, verdicts) is per instance, so a client that
# reuses a request id never gets, or disturbs, another instance's state.
INSTANCE_PARAM = "mg_instance"
# The server's mark beside the flag (a random value of this start that only the front knows, set in
# the scheduler's environment: env.request_mark): SGLang's scheduler runs mg's processor, and the
# seam protects a row, only with it (seam/guard.py), so no client can pose as deterministic.
MARK_PARAM = "mg_mark"


def instance_key(rid: str, instance: str | None) -> str:
    return f"{rid}#{instance}" if instance else rid


# Top-1/top-2 logit margin histogram buckets (logit units) of mg_margin and mg_flip_margin: the
# same edges, so their ratio is a flip's odds by margin. Flips were observed at margins <= 0.25 on
# H200 (ENVIRONMENT.md), so the low end is finely divided.
MARGIN_BUCKETS: tuple[float, ...] = (0.005, 0.01, 0.02, 0.03, 0.05, 0.0625, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3,
                                     0.5, 0.75, 1.0, 1.5, 2.0, 4.0, 8.0, 16.0)

# SGLang's switch for the fast path's logits in fp32: mg passes it on CUDA with mg on (where it
# costs no extra weight read: launch/sglang_facts.fp32_logits_in_place), and `mg-server calibrate` to its
# fast-path server on CUDA, so a profile's margins are the served ones. Why: bf16 logits round
# near-ties into exact ties that the fast path breaks by token id where the verifier's fp32
# logits do not tie; on the 8B shape and on SmolLM2's real weights it took ~40 % of the flips
# away (docs/history/window-verification.md).
FP32_LOGITS_ARGS = ("--enable-fp32-lm-head",)


@dataclass(frozen=True)
class VerifierConfig:
    """Config of the verifier worker (verifier/server.py)."""

    model_path: str  # Hugging Face checkpoint folder (config.json + *.safetensors)
    ipc_path: str  # filesystem path of the ipc:// socket, unique per worker instance (its folder: the run folder)
    # the checkpoint as the launcher read it (mg_server.checkpoint); None: read from model_path
    model: Checkpoint | None = None
    dtype: str = "bfloat16"  # model dtype (weights, activations, K/V); logits are fp32
    device: str = "cpu"  # "cpu" | "cuda" | "cuda:N"
    max_seq_len: int = 4096  # longest request (positions) the verifier accepts
    max_requests: int = 64  # shadow caches held at once (the front admits as many deterministic completions)
    # K/V pool capacity in tokens, shared by all requests; on CUDA 0 sizes it by verifier.budget (a
    # restart gets the first worker's: the front and the seam keep its facts)
    pool_tokens: int = 16384
    # when the pool is full, the least recently used requests a forward does not need are dropped (the
    # controller computes an evicted one again from position 0: the pool is a cache, verifier.budget)
    evict_idle_s: float = 0.0
    max_batch_items: int = 64  # items per message and coalesced into one step
    tp: int = 1  # tensor-parallel ranks: one process each, rank 0 serving (verifier/ranks.py; a CPU only for now)
    num_threads: int = 0  # torch CPU threads (0: leave torch's default); results do not depend on it
    kv_budget_gb: float = 0.0  # CUDA: the K/V pool's size (0: verifier.budget's default share)
    # CUDA: SGLang's --mem-fraction-static (its K/V estimate for the default; SGLang's own default when
    # not given: 0.907 on an H200, 0.835 on an H100)
    sglang_fraction: float = 0.9
    weights_bytes: int = 0  # CUDA: the checkpoint's weight bytes (the same estimate)
    weights_timeout_s: float = 1800.0  # CUDA: the longest wait for SGLang's weights (its model load)
    poll_ms: int = 50  # receive poll period
    parent_pid: int = 0  # the process that started the worker: it exits once that one is gone (0: no watch)
    trace_calls: int = 0  # diagnostics (env.trace_calls): 1 log each call's phases and GC pauses, 2 + CUDA allocations

    @property
    def endpoint(self) -> str:
        return "ipc://" + self.ipc_path


@dataclass(frozen=True)
class ControllerConfig:
    """Config of the controller process (controller/server.py)."""

    ipc_path: str  # filesystem path of this controller's ipc:// socket
    mode: str  # "off" | "margin" | "always"
    tau: float
    metrics_dir: str  # prometheus multiprocess folder (set in the env before metrics exist)
    verifier: VerifierConfig | None = None  # the worker's (None: mode "off")
    verify_timeout_s: float = 30.0  # per verify call: a live, beating verifier that does not answer (wedged)
    catchup_chunk: int = 256  # tokens per catch-up call: verify_timeout_s bounds a chunk, not a long prompt
    start_timeout_s: float = 300.0  # verifier model load
    verdict_ttl_s: float = 900.0  # how long a finished request's verdict is kept
    parent_pid: int = 0  # mg-server's pid: the controller exits once it is gone (0: no watch)
    window: int = 32  # a request's unchecked tokens are checked once this many wait (--mg-window)
    # the beat's status until the first verifier is up (a restarted controller's says why: /health shows it)
    start_status: str = "verifier starting"


@dataclass(frozen=True)
class HookConfig:
    """Config of the forward hook that runs inside SGLang's scheduler process.

    Travels through SGLang's `--forward-hooks` JSON, so every field is JSON-serialisable.
    """

    metrics_dir: str  # prometheus multiprocess folder shared with the front
    margin_buckets: tuple[float, ...] = MARGIN_BUCKETS
    controller_ipc: str = ""  # "" = no controller: only count steps and margins
    # the longest wait for the controller (the finish barrier's check of a request); the launcher
    # raises it to a whole context's catch-up
    step_timeout_s: float = 60.0
    tp: int = 1  # SGLang's tensor-parallel ranks, each with a seam (seam/ranks.py); the verifier's too

    def to_json_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json_dict(cls, d: dict) -> "HookConfig":
        d = dict(d)
        d["margin_buckets"] = tuple(d.get("margin_buckets", MARGIN_BUCKETS))
        return cls(**d)


@dataclass(frozen=True)
class FrontConfig:
    """Config of the ASGI middleware in the HTTP process."""

    noop_processor: str  # serialized no-op SGLang custom logit processor (enables custom_params)
    metrics_dir: str
    controller_ipc: str = ""  # "" = no controller: no verdict headers
    kernel_config_id: str = ""  # the verifier's, reported on deterministic responses
    system_fingerprint: str = ""  # wire.fingerprint: weights + kernel configuration ("" in mode off)
    verdict_wait_s: float = 120.0  # how long a response waits for its request's final audit (CPU: long)
    model_path: str = ""  # its tokenizer spells a corrected answer's text ("" = no text rewrite)
    vocab_size: int = 0  # the model's: token ids in request bodies are checked against it (0: unchecked)
    api_key: str = ""  # SGLang's --api-key: /metrics (served by mg, ahead of SGLang's auth) needs it too
    # a larger request body is a 413 before anything parses or tokenizes it (a 20 MB prompt took
    # 64 s to be refused by SGLang's tokenizer); 16 MiB holds a 128k-token prompt many times over
    max_body_bytes: int = 16 << 20
    # deterministic completions in SGLang at once: the verifier's shadow caches (its hello says how many)
    max_deterministic: int = VerifierConfig.max_requests
    queue_size: int = 256  # deterministic requests waiting for one of them before a 429 (front.admission)
    request_mark: str = ""  # this start's mark of deterministic requests (MARK_PARAM; env.request_mark)
    served_models: tuple[str, ...] = ()  # the `model` names the OpenAI routes serve besides "default" (): any
    any_model: bool = False  # LoRA adapters are served: SGLang checks adapter names itself
    # a body that has not arrived by then is a 408 (a client that trickles bytes holds a connection
    # and its buffers); 30 s carries the 16 MiB limit over a 5 Mbit/s link
    body_timeout_s: float = 30.0


@dataclass(frozen=True)
class ServeConfig:
    model_path: str
    host: str
    port: int
    profile: str  # SGLang host profile (launch.compat): "cpu" | "cuda-bare" | "cuda"
    metrics_dir: str
    sglang_args: tuple[str, ...] = ()  # extra SGLang server flags, passed through verbatim
    mg_mode: str = "margin"  # "off" | "margin" | "always"
    mg_tau: float | None = None  # None: from tau_profile, else the model's shipped profile
    tau_profile: str | None = None  # a tau profile file (`serve --profile`, written by `mg-server calibrate`)
    # that file's content, read once by the command line (policy.read_profile)
    tau_profile_doc: dict | None = field(default=None, compare=False, hash=False)
    run_dir: str = ""  # ipc sockets of this instance's controller and verifier
    kv_budget_gb: float | None = None  # CUDA: the verifier's K/V pool in GB (None: verifier.budget's default)
    model: Checkpoint | None = None  # the checkpoint read once (None: no local config.json, mode off only)
    drain_timeout_s: float = 30.0  # SIGTERM: the longest wait for requests to drain before stopping
    # the settings below belong to one process each; their defaults are that process's
    verify_timeout_s: float = ControllerConfig.verify_timeout_s  # one verifier call (--mg-verify-timeout)
    catchup_chunk: int = ControllerConfig.catchup_chunk  # tokens per verifier call when it catches up
    verdict_wait_s: float = FrontConfig.verdict_wait_s  # a response's longest wait for its verdict
    window: int = ControllerConfig.window  # unchecked tokens a request may run ahead of its checks (--mg-window)
    queue_size: int = FrontConfig.queue_size  # requests that wait for the verifier before a 429 (--mg-queue)
    allow_sglang: str = ""  # an untested SGLang version the user accepts (--mg-allow-sglang; sglang_facts.check)

    @property
    def cpu(self) -> bool:
        return self.profile == "cpu"


@dataclass(frozen=True)
class CalibrationConfig:
    """The configuration of one `mg-server calibrate` run (built by the command line)."""

    model_path: str  # HF checkpoint folder: served by SGLang and loaded by the reference engine
    out_dir: str  # profile.json, calibration.png, cache/ (results per set and batch size)
    # "humaneval" | "sharegpt" | FILE.jsonl; the first one picks tau, the others are transfer checks at that tau
    prompt_sets: tuple[str, ...] = ("humaneval",)
    batch_sizes: tuple[int, ...] = (1, 4, 8, 16)  # rows per batched /generate, each a separate measurement
    max_tokens: int = 64  # generated tokens per prompt (every position is measured)
    limit: int = 16  # prompts per set (the first `limit` of the set)
    device: str = "cpu"  # "cpu" | "cuda": the fast path's server and the reference engine
    safety_factor: float | None = None  # None: derived from the data (sweep.choose_tau)
    server_args: tuple[str, ...] = ()  # extra SGLang flags for the fast path's server
    request_timeout_s: float = 3600.0  # one batched /generate (a CPU batch of 16 x 128 tokens: minutes)
    command: str = ""  # the command line, recorded in the profile

    def __post_init__(self):
        if not self.prompt_sets:
            raise ValueError("at least one prompt set is needed")
        if not self.batch_sizes or min(self.batch_sizes) < 1:
            raise ValueError(f"batch sizes must be >= 1, got {self.batch_sizes}")
        if self.max_tokens < 1 or self.limit < 1:
            raise ValueError("--max-tokens and --limit must be >= 1")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.safety_factor is not None and not self.safety_factor >= 1:
            raise ValueError(f"the safety factor must be >= 1, got {self.safety_factor}")
