#!/usr/bin/env bash
# The benchmark run behind benchmarks/results/<device>/, on the GPU machine, from the project root, after
#   bash .device/w/install.sh && bash .device/w/install.sh optimum      (onnxruntime-gpu, diffusers; optimum-onnx)
# Usage: bash benchmarks/run_gpu.sh OUT_FOLDER [WORK_FOLDER]
# Most important first (the targets are checked on the SD1.5-size and the small fp16 models), so that a run cut
# short by the machine's time still reports them.
set -uo pipefail
out=${1:?output folder}
work=${2:-/tmp/bench-work}
export PYTHONPATH=/tmp/site:$PWD
bench() { python3 -m optimum_iobinding.cli bench --work "$work" --optimum-pythonpath /tmp/site-optimum "$@"; }
bench --models sd15 --dtypes fp16 --exports plain --out "$out/sd15-fp16-plain"
bench --models small --dtypes fp16 --exports plain --out "$out/small-fp16-plain"
bench --models sd15 --dtypes fp16 --exports optimized --out "$out/sd15-fp16-optimized"
bench --models small --dtypes fp16 --exports optimized --out "$out/small-fp16-optimized"
bench --models tiny,small --dtypes fp32 --exports plain --out "$out/fp32"
