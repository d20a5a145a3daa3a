#!/usr/bin/env bash
# One GPU machine, the step caches and the bfloat16 transformers: GPU tests (step caches, bf16, transformers), the
# exports (SD 1.5 and SDXL architectures with DeepCache's parts; FLUX.1 dev and SD3.5 Medium at the bench's block counts
# with First-Block Cache's parts, fp16, and SD3.5 Medium in bf16), then DeepCache's probe (SD 1.5 50 steps, SDXL 30),
# First-Block Cache's probe (FLUX.1 dev, SD3.5 Medium) and the transformer bench in fp16 and bf16 (ours, floor).
# From the project root after bash .device/w/install.sh, in the background:
#   setsid nohup bash benchmarks/gpu_step_cache.sh OUT > /dev/null 2>&1 &
# OUT/status gets one "time what rc" line per job and "done" last.
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd) root=$PWD
export work=${WORK:-/tmp/gsc-work}
export PYTHONPATH=${SITE:-/tmp/site}:$root PYTHONUNBUFFERED=1
stamp() { echo "$(date +%H:%M:%S) $*" >> "$out/status"; }
bench() { python3 -m optimum_iobinding.cli bench --scenario transformer --text-layers 4 --work "$work" "$@"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import onnxruntime, torch, diffusers, transformers; print("onnxruntime", onnxruntime.__version__, "torch", torch.__version__, "diffusers", diffusers.__version__, "transformers", transformers.__version__)'
  cat COMMIT 2>/dev/null; } > "$out/versions.txt" 2>&1
stamp start
( python3 -m pytest -q -m gpu tests/gpu/test_gpu_step_cache.py tests/gpu/test_gpu_bf16.py -p no:cacheprovider -rs \
    > "$out/gpu-tests-step-cache-bf16.log" 2>&1; stamp "gpu tests rc $?" ) &
tests=$!
pids=()
( taskset -c 0-2 python3 benchmarks/deep_cache_probe.py --kind sd15 --steps 50 --work "$work" --out "$out" --export-only \
    > "$out/export-sd15.log" 2>&1; stamp "export sd15 rc $?" ) & pids+=($!)
( taskset -c 3-6 python3 benchmarks/deep_cache_probe.py --kind sdxl --steps 30 --work "$work" --out "$out" --export-only \
    > "$out/export-sdxl.log" 2>&1; stamp "export sdxl rc $?" ) & pids+=($!)
( taskset -c 7-9 bash -c "$(declare -f bench); bench --models flux-dev --blocks 2 --export-only" \
    > "$out/export-flux-dev.log" 2>&1; stamp "export flux-dev rc $?" ) & pids+=($!)
( taskset -c 10-12 bash -c "$(declare -f bench); bench --models sd35m --blocks 4 --export-only" \
    > "$out/export-sd35m.log" 2>&1; stamp "export sd35m rc $?" ) & pids+=($!)
( taskset -c 13-15 bash -c "$(declare -f bench); bench --models sd35m --blocks 4 --dtypes bf16 --export-only" \
    > "$out/export-sd35m-bf16.log" 2>&1; stamp "export sd35m bf16 rc $?" ) & pids+=($!)
for pid in "${pids[@]}"; do wait "$pid"; done
wait $tests
timeout 300 python3 benchmarks/deep_cache_probe.py --kind sd15 --steps 50 --work "$work" --out "$out" \
  --caches 3:0,3:1,2:0 > "$out/probe-sd15.log" 2>&1
stamp "probe sd15 rc $?"
timeout 300 python3 benchmarks/deep_cache_probe.py --kind sdxl --steps 30 --work "$work" --out "$out" \
  --caches 3:0,3:1 > "$out/probe-sdxl.log" 2>&1
stamp "probe sdxl rc $?"
folder() { ls -d "$work/$1"-fp16-optimized-blocks* | head -1; }
for kind in flux-dev sd35m; do
  timeout 300 python3 benchmarks/step_cache_probe.py --folder "$(folder $kind)" --kind $kind --out "$out" \
    > "$out/probe-$kind.log" 2>&1
  stamp "probe $kind rc $?"
done
timeout 420 bash -c "$(declare -f bench); bench --models sd35m --blocks 4 --dtypes fp16,bf16 --peers ours,floor --runs 2 \
  --warmup 1 --out $out/bench-sd35m-fp16-bf16" > "$out/bench-sd35m-fp16-bf16.log" 2>&1
stamp "bench sd35m fp16 bf16 rc $?"
stamp done
