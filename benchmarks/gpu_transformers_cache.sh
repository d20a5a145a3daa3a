#!/usr/bin/env bash
# One GPU machine, the diffusion transformers: exports (SD3.5 Medium 4 blocks, FLUX.1 schnell and dev 2 + 4 blocks,
# with First-Block Cache's parts), the GPU tests of the transformers, First-Block Cache's probe on each, the bench
# (ours, floor, torch.compile) on SD3.5 Medium, and the SD3.5 kernel table with ORT's MatMul+Add fusion off.
# From the project root after bash .device/w/install.sh, in the background:
#   setsid nohup bash benchmarks/gpu_transformers_cache.sh OUT > /dev/null 2>&1 &
# OUT/status gets one "time what rc" line per job and "done" last.
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd) root=$PWD
export work=${WORK:-/tmp/gtc-work}
export PYTHONPATH=${SITE:-/tmp/site}:$root PYTHONUNBUFFERED=1
stamp() { echo "$(date +%H:%M:%S) $*" >> "$out/status"; }
bench() { python3 -m optimum_iobinding.cli bench --scenario transformer --text-layers 4 --work "$work" "$@"; }
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import onnxruntime, torch, diffusers, transformers; print("onnxruntime", onnxruntime.__version__, "torch", torch.__version__, "diffusers", diffusers.__version__, "transformers", transformers.__version__)'
  echo "git $(git rev-parse --short HEAD 2>/dev/null) + $(git status --short 2>/dev/null | wc -l) changed files"; } > "$out/versions.txt" 2>&1
stamp start
( python3 -m pytest -q -m gpu tests/gpu/test_gpu_sd3.py tests/gpu/test_gpu_flux.py -p no:cacheprovider -rs \
    > "$out/gpu-tests-transformers.log" 2>&1; stamp "gpu tests rc $?" ) &
tests=$!
i=0 pids=()
for model in "sd35m --blocks 4" "flux-schnell --blocks 2" "flux-dev --blocks 2"; do
  ( taskset -c $((i * 5))-$((i * 5 + 4)) bash -c "$(declare -f bench); bench --models $model --export-only" \
      > "$out/export-${model%% *}.log" 2>&1; stamp "export ${model%% *} rc $?" ) &
  pids+=($!) i=$((i + 1))
done
for pid in "${pids[@]}"; do wait "$pid"; done
folder() { ls -d "$work/$1"-fp16-optimized-blocks* | head -1; }
for kind in flux-schnell flux-dev sd35m; do
  timeout 420 python3 benchmarks/step_cache_probe.py --folder "$(folder $kind)" --kind $kind --out "$out" \
    > "$out/probe-$kind.log" 2>&1
  stamp "probe $kind rc $?"
done
timeout 900 bash -c "$(declare -f bench); bench --models sd35m --blocks 4 --peers ours,floor,compile --runs 2 --warmup 1 \
  --compile-timeout 420 --out $out/bench-sd35m" > "$out/bench-sd35m.log" 2>&1
stamp "bench sd35m rc $?"
timeout 300 python3 benchmarks/transformer_kernels.py --folder "$(folder sd35m)" --out "$work/k" \
  --session-config optimization.disable_specified_optimizers=MatMulAddFusion > "$out/kernels-nomatmuladd-sd35m.log" 2>&1
rc=$?; cp "$work"/k/*.json "$out/kernels-nomatmuladd-sd35m.json" 2>/dev/null; stamp "kernels no-MatMulAdd sd35m rc $rc"
wait $tests
stamp done
