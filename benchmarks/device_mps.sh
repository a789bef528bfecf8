#!/usr/bin/env bash
# One call on the GPU device machine ($OUT set): benchmarks/device_serving.sh under CUDA MPS, so
# that mg's verifier process and SGLang's run their kernels concurrently
# (benchmarks/results/gpu/HISTORY.md, "One forward behind"). The MPS control daemon is started
# for this command only and quit when it ends; no card setting is changed. Every server of the
# run is an MPS client, plain SGLang included.
#   SWEEP="--models smol --configs 0.1 --decode-tokens 128 --stream-interval 8 \
#     --reps 2 --batches 1,8,32" TESTS=skip bash benchmarks/device_mps.sh
# (an earlier commit's run: benchmarks/results/gpu/sweep_smol_lag_vs_hold_mps_h100.*). Exits 0 with a message
# where MPS is unavailable.
command -v nvidia-cuda-mps-control >/dev/null || { echo "mg: no nvidia-cuda-mps-control here"; exit 0; }
export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY:-/tmp/mps-pipe} CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY:-/tmp/mps-log}
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d || { echo "mg: the MPS control daemon did not start"; exit 0; }
trap 'echo quit | nvidia-cuda-mps-control; sleep 1' EXIT
echo "mg: CUDA MPS on ($CUDA_MPS_PIPE_DIRECTORY)"
bash "$(dirname "$0")/device_serving.sh"
