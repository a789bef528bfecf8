#!/usr/bin/env bash
# Here (not on the device): the cp312 wheels of requirements/gpu-device.txt, installed into one
# folder tree and packed as .whl/site.tar.xz (~43 MB, against ~72 MB of wheels), so they travel
# with the repo in one device call (64 MiB). benchmarks/device_env.sh unpacks it there.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
plat=()
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
