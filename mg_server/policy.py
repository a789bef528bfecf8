"""MarginGate policy: which protected steps go to the verifier.

Modes: `off` (never verify: plain SGLang), `margin` (verify when the fast path's top-1/top-2
logit margin is below tau), `always` (verify every step; the LLM-42-like upper bound on cost).
tau comes from an explicit value, a profile file (`serve --profile`, written by `mg-server
calibrate`) or the shipped profile for the serving device whose `model_id` is the served model's
identity (mg_server/profiles/*.json; mg_server.checkpoint.model_identity), whatever its folder's name.
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
    """A shipped profile's file name (found by its `model_id`, never by this name). Per device, why:
    tau bounds how far the fast path's margins drift from the verifier's, and both kernel sets
    differ between CPU and GPU (SmolLM2: 0.547 on CPU, 0.578 on an H200)."""
    return f"{model_name}.{device}.json"


def find_profile(model_id: str, device: str, profile_dir: Path = PROFILE_DIR) -> tuple[Path | None, dict | None, str]:
    """The shipped profile of a model identity (mg_server.checkpoint.model_identity) on a device
    ("cpu" or "cuda"): (its file, its content, "") or (None, None, why none matched)."""
    shipped = []
    for path in sorted(Path(profile_dir).glob("*.json")):
        doc = read_profile(path)
        if doc.get("model_id") == model_id and doc.get("device") == device:
            return path, doc, ""
        shipped.append(f"{path.name} (model {doc.get('model', '?')!r}, {doc.get('device', '?')}, "
                       f"id {doc.get('model_id', 'none')})")
    return None, None, (f"no {device} profile for model identity {model_id or '(none)'}; shipped: "
                        + ("; ".join(shipped) or "none"))


def resolve_tau(model_id: str, tau: float | None, mode: str = "margin", profile_path: str | None = None,
                device: str = "cpu", profile: dict | None = None,
                profile_dir: Path = PROFILE_DIR) -> tuple[float, str]:
    """(tau, where it came from): an explicit value wins, then a profile file given by the user
    (`serve --profile`; `profile` is its content when already read), then the shipped profile of
    the model's identity for `device`. Only mode margin reads tau; the others get 0 when no value
    is given (a given profile file is still checked). A model without a profile serves with tau 0:
    tau only says which steps are checked early, and every token is checked before it leaves
    whatever tau is."""
    if tau is not None:
        return tau, "flag"
    if profile is None and profile_path:
        profile = read_profile(Path(profile_path))
    if mode != "margin":
        return 0.0, f"unused in mode {mode}"
    if profile is not None:
        source = f"profile {profile_path}"
    else:
        path, profile, why = find_profile(model_id, device, profile_dir)
        if profile is None:
            return 0.0, why + ": steps are checked in windows only"
        source = f"profile {path.name}"
    if profile.get("model_id", model_id) != model_id:  # tau is per model: say so when it is another one
        source += (f", calibrated for {profile.get('model', '?')!r} (id {profile['model_id']}), "
                   f"not this model ({model_id})")
    if profile.get("device", device) != device:  # and per device
        source += f", calibrated on {profile['device']}, served on {device}"
    return float(profile["tau"]), source
