"""The frozen configuration of one `mg-server calibrate` run (built by the CLI only)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class CalibrationConfig:
    model_path: str  # HF checkpoint folder: served by SGLang and loaded by the reference engine
    prompt_sets: tuple[str, ...]  # "humaneval" | "sharegpt" | FILE.jsonl; the first one picks tau,
    #                               the others are transfer checks at that tau
    batch_sizes: tuple[int, ...]  # rows per batched /generate, each a separate measurement
    max_tokens: int  # generated tokens per prompt (every position is measured)
    limit: int  # prompts per set (the first `limit` of the set)
    out_dir: str  # profile.json, calibration.png, cache/ (results per set and batch size)
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
