#!/usr/bin/env bash
# One call on the GPU device machine ($OUT set): install the carried SGLang wheels (.whl), run the
# GPU serving tests, then the deterministic-traffic sweep; logs, JSON and PNG into $OUT.
#   TESTS="-k lagged" SWEEP="--models smol --rates 0.1 --reps 1" bash benchmarks/device_serving.sh
# TESTS=skip / SWEEP=skip leave a part out. Needs .whl/ (benchmarks/pack_device.sh) and
# .cache/gpu-tokenizer/ (the embedded model's tokenizer files) in the carried tree.
set -o pipefail
source "$(dirname "$0")/device_env.sh"
nvidia-smi -L | tee "$OUT/env.txt"
if [ "${TESTS:-}" != skip ]; then
  # shellcheck disable=SC2086 - TESTS is a list of pytest arguments
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs -s ${TESTS:-} \
    tests/test_gate_gpu.py tests/test_gpu_serving.py 2>&1 | tail -60 | tee "$OUT/gpu_tests.log"
fi
if [ "${SWEEP:-}" != skip ]; then
  # shellcheck disable=SC2086 - SWEEP is a list of gpu_sweep arguments
  timeout "${SWEEP_TIMEOUT:-560}" python3 benchmarks/gpu_sweep.py --out "$OUT/sweep" \
    --tokenizer .cache/gpu-tokenizer ${SWEEP:-} 2>&1 | tee "$OUT/sweep.log"
  cp "$OUT"/sweep/gpu_sweep* "$OUT/" 2>/dev/null
  # mg's own lines (warnings, failures) of every server, each tagged with its log's name
  grep -H "mg[:-]" "$OUT"/sweep/server-*.log | grep -v "Decode batch" | tail -c 4000000 > "$OUT/server_mg_lines.log"
  rm -rf "$OUT/sweep"
fi
