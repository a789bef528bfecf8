#!/usr/bin/env bash
# GPU probe (device machine, $OUT set): a fresh mg-server on a random-weight SmolLM2-shape model
# (MODE, default always; EXTRA: more serve flags), two deterministic /generate calls with their
# headers (-> $OUT/responses.txt), then the server's log without the capture lines -> $OUT/probe.log.
# Exit status 0 only if both answers were verified. With STACKS=1 an
# all-threads dump of the scheduler (SIGABRT -> faulthandler) before the stop.
set -u
source "$(dirname "$0")/device_env.sh" || exit 1
python3 -c "import sglang; print('SGLang', sglang.__version__)"
python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from pathlib import Path; import gpu_e2e; \
gpu_e2e.write_model('smol', Path('/tmp/smol'), Path('.cache/gpu-tokenizer'))"
# shellcheck disable=SC2086 - EXTRA is a list of flags
python3 -m mg_server serve --model /tmp/smol --device cuda --mg-mode "${MODE:-always}" --port 31000 ${EXTRA:-} \
  > "$OUT/server.log" 2>&1 &
pid=$!
for _ in $(seq 1 120); do
  curl -sf localhost:31000/health > /dev/null && break
  kill -0 $pid 2> /dev/null || { echo "the server exited"; break; }
  sleep 2
done
curl -s -m 5 localhost:31000/health; echo
for k in 1 2; do
  curl -s -m 60 -D - -H 'Content-Type: application/json' -H 'X-Deterministic: 1' localhost:31000/generate \
    -d '{"text":"Hello there, how are","sampling_params":{"max_new_tokens":16,"temperature":0}}' | head -c 2000
  echo
done | tee "$OUT/responses.txt"
if [ -n "${STACKS:-}" ]; then
  kill -ABRT "$(pgrep -f 'sglang::scheduler' | head -1)"; sleep 4
fi
kill $pid 2> /dev/null; sleep 5; kill -9 $pid 2> /dev/null
grep -v "Capturing batches" "$OUT/server.log" > "$OUT/probe.log"; tail -40 "$OUT/probe.log"
[ "$(grep -ci "x-mg-verdict: verified" "$OUT/responses.txt")" = 2 ]
