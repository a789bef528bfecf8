#!/usr/bin/env bash
# One call on the GPU device machine ($OUT set): where a verify call's time goes. One SmolLM2
# mg server (tau for ~10 % of steps, lagged seam) under benchmarks/prof_site's timelines, 3 streamed
# batches of 8 deterministic rows, then benchmarks/verify_timeline.py over the three processes'
# dumps. Needs .whl/ and .cache/gpu-tokenizer/ in the carried tree.  (~2 minutes on an H100)
#   TAU=0.0270147 BS=8 bash benchmarks/device_timeline.sh
set -o pipefail
source "$(dirname "$0")/device_env.sh"
PY=${PYTHON:-python3}  # (DEVICE=cpu NO_INSTALL=1 PYTHON=.venv/bin/python: a smoke run on a CPU host)
rm -rf /tmp/mgprof
MG_PROF=1 PYTHONPATH=$PWD/benchmarks/prof_site:$PYTHONPATH timeout 300 "$PY" - "$OUT" "${TAU:-0.0270147}" "${BS:-8}" "${DEVICE:-cuda}" <<'PY'
import json, sys, time
from pathlib import Path
sys.path[:0] = ["benchmarks", "tests"]
import gpu_e2e as E
from stream_timing import stream_batch
out, tau, bs, device = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
mdir = E.write_model("smol", Path("/tmp/mg-models/smol"), Path(".cache/gpu-tokenizer"))
srv = E.start(mdir, "smol", "margin", out, ["--mg-tau", tau, *(["--mem-fraction-static", "0.85"] if device == "cuda" else [])], device)
try:
    rows = json.loads(E.PROMPTS_FILE.read_text())["other"][:bs]
    for _ in range(3):
        E.log(f"bs {bs}: {stream_batch(srv.url, rows, 128, len(rows), interval=8)}")
    time.sleep(2)  # prof_site dumps once a process has been idle for 0.5 s
finally:
    srv.stop()
PY
"$PY" benchmarks/verify_timeline.py /tmp/mgprof --out "$OUT/verify_timeline.json" | tee -a "$OUT/verify_timeline.md"
"$PY" -c "import glob,json,sys; json.dump({f: json.load(open(f)) for f in glob.glob('/tmp/mgprof/*.json')}, open(sys.argv[1], 'w'))" \
  "$OUT/timeline_dumps.json"
