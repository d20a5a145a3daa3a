#!/usr/bin/env bash
# Before / after: the speed of the package at BEFORE_DIR against this checkout's, on the same exports, in one run on
# one GPU machine. On the GPU machine, from the project root, after bash .device/w/install.sh (onnxruntime-gpu and
# diffusers in /tmp/site):
#   bash benchmarks/ab_compare.sh OUT BEFORE_DIR [STEP ...]
# BEFORE_DIR holds an optimum_iobinding folder, e.g. made here with
#   mkdir -p .device/before && git archive COMMIT optimum_iobinding | tar -x -C .device/before
# STEP: any of sd15 sd35m flux stream deepcache (default: all five, in that order). Each is one peer process of the bench,
# as the bench's own orchestrator runs it (optimum_iobinding/bench/cli.py), on the exports the bench makes:
#   sd15    the "defaults" peer of   bench --models sd15 --dtypes fp16 --exports optimized --runs 10
#           (run_gpu.sh's sd15-fp16-defaults): ms/step and the GPU's ms/step inside calls
#   sd35m   the "ours" peer of       bench --scenario transformer --models sd35m --blocks 4 --text-layers 4
#   flux    the "ours" peer of       bench --scenario transformer --models flux-schnell --blocks 2 --text-layers 4
#           (benchmarks/results/h100/2026-11-24-aa22675 and -21914a1): ms/step; --runs 20 here (3 there)
#   stream  the "ours" peer of the 1-step tiny-VAE row of   bench --scenario stream --dtypes fp16 --exports optimized
#           (2026-11-24-7b763c6; 500 frames here, 100 there): frames/s
#   deepcache the "cached" peer of  bench --models sd15 --dtypes fp16 --exports optimized --cache deepcache:3 --steps 50
#           (DeepCache 3:0 on the step-cache export; benchmarks/results/h200/2026-11-28-b9cedf3): ms/step
# First every export the steps need, made once with the after package, side by side (each pinned to its share of
# the CPUs; on an H100 machine SD1.5's took 4-5 min and FLUX.1's 2 + 4 blocks 5.3 min, each alone), into AB_WORK
# (/tmp/ab-work) in the bench's own layout. Then each step runs ROUNDS (2) times each side, in the order before,
# after, before, after, with nothing else running. Both packages are copied first, as they are, to AB_WORK/before and
# AB_WORK/after (with the helper, benchmarks/ab_compare.py): PYTHONPATH=/tmp/site:AB_WORK/before or
# /tmp/site:AB_WORK/after is all that differs between the sides; each process runs from AB_WORK with
# PYTHONSAFEPATH=1 (the project root is not on its sys.path), prints where optimum_iobinding came from, and stops if
# not from its side's folder. With those copies, and bash reading this script whole before it starts (main), a later
# call of the GPU machine that copies a changed working tree over the project root does not change a run in flight
# (start it with setsid and poll OUT/status). About 12 minutes on an H100, half of them the exports.
# Writes to OUT: status (one "time name rc N" line per export and run, "done" last), export-NAME.log,
# STEP-SIDE-ROUND.json (the peer's own result) and .log, versions.txt, package-diff.txt (which files differ between
# the two packages), gpu.txt, and summary.md / summary.json (ab_compare.py summary), printed at the end; the exit
# status is 1 where a measure is out of its tolerance (2 %; frames/s 3 %) or failed.
# Bring OUT back as one archive: the device returns at most 8 files.
# TINY=1: the CPU check of the script: sd35m and flux on tiny-sd3 and tiny-flux, fp32 plain, --device cpu, 3 runs
# (AB_SITE empty, PYTHON=python3 unless set); sd15 and stream need CUDA (their peers time CUDA work) and are skipped.
set -uo pipefail
main() {
usage="usage: bash benchmarks/ab_compare.sh OUT BEFORE_DIR [sd15|sd35m|flux|stream|deepcache ...]"
[ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }
root=$PWD
[ -f "$root/optimum_iobinding/__init__.py" ] && [ -f "$root/benchmarks/ab_compare.py" ] ||
  { echo "ab_compare: run from the project root ($usage)" >&2; exit 2; }
[ -f "$2/optimum_iobinding/__init__.py" ] || { echo "ab_compare: BEFORE_DIR $2 has no optimum_iobinding/" >&2; exit 2; }
[ ! -e "$1" ] || [ -z "$(ls -A "$1")" ] || { echo "ab_compare: OUT $1 is not empty" >&2; exit 2; }
mkdir -p "$1"
out=$(cd "$1" && pwd)
source_before=$(cd "$2" && pwd)
shift 2
steps="${*:-sd15 sd35m flux stream deepcache}"
for step in $steps; do
  case $step in sd15|sd35m|flux|stream|deepcache) ;; *) echo "ab_compare: unknown step $step ($usage)" >&2; exit 2 ;; esac
done
tiny=${TINY:-0}
rounds=${ROUNDS:-2}
work=${AB_WORK:-/tmp/ab-work}
if [ "$tiny" = 1 ]; then site=${AB_SITE-}; else site=${AB_SITE-/tmp/site}; fi
python=${PYTHON:-python3}
limit=${AB_TIMEOUT:-900}  # seconds per process
[ -z "$site" ] || [ -d "$site/onnxruntime" ] || { echo "ab_compare: no onnxruntime in $site: run bash .device/w/install.sh first" >&2; exit 2; }
mkdir -p "$work"
# the two packages and the helper, as they are now: before=$work/before, after=$work/after
before=$work/before after=$work/after helper=$work/ab_compare.py
rm -rf "$before" "$after"
mkdir -p "$before" "$after"
cp -r "$source_before/optimum_iobinding" "$before/" && cp -r "$root/optimum_iobinding" "$after/" &&
  cp "$root/benchmarks/ab_compare.py" "$helper" || { echo "ab_compare: could not copy the packages into $work" >&2; exit 2; }
find "$before" "$after" -name __pycache__ -prune -exec rm -rf {} +
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
stamp() { echo "$(date +%H:%M:%S) $*" >> "$out/status"; }

# run SIDE ARGS...: the bench's command line in a fresh process with SIDE's package (before | after)
run() {
  local side=$1 package; shift
  [ "$side" = before ] && package=$before || package=$after
  (cd "$work" && PYTHONPATH="${site:+$site:}$package" timeout "$limit" "$python" "$helper" bench "$package" "$@")
}

{
  echo "before: $source_before"
  echo "after:  $root (git $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?'), changed files: $(git -C "$root" status --short 2>/dev/null | wc -l))"
  for side in before after; do
    [ "$side" = before ] && p=$before || p=$after
    echo "$side package: $(cd "$p" && find optimum_iobinding -name '*.py' | LC_ALL=C sort | xargs sha1sum | sha1sum | cut -c1-12) (sha1 of its .py files)"
  done
  if diff -rq "$before/optimum_iobinding/bench" "$after/optimum_iobinding/bench" > /dev/null; then
    echo "bench/: the same in both"
  else
    echo "bench/: DIFFERS (each side measures with its own bench/; see package-diff.txt)"
  fi
  echo "python: $("$python" -c 'import sys; print(sys.version.split()[0])'), site: ${site:-none}, tiny: $tiny, rounds: $rounds"
} > "$out/versions.txt"
diff -rq "$before/optimum_iobinding" "$after/optimum_iobinding" | sed "s#$work/##g" > "$out/package-diff.txt"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv > "$out/gpu.txt" 2>&1
stamp start
cat "$out/versions.txt"

# ------------------------------------------------------------------ exports, once, with the after package
if [ "$tiny" = 1 ]; then
  transformer_export=(--dtypes fp32 --exports plain)
  sd35m_model=tiny-sd3 flux_model=tiny-flux device=cpu runs=${TF_RUNS:-3}
else
  transformer_export=()
  sd35m_model=sd35m flux_model=flux-schnell device=cuda runs=${TF_RUNS:-20}
fi
export_args() {
  case $1 in
    sd15) echo --export-only --models sd15 --dtypes fp16 --exports optimized --work "$work" ;;
    sd35m) echo --scenario transformer --models "$sd35m_model" --blocks 4 --text-layers 4 "${transformer_export[@]}" --export-only --work "$work" ;;
    flux) echo --scenario transformer --models "$flux_model" --blocks 2 --text-layers 4 "${transformer_export[@]}" --export-only --work "$work" ;;
    stream) echo --scenario stream --dtypes fp16 --exports optimized --export-only --work "$work" ;;
    deepcache) echo --export-only --models sd15 --dtypes fp16 --exports optimized --cache deepcache:3 --work "$work" ;;
  esac
}
needs_cuda() { [ "$tiny" = 1 ] && { [ "$1" = sd15 ] || [ "$1" = stream ] || [ "$1" = deepcache ]; }; }
todo=()
for step in $steps; do needs_cuda "$step" || todo+=("$step"); done
cpus=$(nproc)
share=$(( cpus / (${#todo[@]} > 0 ? ${#todo[@]} : 1) )); [ "$share" -ge 1 ] || share=1
pids=()
for i in "${!todo[@]}"; do
  step=${todo[$i]}
  first=$(( (i * share) % cpus )); last=$(( first + share - 1 ))
  # stdout: the folders the export printed, one a line (the bench's layout: the steps read them from here)
  ( read -r -a args <<< "$(export_args "$step")"
    taskset -c "$first-$last" bash -c 'cd "$0" && PYTHONPATH="$1" exec "$2" "$3" bench "$4" "${@:5}"' \
      "$work" "${site:+$site:}$after" "$python" "$helper" "$after" "${args[@]}" \
      > "$out/export-$step.out" 2> "$out/export-$step.log"
    rc=$?; stamp "export $step rc $rc"; exit $rc ) &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done

# ------------------------------------------------------------------ the measurements, before / after in turn
folders() {  # STEP: the folders its export printed, one a line
  local line
  while IFS= read -r line; do [ -d "$line" ] && echo "$line"; done < "$out/export-$1.out"
}
measure_args() {  # STEP SIDE ROUND: the peer process's arguments, on the folders its export printed
  local step=$1 image=$work/image-$1-$2-$3.npy result=$out/$1-$2-$3.json folder
  folder=$(folders "$step" | head -1)
  case $step in
    sd15) echo --run-peer defaults --folder "$folder" --model sd15 --dtype fp16 --steps 30 --runs "${SD15_RUNS:-10}" \
            --warmup 1 --image "$image" --result "$result" ;;
    deepcache) echo --run-peer cached --folder "$folder" --model sd15 --dtype fp16 --steps 50 --runs "${SD15_RUNS:-10}" \
            --warmup 1 --cache deepcache:3 --image "$image" --result "$result" ;;
    sd35m|flux)
      local model=$sd35m_model blocks=4
      [ "$step" = flux ] && model=$flux_model blocks=2
      echo --scenario transformer --run-transformer ours --folder "$folder" --model "$model" --runs "$runs" \
        --warmup 1 --device "$device" --image "$image" --blocks "$blocks" --text-layers 4 --result "$result" ;;
    stream)
      local tiny_vae
      tiny_vae=$(folders "$step" | sed -n 2p)
      echo --scenario stream --run-stream ours --folder "$folder" --tiny-vae-folder "$tiny_vae" \
        --stream-config '{"steps":2,"strength":0.5,"stream_batch":true,"vae":"tiny"}' \
        --frames "${STREAM_FRAMES:-500}" --frame-warmup 10 --work "$work" --result "$result" ;;
  esac
}
for step in $steps; do
  if needs_cuda "$step"; then stamp "$step skipped (needs CUDA; TINY=1)"; continue; fi
  if ! grep -q "^[0-9:]* export $step rc 0$" "$out/status"; then stamp "$step skipped (its export failed: export-$step.log)"; continue; fi
  for round in $(seq "$rounds"); do
    for side in before after; do
      read -r -a args <<< "$(measure_args "$step" "$side" "$round")"
      run "$side" "${args[@]}" > "$out/$step-$side-$round.log" 2>&1
      stamp "$step $side $round rc $?"
    done
  done
done
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader >> "$out/gpu.txt" 2>&1
PYTHONPATH= "$python" "$helper" summary "$out" $([ "$tiny" = 1 ] && echo --tiny)
rc=$?
stamp done
return $rc
}
main "$@"
exit $?
