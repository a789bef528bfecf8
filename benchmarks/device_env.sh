# Sourced by benchmarks/device_serving.sh and device_real_smol.sh on the GPU device machine: $OUT, the
# carried SGLang packages (.whl/site.tar.xz from benchmarks/pack_device.sh, else wheels in .whl/)
# installed into /tmp/mg-site (not with NO_INSTALL=1: a CPU smoke run that uses the local venv),
# and the environment of the run.
OUT=${OUT:-/tmp/mg-out}; mkdir -p "$OUT"
if [ -z "${NO_INSTALL:-}" ]; then
  if [ -f .whl/site.tar.xz ]; then
    mkdir -p /tmp/mg-site && tar -C /tmp/mg-site -xJf .whl/site.tar.xz || exit 1
  else
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/mg-site \
      .whl/*.whl || exit 1
  fi
fi
export PYTHONPATH=$PWD:/tmp/mg-site PYTHONUNBUFFERED=1 MG_GPU_TOKENIZER=$PWD/.cache/gpu-tokenizer
