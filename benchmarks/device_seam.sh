#!/usr/bin/env bash
# One call on the GPU device machine ($OUT set) for the lagged seam's host path: its GPU tests, the
# per-launch host times (seam_launch.py), a SmolLM2 sweep next to plain SGLang and its
# deterministic mode (streamed answers), then the same at batch 8 under benchmarks/prof_site (where
# the host time goes: profile.json). Needs .whl/ and .cache/gpu-tokenizer/ in the carried tree.
#   bash benchmarks/device_seam.sh            (about 8 minutes on an H100)
set -o pipefail
source "$(dirname "$0")/device_env.sh"
LOG=$OUT/device_seam.log
nvidia-smi -L | tee "$LOG"
timeout 240 python3 -m pytest -q -p no:cacheprovider -rs tests/test_gate_gpu.py tests/test_launch.py \
  tests/test_lagged.py 2>&1 | tail -15 | tee -a "$LOG"
timeout 60 python3 benchmarks/seam_launch.py --out "$OUT/seam_launch_h100.json" 2>&1 | tee -a "$LOG"
SWEEP=(--tokenizer .cache/gpu-tokenizer --models smol --configs 0.1 --decode-tokens 128 --stream-interval 8)
timeout "${SWEEP_TIMEOUT:-260}" python3 benchmarks/gpu_sweep.py --out /tmp/seam-sweep "${SWEEP[@]}" --sglang-det \
  --reps 2 --batches 1,8,32 2>&1 | tee -a "$LOG"
cp /tmp/seam-sweep/gpu_sweep-smol.json /tmp/seam-sweep/gpu_sweep.md "$OUT/" 2>/dev/null
grep -h "mg[:-].*\(WARN\|ERROR\|fail\|Traceback\)" /tmp/seam-sweep/server-*.log | tail -40 >> "$LOG"
rm -rf /tmp/mgprof
MG_PROF=1 PYTHONPATH=$PWD/benchmarks/prof_site:$PYTHONPATH timeout "${PROFILE_TIMEOUT:-200}" python3 \
  benchmarks/gpu_sweep.py --out /tmp/seam-prof "${SWEEP[@]}" --reps 1 --batches 8 2>&1 | tail -8 >> "$LOG"
python3 - "$OUT/profile.json" <<'PY'
import glob, json, sys
out = {}
for f in glob.glob("/tmp/mgprof/*.json"):
    d = json.load(open(f))
    out[f.rsplit("/", 1)[1]] = d
json.dump(out, open(sys.argv[1], "w"), indent=1)
PY
