#!/usr/bin/env bash
# The Llama-3-8B-shape tables of docs/performance.md in one command, on a GPU host:
#   bash benchmarks/device_tables.sh [decode] [offline] [streams]      (none named: all three)
# decode:  ms/step at bs 1, 8, 32 and with 25 % deterministic rows, plus whole answers (gpu_sweep.py)
# offline: output tokens/s at 0-100 % deterministic requests beside plain SGLang and SGLang's
#          deterministic mode, timed in the same reps (offline_throughput.py)
# streams: TTFT / ITL of deterministic and plain streams at the benchmarks' tau and at tau 0
# Each part took 4-7 min on an H200. Tables and JSON go to $OUT/tables/{decode,offline,streams}.*;
# $OUT/tables/tables.md joins the tables. MODEL (default llama8b-planted), REPS (2) and SHARES
# (0,0.02,0.1,0.5,1) override.
# On a host with SGLang installed set NO_INSTALL=1; on the device machine the carried wheels
# (`benchmarks/device.sh pack`) and .cache/gpu-tokenizer are used as by `device.sh serve`.
set -o pipefail
source "$(dirname "$0")/device.sh" || exit 1
MODEL=${MODEL:-llama8b-planted} REPS=${REPS:-2} SHARES=${SHARES:-0,0.02,0.1,0.5,1} T=$OUT/tables
parts=("$@"); [ ${#parts[@]} -eq 0 ] && parts=(decode offline streams)
mkdir -p "$T"; nvidia-smi -L | tee "$T/env.txt"
for part in "${parts[@]}"; do
  work=$T/$part-work; rm -rf "$work"; mkdir -p "$work"  # left in place if the part is cut short
  case $part in
    decode)  # tau by the benchmarks' rate rule: a tenth of the reference bf16 margins below it
      python3 benchmarks/gpu_sweep.py --out "$work" --tokenizer .cache/gpu-tokenizer --models "$MODEL" \
        --configs 0.1:w32 --tau-margins bf16 --batches 1,8,32 --reps "$REPS" --decode-tokens 64 \
        --stream-interval 8 2>&1 | grep -v "Warning\|warn(" | tail -40
      cp "$work/gpu_sweep-$MODEL.json" "$T/decode.json"; cp "$work/gpu_sweep.md" "$T/decode.md" ;;
    offline)
      python3 benchmarks/offline_throughput.py --out "$work" --tokenizer .cache/gpu-tokenizer --model "$MODEL" \
        --shares "$SHARES" --reps "$REPS" --stream-taus "" --sglang-det 2>&1 | grep -v "Warning\|warn(" | tail -20
      cp "$work/throughput.json" "$T/offline.json"; cp "$work/throughput.md" "$T/offline.md" ;;
    streams)
      python3 benchmarks/offline_throughput.py --out "$work" --tokenizer .cache/gpu-tokenizer --model "$MODEL" \
        --shares "" --stream-taus target,0 2>&1 | grep -v "Warning\|warn(" | tail -20
      cp "$work/throughput.json" "$T/streams.json"; cp "$work/throughput.md" "$T/streams.md" ;;
    *) echo "unknown part $part (decode, offline, streams)"; exit 2 ;;
  esac
  # mg's own warnings and failures from every server log, kept beside the tables
  grep -H "mg[:-]" "$work"/*.log "$work"/*/*.log 2>/dev/null | grep -v "Decode batch" | tail -c 2000000 > "$T/$part-mg-lines.log"
  rm -rf "$work"
done
for part in decode offline streams; do [ -f "$T/$part.md" ] && { echo "## $part"; cat "$T/$part.md"; echo; }; done > "$T/tables.md"
