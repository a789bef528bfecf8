#!/bin/bash
# GPU probe (device machine, $OUT set): three deterministic /generate calls on a fresh server
# (default: the experimental lagged seam, mode always), then an all-threads dump of the
# scheduler (SIGABRT -> faulthandler) into $OUT/tail.log. MODE, EXTRA override.
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/mg-gpu-site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=$PWD:$PWD/benchmarks:$PWD/tests:/tmp/mg-gpu-site PYTHONUNBUFFERED=1
python3 -c "
import sys; sys.path.insert(0,'benchmarks')
from pathlib import Path
import gpu_e2e
gpu_e2e.write_model('smol', Path('/tmp/smol'), Path('.cache/gpu-tokenizer'))
"
MODE=${MODE:-always}
EXTRA=${EXTRA:-}
python3 -m mg_server serve --model /tmp/smol --device cuda --mg-mode $MODE --port 31000 $EXTRA > $OUT/server.log 2>&1 &
for i in $(seq 1 150); do curl -sf localhost:31000/health >/dev/null && break; sleep 2; done
curl -s -m 5 localhost:31000/health; echo
for k in 1 2 3; do
curl -s -m 40 -D - -H 'Content-Type: application/json' -H 'X-Deterministic: 1' localhost:31000/generate -d '{"text":"Hello there, how are","sampling_params":{"max_new_tokens":16,"temperature":0}}' > $OUT/resp$k.txt 2>&1; echo rc=$?
cat $OUT/resp$k.txt | head -30
done
nvidia-smi --query-gpu=utilization.gpu --format=csv
S=$(pgrep -f "sglang::scheduler" | head -1); echo sched=$S
kill -ABRT $S; sleep 4
pkill -f "mg_server serve"; sleep 2
grep -v "Capturing batches" $OUT/server.log | tail -150 > $OUT/tail.log
