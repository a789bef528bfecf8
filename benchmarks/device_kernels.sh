#!/usr/bin/env bash
# One-call GPU check for the device machine: GPU tests + benchmark, logs and JSON to $OUT.
#   bash benchmarks/device_kernels.sh [--variants]
set -o pipefail
OUT=${OUT:-/tmp/kout}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import pytest" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/ksite .cache/kwhl/*.whl \
    && export PYTHONPATH=/tmp/ksite
fi
{ nvidia-smi -L; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } \
  2>&1 | tee "$OUT/env.txt"
# --noconftest: the shared conftest pulls in unrelated packages; GPU tests need no skipping here.
timeout 300 python3 -m pytest tests/test_kernels.py -m gpu --noconftest -q -p no:cacheprovider \
  -rs --durations=5 2>&1 | tee "$OUT/gpu_tests.log"
timeout 280 python3 -m mg_server.kernels.bench --out "$OUT/bench_gpu.json" "$@" 2>&1 \
  | tee "$OUT/bench_gpu.log"
