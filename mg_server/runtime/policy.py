"""MarginGate policy: which protected steps go to the verifier.

Modes: `off` (never verify: plain SGLang), `margin` (verify when the fast path's top-1/top-2
logit margin is below tau), `always` (verify every step; the LLM-42-like upper bound on cost).
tau comes from a per-model profile (JSON under mg_server/profiles/) or an explicit value.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MODES = ("off", "margin", "always")
PROFILE_DIR = Path(__file__).resolve().parent.parent / "profiles"


@dataclass(frozen=True)
class Policy:
    mode: str
    tau: float

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not self.tau >= 0:
            raise ValueError(f"tau must be >= 0, got {self.tau!r}")

    def should_verify(self, margin: float) -> bool:
        if self.mode == "always":
            return True
        # margin < tau, strictly: with tau = 0 nothing is verified. NaN margins (broken
        # logits) compare false, so they are verified too.
        return self.mode == "margin" and not margin >= self.tau


def load_profile(model_name: str, profile_dir: Path = PROFILE_DIR) -> dict | None:
    """The calibration profile of a model (by checkpoint folder name), if one is shipped."""
    path = profile_dir / f"{model_name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def resolve_tau(model_path: str, tau: float | None, mode: str = "margin") -> tuple[float, str]:
    """(tau, where it came from): an explicit value wins, then the model's profile. Only mode
    margin reads tau; the others get 0 when no value is given."""
    if tau is not None:
        return tau, "flag"
    if mode != "margin":
        return 0.0, f"unused in mode {mode}"
    profile = load_profile(Path(model_path).name)
    if profile is None:
        raise ValueError(
            f"no tau profile for model {Path(model_path).name!r} in {PROFILE_DIR}; pass --mg-tau "
            "(or --mg-mode always)"
        )
    return float(profile["tau"]), f"profile {Path(model_path).name}.json"
