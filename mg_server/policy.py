"""MarginGate policy: which protected steps go to the verifier.

Modes: `off` (never verify: plain SGLang), `margin` (verify when the fast path's top-1/top-2
logit margin is below tau), `always` (verify every step; the LLM-42-like upper bound on cost).
tau comes from an explicit value, a profile file (`serve --profile`, written by `mg-server
calibrate`) or the model's shipped profile for the serving device (mg_server/profiles/MODEL.DEVICE.json).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

MODES = ("off", "margin", "always")
PROFILE_DIR = Path(__file__).resolve().parent / "profiles"


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


def read_profile(path: Path) -> dict:
    """A tau profile file (`mg-server calibrate` writes them): a JSON object whose `tau` is a
    finite number >= 0; its other fields are the calibration's evidence. Raises ValueError."""
    try:
        d = json.loads(Path(path).read_text())
    except OSError as e:
        raise ValueError(f"cannot read tau profile {path}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"tau profile {path} is not JSON: {e}") from None
    tau = d.get("tau") if isinstance(d, dict) else None
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 <= tau < math.inf:
        raise ValueError(f"tau profile {path}: `tau` must be a finite number >= 0, got {tau!r}")
    return d


def profile_name(model_name: str, device: str) -> str:
    """A shipped profile's file name. Per device, why: tau bounds how far the fast path's margins
    drift from the verifier's, and both kernel sets differ between CPU and GPU (SmolLM2: 0.547 on
    CPU, 0.578 on an H200)."""
    return f"{model_name}.{device}.json"


def load_profile(model_name: str, device: str, profile_dir: Path = PROFILE_DIR) -> dict | None:
    """The calibration profile of a model (by checkpoint folder name) on a device ("cpu" or
    "cuda"), if one is shipped."""
    path = profile_dir / profile_name(model_name, device)
    return read_profile(path) if path.exists() else None


def resolve_tau(model_path: str, tau: float | None, mode: str = "margin",
                profile_path: str | None = None, device: str = "cpu") -> tuple[float, str]:
    """(tau, where it came from): an explicit value wins, then a profile file given by the user
    (`serve --profile`), then the model's shipped profile for `device`. Only mode margin reads
    tau; the others get 0 when no value is given (a given profile file is still checked). A model
    without a profile serves with tau 0: tau only says which steps are checked early, and every
    token is checked before it leaves whatever tau is."""
    if tau is not None:
        return tau, "flag"
    name = Path(model_path).name
    profile = read_profile(Path(profile_path)) if profile_path else None
    if mode != "margin":
        return 0.0, f"unused in mode {mode}"
    if profile is not None:
        source = f"profile {profile_path}"
    else:
        profile = load_profile(name, device)
        if profile is None:
            return 0.0, f"no {device} profile: steps are checked in windows only"
        source = f"profile {profile_name(name, device)}"
    if profile.get("model", name) != name:  # tau is per model: say so when the names differ
        source += f", calibrated for {profile['model']!r}, not {name!r}"
    if profile.get("device", device) != device:  # and per device
        source += f", calibrated on {profile['device']}, served on {device}"
    return float(profile["tau"]), source
