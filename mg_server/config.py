"""Frozen configurations handed to each process entry point (never read from globals)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

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
# costs no extra weight read: launch/seams.fp32_logits_in_place), and `mg-server calibrate` to its
# fast-path server on CUDA, so a profile's margins are the served ones. Why: bf16 logits round
# near-ties into exact ties that the fast path breaks by token id where the verifier's fp32
# logits do not tie; on the 8B shape and on SmolLM2's real weights it took ~40 % of the flips
# away (docs/history/window-verification.md).
FP32_LOGITS_ARGS = ("--enable-fp32-lm-head",)


@dataclass(frozen=True)
class HookConfig:
    """Config of the forward hook that runs inside SGLang's scheduler process.

    Travels through SGLang's `--forward-hooks` JSON, so every field is JSON-serialisable.
    """

    metrics_dir: str  # prometheus multiprocess folder shared with the front
    margin_buckets: tuple[float, ...] = MARGIN_BUCKETS
    controller_ipc: str = ""  # "" = no controller: only count steps and margins
    step_timeout_s: float = 60.0  # the longest wait for the controller (the finish barrier's check of a request)

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
    max_deterministic: int = 64  # deterministic completions in SGLang at once: the verifier's shadow caches
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
    run_dir: str = ""  # ipc sockets of this instance's controller and verifier
    kv_budget_gb: float | None = None  # CUDA: the verifier's K/V pool in GB (None: verifier.budget's default)
    drain_timeout_s: float = 30.0  # SIGTERM: the longest wait for requests to drain before stopping
    verify_timeout_s: float = 30.0  # one verifier call (a catch-up chunk or a verify step)
    catchup_chunk: int = 256  # tokens per verifier call when it catches up
    verdict_wait_s: float = 120.0  # a response's longest wait for its verdict
    window: int = 32  # unchecked tokens a deterministic request may run ahead of its checks (--mg-window)
    queue_size: int = 256  # deterministic requests that wait for the verifier before a 429 (--mg-queue)
    allow_sglang: str = ""  # an untested SGLang version the user accepts (--mg-allow-sglang; seams.check)

    @property
    def cpu(self) -> bool:
        return self.profile == "cpu"
