#!/usr/bin/env bash
# The benchmark run behind benchmarks/results/<device>/, on the GPU machine, from the project root, after
#   bash .device/w/install.sh && bash .device/w/install.sh optimum      (onnxruntime-gpu, diffusers; optimum-onnx)
# Usage: bash benchmarks/run_gpu.sh OUT_FOLDER [WORK_FOLDER]
# Most important first (the targets are checked on the SD1.5-size and the small fp16 models), so that a run cut
# short by the machine's time still reports them. Each step appends its name to OUT_FOLDER/status when done.
set -uo pipefail
out=${1:?output folder}
work=${2:-/tmp/bench-work}
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
mkdir -p "$out"
bench() { python3 -m optimum_iobinding.cli bench --work "$work" --optimum-pythonpath /tmp/site-optimum "$@"; }
step() { local name=$1; shift; "$@" > "$out/$name.log" 2>&1; echo "$name $?" >> "$out/status"; }
step tiny-fp16 bench --models tiny --dtypes fp16 --exports plain,optimized --out "$out/tiny-fp16"
step fp32 bench --models tiny,small --dtypes fp32 --exports plain --out "$out/fp32"
step sd15-fp16-optimized bench --models sd15 --dtypes fp16 --exports optimized --out "$out/sd15-fp16-optimized"
step lcm-fp16 bench --models lcm --dtypes fp16 --exports plain,optimized --out "$out/lcm-fp16"
step turbo-fp16 bench --models turbo --dtypes fp16 --exports plain,optimized --out "$out/turbo-fp16"
step sdxl-fp16 bench --models sdxl --dtypes fp16 --exports optimized --out "$out/sdxl-fp16"
step tiled-vae python3 benchmarks/tiled_vae.py --size 2048 --work "$work" --out "$out/tiled-vae"
step sd15-fp16-plain bench --models sd15 --dtypes fp16 --exports plain --out "$out/sd15-fp16-plain"
step small-fp16 bench --models small --dtypes fp16 --exports plain,optimized --out "$out/small-fp16"
step unet-options python3 benchmarks/unet_options.py --model sd15 --work "$work" --out "$out/unet-options"
