#!/usr/bin/env bash
# The GPU device machine: a carried copy of the tree, no network, at most 64 MiB a call.
#   bash benchmarks/device.sh pack        here: the cp312 wheels of requirements/gpu-device.txt installed into
#                                         one folder tree, packed as .whl/site.tar.xz (~43 MB against ~72 MB
#                                         of wheels), so they travel with the tree in one call
#   source benchmarks/device.sh           there: $OUT (default /tmp/mg-out), the carried SGLang (.whl/site.tar.xz,
#                                         else wheels in .whl/) installed into /tmp/mg-site (not with
#                                         NO_INSTALL=1: a host with SGLang installed), PYTHONPATH and the
#                                         embedded model's tokenizer (.cache/gpu-tokenizer)
#   TESTS="-k lagged" SWEEP="--models smol --configs 0.1:w32 --reps 1" bash benchmarks/device.sh serve
#                                         there: the GPU serving tests, then gpu_sweep.py; logs, JSON and PNG
#                                         in $OUT (TESTS=skip / SWEEP=skip leave a part out)
#   bash benchmarks/device.sh smol split | stage | build [CMD ...]
#                                         the embedded SmolLM2's real weights, carried in parts (below)
#
# smol: the packed site (~43 MB) and the GGUF (~98 MB) do not fit one call, so they travel over four
# back-to-back calls (files outside the tree's copy survive while the machine stays warm):
#   here:          bash benchmarks/device.sh smol split      (.cache/gguf{1,2,3}/part and .../total, ignored)
#   device call 1: bash benchmarks/device.sh smol stage      carry .whl .cache/gpu-tokenizer (installs the
#                  wheels, stages the tokenizer in /tmp/stage); or any run that carried .whl
#   device calls 2, 3: bash benchmarks/device.sh smol stage  carry .cache/gguf1, then .cache/gguf2
#   device call 4: bash benchmarks/device.sh smol build [CMD ...]  carry .cache/gguf3: joins the parts,
#                  checks the size, prepare_model -> /tmp/mg-models/smol-real, then runs CMD, e.g.
#                  python3 benchmarks/gpu_sweep.py --tokenizer /tmp/stage/tok --checkpoint smol=/tmp/mg-models/smol-real ...
# `build` again on the same warm machine skips what exists; a call that finds the machine cold has
# lost the staged parts and the installed site.

device_env() {
  OUT=${OUT:-/tmp/mg-out}; mkdir -p "$OUT"
  if [ -z "${NO_INSTALL:-}" ]; then
    if [ -f .whl/site.tar.xz ]; then
      mkdir -p /tmp/mg-site && tar -C /tmp/mg-site -xJf .whl/site.tar.xz || return 1
    else
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mg-site \
        .whl/*.whl || return 1
    fi
  fi
  export PYTHONPATH=$PWD:/tmp/mg-site PYTHONUNBUFFERED=1 MG_GPU_TOKENIZER=$PWD/.cache/gpu-tokenizer
}

if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then  # sourced: the environment only
  device_env || return 1
  return 0
fi

set -euo pipefail
cd "$(dirname "$0")/.."

pack() {
  local tmp plat=()
  tmp=$(mktemp -d)
  trap "rm -rf '$tmp'" EXIT
  for p in manylinux_2_34 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do
    plat+=(--platform "${p}_x86_64")
  done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    --platform any -d "$tmp/wheels" -r requirements/gpu-device.txt
  python3 -m pip install -q --no-deps --no-compile --target "$tmp/site" --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${plat[@]}" --platform any --only-binary=:all: "$tmp"/wheels/*.whl
  mkdir -p .whl
  tar -C "$tmp/site" -cf - . | xz -T0 -6 > .whl/site.tar.xz
  ls -l .whl/site.tar.xz
}

serve() {
  set +e
  device_env || exit 1
  nvidia-smi -L | tee "$OUT/env.txt"
  if [ "${TESTS:-}" != skip ]; then
    # shellcheck disable=SC2086 - TESTS is a list of pytest arguments
    timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -q -m gpu -p no:cacheprovider -rs -s ${TESTS:-} \
      tests/test_gpu_serving.py 2>&1 | tail -60 | tee "$OUT/gpu_tests.log"
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
}

PART=33000000  # bytes per GGUF part: each travels alone (with the tokenizer: 3.4 MB)

stage_parts() {  # every carried part, and the tokenizer, into /tmp/stage
  mkdir -p /tmp/stage
  for d in .cache/gguf[0-9]; do
    if [ -f "$d/part" ]; then cp "$d/part" "/tmp/stage/p${d#.cache/gguf}" && cp "$d/total" /tmp/stage/total; fi
  done
  if [ -d .cache/gpu-tokenizer ]; then rm -rf /tmp/stage/tok && cp -r .cache/gpu-tokenizer /tmp/stage/tok; fi
}

smol() {
  case "${1:-}" in
    split)
      local g total
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
      if [ -d .whl ]; then device_env; else NO_INSTALL=1 device_env; fi
      stage_parts
      ls /tmp/stage ;;
    build)
      NO_INSTALL=1 device_env
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
      echo "usage: $0 smol split | stage | build [CMD ...]" >&2; exit 2 ;;
  esac
}

case "${1:-}" in
  pack) pack ;;
  serve) serve ;;
  smol) shift; smol "$@" ;;
  *) echo "usage: $0 pack | serve | smol split|stage|build [CMD ...]   (or: source $0)" >&2; exit 2 ;;
esac
