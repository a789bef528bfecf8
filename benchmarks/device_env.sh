# Sourced by benchmarks/device_{serving,seam,timeline}.sh on the GPU device machine: $OUT, the
# carried SGLang wheels (.whl/, ../shared/docs/gpu-wheels.txt) installed into /tmp/mg-site (not
# with NO_INSTALL=1: a CPU smoke run that uses the local venv), and the environment of the run.
OUT=${OUT:-/tmp/mg-out}; mkdir -p "$OUT"
[ -n "${NO_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/mg-site .whl/*.whl || exit 1
export PYTHONPATH=$PWD:/tmp/mg-site PYTHONUNBUFFERED=1 MG_GPU_TOKENIZER=$PWD/.cache/gpu-tokenizer
