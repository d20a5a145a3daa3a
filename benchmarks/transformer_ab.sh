#!/usr/bin/env bash
# The diffusion transformers' exports, before / after a change of the export (graph rewrites, precision), on one GPU
# machine: SD3.5 Medium (4 of 24 blocks) and FLUX.1 schnell (2 + 4 blocks), text encoders of 4 layers, exported by
# the package at BEFORE_DIR and by this checkout side by side (each pinned to its share of the CPUs, as
# benchmarks/ab_compare.sh does); each transformer's kernels by class and its CUDA-graph replay
# (benchmarks/transformer_kernels.py, with its own side's package); then the bench's transformer scenario on the after
# exports with PEERS. On the GPU machine, from the project root, after bash .device/w/install.sh:
#   bash benchmarks/transformer_ab.sh OUT BEFORE_DIR
# BEFORE_DIR holds an optimum_iobinding folder (here: git archive COMMIT optimum_iobinding | tar -x -C .device/before).
# Environment: PEERS (ours,floor; the optimum peer is added where OPTIMUM_SITE has optimum), OPTIMUM_SITE
# (/tmp/site-optimum), SITE (/tmp/site), RUNS (3), MODELS (sd35m flux), WORK (/tmp/tab-work).
# Writes to OUT: status ("time what rc N" lines, "done" last), export-SIDE-MODEL.log, kernels-SIDE-MODEL.json,
# bench-MODEL/ (the bench's JSON and table), bench-MODEL.log, versions.txt; start it with setsid and poll OUT/status.
set -uo pipefail
main() {
[ $# -ge 2 ] || { echo "usage: bash benchmarks/transformer_ab.sh OUT BEFORE_DIR" >&2; exit 2; }
root=$PWD
[ -f "$2/optimum_iobinding/__init__.py" ] || { echo "transformer_ab: BEFORE_DIR $2 has no optimum_iobinding/" >&2; exit 2; }
mkdir -p "$1"
out=$(cd "$1" && pwd) source_before=$(cd "$2" && pwd)
site=${SITE:-/tmp/site} optimum_site=${OPTIMUM_SITE:-/tmp/site-optimum} work=${WORK:-/tmp/tab-work}
models=${MODELS:-sd35m flux} runs=${RUNS:-3} peers=${PEERS:-ours,floor}
mkdir -p "$work/before" "$work/after"
cp -r "$source_before/optimum_iobinding" "$work/before/" && cp -r "$root/optimum_iobinding" "$work/after/" &&
  cp "$root/benchmarks/ab_compare.py" "$root/benchmarks/transformer_kernels.py" "$work/" || exit 2
find "$work/before" "$work/after" -name __pycache__ -prune -exec rm -rf {} +
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
stamp() { echo "$(date +%H:%M:%S) $*" >> "$out/status"; }
args_of() {  # MODEL: the bench's model and depth
  case $1 in sd35m) echo --models sd35m --blocks 4 --text-layers 4 ;; flux) echo --models flux-schnell --blocks 2 --text-layers 4 ;; esac
}
{ echo "after: git $(git -C "$root" rev-parse --short HEAD 2>/dev/null), changed files: $(git -C "$root" status --short 2>/dev/null | wc -l)"
  diff -rq "$work/before/optimum_iobinding" "$work/after/optimum_iobinding" | sed "s#$work/##g"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  PYTHONPATH=$site python3 -c 'import onnxruntime, torch, diffusers, transformers; print("onnxruntime", onnxruntime.__version__, "torch", torch.__version__, "diffusers", diffusers.__version__, "transformers", transformers.__version__)'
  echo "peers: $peers (optimum too where $optimum_site has it by then), runs: $runs"; } > "$out/versions.txt" 2>&1
stamp start
cpus=$(nproc) jobs=0
for model in $models; do jobs=$((jobs + 2)); done
share=$(( cpus / jobs )); [ "$share" -ge 1 ] || share=1
i=0 pids=()
for model in $models; do
  for side in before after; do
    first=$(( i * share )) last=$(( i * share + share - 1 )); i=$((i + 1))
    ( cd "$work" && PYTHONPATH="$site:$work/$side" taskset -c "$first-$last" python3 ab_compare.py bench "$work/$side" \
        --scenario transformer $(args_of "$model") --export-only --work "$work/$side-work" \
        > "$out/export-$side-$model.log" 2>&1
      stamp "export $side $model rc $?" ) &
    pids+=($!)
  done
done
for pid in "${pids[@]}"; do wait "$pid"; done
for model in $models; do
  for side in before after; do
    folder=$(ls -d "$work/$side-work"/*-fp16-optimized-blocks* 2>/dev/null | grep -E "$( [ "$model" = flux ] && echo flux || echo sd35m)" | head -1)
    rm -rf "$work/k"  # a failed run must not leave the other side's table to be copied as its own
    ( cd "$work" && PYTHONPATH="$site:$work/$side" timeout 600 python3 transformer_kernels.py --folder "$folder" --out "$work/k" \
        > "$out/kernels-$side-$model.log" 2>&1; rc=$?; cp "$work/k/transformer_kernels-$(basename "$folder").json" "$out/kernels-$side-$model.json"; exit $rc )
    stamp "kernels $side $model rc $?"
  done
done
[ -d "$optimum_site/optimum" ] && peers="$peers,optimum"
for model in $models; do
  ( cd "$work" && PYTHONPATH="$site:$work/after" timeout 1500 python3 ab_compare.py bench "$work/after" --scenario transformer \
      $(args_of "$model") --peers "$peers" --optimum-pythonpath "$optimum_site" --compile-timeout 420 --runs "$runs" \
      --warmup 1 --work "$work/after-work" --out "$out/bench-$model" > "$out/bench-$model.log" 2>&1 )
  stamp "bench $model rc $?"
done
stamp done
}
main "$@"
