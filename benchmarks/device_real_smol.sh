#!/usr/bin/env bash
# The embedded SmolLM2's real weights on the GPU device machine. A device call carries at most
# 64 MiB and the GGUF is ~98 MB, so it travels in two parts, over two back-to-back calls (files
# outside the repo copy survive while the machine stays warm, ~30 s between calls):
#   here:          bash benchmarks/device_real_smol.sh split
#                  (writes .cache/gguf1/part and .cache/gguf2/part, both ignored)
#   device call 1: bash benchmarks/device_real_smol.sh stage
#                  carry .whl .cache/gpu-tokenizer .cache/gguf1 (installs the wheels; stages
#                  part 1 and the tokenizer in /tmp/stage)
#   device call 2: bash benchmarks/device_real_smol.sh build [CMD ...]
#                  carry .cache/gguf2 (joins the parts, prepare_model -> /tmp/mg-models/smol-real,
#                  then runs CMD), e.g. CMD = python3 benchmarks/gpu_sweep.py --tokenizer
#                  /tmp/stage/tok --checkpoint smol=/tmp/mg-models/smol-real --models smol ...
# Later calls on the same warm machine: `build` again skips what exists.
set -euo pipefail
cd "$(dirname "$0")/.."
PART1=36000000  # bytes in part 1: with the wheels (23 MB) and the tokenizer (3.4 MB) under 64 MiB
case "${1:-}" in
  split)
    g=$(python -c "from mg_server.model.prepare import embedded_gguf; print(embedded_gguf())")
    mkdir -p .cache/gguf1 .cache/gguf2
    head -c "$PART1" "$g" > .cache/gguf1/part
    tail -c +"$((PART1 + 1))" "$g" > .cache/gguf2/part
    ls -l "$g" .cache/gguf1/part .cache/gguf2/part ;;
  stage)
    source benchmarks/device_env.sh
    mkdir -p /tmp/stage && cp .cache/gguf1/part /tmp/stage/p1 && rm -rf /tmp/stage/tok && cp -r .cache/gpu-tokenizer /tmp/stage/tok
    ls /tmp/stage ;;
  build)
    NO_INSTALL=1 source benchmarks/device_env.sh
    if [ ! -f /tmp/mg-models/smol-real/config.json ]; then
      cat /tmp/stage/p1 .cache/gguf2/part > /tmp/stage/smol.gguf
      timeout 300 python3 -c "from pathlib import Path; from mg_server.model.prepare import prepare_model; \
print(prepare_model(Path('/tmp/mg-models/smol-real'), Path('/tmp/stage/smol.gguf'), progress=False))"
    fi
    shift
    if [ $# -gt 0 ]; then "$@"; fi ;;
  *)
    echo "usage: $0 split | stage | build [CMD ...]" >&2; exit 2 ;;
esac
