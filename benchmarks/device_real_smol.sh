#!/usr/bin/env bash
# The embedded SmolLM2's real weights on the GPU device machine. A device call carries at most
# 64 MiB (the repo's tracked files, ~5 MB, included), the packed SGLang site ~43 MB and the GGUF
# ~98 MB, so they travel over four back-to-back calls (files outside the repo copy survive while
# the machine stays warm, ~30 s between calls):
#   here:          bash benchmarks/device_real_smol.sh split
#                  (writes .cache/gguf{1,2,3}/part and each part's .cache/ggufK/total, all ignored)
#   device call 1: bash benchmarks/device_real_smol.sh stage
#                  carry .whl .cache/gpu-tokenizer (installs the wheels; stages the tokenizer in
#                  /tmp/stage); or any device_env.sh run that carried .whl, e.g. device_tables.sh
#   device calls 2, 3: bash benchmarks/device_real_smol.sh stage      carry .cache/gguf1, then .cache/gguf2
#   device call 4: bash benchmarks/device_real_smol.sh build [CMD ...]
#                  carry .cache/gguf3 (joins the parts, checks the size, prepare_model ->
#                  /tmp/mg-models/smol-real, then runs CMD), e.g. CMD = python3 benchmarks/gpu_sweep.py
#                  --tokenizer /tmp/stage/tok --checkpoint smol=/tmp/mg-models/smol-real --models smol ...
# Later calls on the same warm machine: `build` again skips what exists. A call that finds the
# machine cold (the lease's `warm` false) has lost the staged parts and the installed site.
set -euo pipefail
cd "$(dirname "$0")/.."
PART=33000000  # bytes per part: each travels alone (with the tokenizer: 3.4 MB)

stage_parts() {  # every carried part, and the tokenizer, into /tmp/stage
  mkdir -p /tmp/stage
  for d in .cache/gguf[0-9]; do
    if [ -f "$d/part" ]; then cp "$d/part" "/tmp/stage/p${d#.cache/gguf}" && cp "$d/total" /tmp/stage/total; fi
  done
  if [ -d .cache/gpu-tokenizer ]; then rm -rf /tmp/stage/tok && cp -r .cache/gpu-tokenizer /tmp/stage/tok; fi
}

case "${1:-}" in
  split)
    g=$("${PYTHON:-.venv/bin/python}" -c "from mg_server.model.prepare import embedded_gguf; print(embedded_gguf())")
    total=$(stat -c %s "$g")
    rm -rf .cache/gguf[0-9]
    for k in 1 2 3; do
      mkdir -p ".cache/gguf$k"
      dd if="$g" of=".cache/gguf$k/part" bs=1M iflag=skip_bytes,count_bytes skip=$(( (k - 1) * PART )) \
        count="$PART" status=none
      echo "$total" > ".cache/gguf$k/total"
    done
    [ $(( 3 * PART )) -ge "$total" ] || { echo "the GGUF needs more than 3 parts of $PART bytes" >&2; exit 1; }
    ls -l "$g" .cache/gguf*/part ;;
  stage)
    if [ -d .whl ]; then source benchmarks/device_env.sh; else NO_INSTALL=1 source benchmarks/device_env.sh; fi
    stage_parts
    ls /tmp/stage ;;
  build)
    NO_INSTALL=1 source benchmarks/device_env.sh
    if [ ! -f /tmp/mg-models/smol-real/config.json ]; then
      stage_parts
      cat /tmp/stage/p1 /tmp/stage/p2 /tmp/stage/p3 > /tmp/stage/smol.gguf
      [ "$(stat -c %s /tmp/stage/smol.gguf)" = "$(cat /tmp/stage/total)" ] || {
        echo "the joined GGUF is $(stat -c %s /tmp/stage/smol.gguf) bytes, not $(cat /tmp/stage/total): a part is missing" >&2
        exit 1; }
      timeout 300 python3 -c "from pathlib import Path; from mg_server.model.prepare import prepare_model; \
print(prepare_model(Path('/tmp/mg-models/smol-real'), Path('/tmp/stage/smol.gguf'), progress=False))"
    fi
    shift
    if [ $# -gt 0 ]; then "$@"; fi ;;
  *)
    echo "usage: $0 split | stage | build [CMD ...]" >&2; exit 2 ;;
esac
