#!/usr/bin/env bash
# The video scenario on one GPU machine — `bench --scenario video`: Wan 2.1 T2V 1.3B's architecture at 480×832, 81
# frames (ours, diffusers' torch pipeline eager and compiled, the floor of our transformer's graph) and the MLPerf
# Inference v6.0 shape (Wan 2.2 T2V A14B's transformer at 720×1280) — then the Wan GPU tests. From the project root
# on the GPU machine, after bash .device/w/install.sh (onnxruntime-gpu and diffusers into SITE):
#   bash benchmarks/video_bench.sh OUT [WORK]
# or in the background, polled through OUT/status (one "time part rc N" line per part, "done" last):
#   setsid nohup bash benchmarks/video_bench.sh OUT > /dev/null 2>&1 &
# Environment (default):
#   PARTS          the parts to run, in order (bench tests): smoke (the whole scenario on the tiny Wan model on the GPU,
#                  every CUDA code path in a minute or two), bench, tests (tests/gpu/test_gpu_wan.py)
#   STEPS (4)  BLOCKS (the full 30)  DTYPE (fp16, or bf16)  PEERS (ours,torch,compile,floor)  RUNS (2)  WARMUP (0)
#   VAE_DTYPE (fp32: our export's VAE; fp16)
#   MLPERF_BLOCKS (2)  MLPERF_PEERS (ours,compile; none leaves the table out)  COMPILE_MODE (default, or
#   max-autotune-no-cudagraphs)  TIMEOUT (900: seconds a peer or an export)  COMPILE_TIMEOUT (900)
#   BENCH_TIMEOUT (1700: seconds for the whole bench part)  SITE (/tmp/site)
# Writes to OUT: status, versions.txt, PART.log, video/ (video.json, video.md, video.png), smoke/ (the same, tiny),
# and results.tgz: all of it in one file (the device machine gives back at most 8 files). A peer that fails (or does
# not compile in COMPILE_TIMEOUT) is a row of video.md with its reason and the other peers still run; the bench part's
# status is 1 where ours failed or every peer did.
set -uo pipefail
out=${1:?usage: bash benchmarks/video_bench.sh OUT [WORK]}
work=${2:-/tmp/video-work}
mkdir -p "$out" "$work"
out=$(cd "$out" && pwd)
export PYTHONPATH=${SITE:-/tmp/site}:$PWD PYTHONUNBUFFERED=1
stamp() { echo "$(date +%H:%M:%S) $*" >> "$out/status"; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import onnxruntime, torch, diffusers, transformers; print("onnxruntime", onnxruntime.__version__, onnxruntime.get_available_providers(), "torch", torch.__version__, "diffusers", diffusers.__version__, "transformers", transformers.__version__)'
  echo "git $(git rev-parse --short HEAD 2>/dev/null) + $(git status --short 2>/dev/null | wc -l) changed files; $(nproc) CPUs"
  # whether ORT's TensorRT provider could run here: it lists the provider whether or not TensorRT's libraries are there
  python3 -c 'import ctypes; ctypes.CDLL("libnvinfer.so.10"); print("TensorRT: libnvinfer.so.10 loads")' 2>/dev/null ||
    echo "TensorRT: libnvinfer.so.10 not found"
} > "$out/versions.txt" 2>&1
bench=(python3 -m optimum_iobinding.cli bench --scenario video --work "$work" --runs "${RUNS:-2}" --warmup "${WARMUP:-0}"
       --timeout "${TIMEOUT:-900}" --compile-timeout "${COMPILE_TIMEOUT:-900}" --compile-mode "${COMPILE_MODE:-default}")
run_part() {
  case $1 in
    smoke) "${bench[@]}" --tiny --device cuda --work "$work/tiny" --out "$out/smoke" ;;
    # past BENCH_TIMEOUT: SIGINT (a peer's process is killed with its orchestrator), then the report of what was
    # measured until then
    bench) timeout -s INT -k 120 "${BENCH_TIMEOUT:-1700}" "${bench[@]}" --steps "${STEPS:-4}" --dtypes "${DTYPE:-fp16}" \
             --peers "${PEERS:-ours,torch,compile,floor}" --mlperf-blocks "${MLPERF_BLOCKS:-2}" \
             --mlperf-peers "${MLPERF_PEERS:-ours,compile}" ${BLOCKS:+--blocks "$BLOCKS"} \
             ${VAE_DTYPE:+--vae-dtype "$VAE_DTYPE"} --out "$out/video"
           rc=$?
           if [ ! -f "$out/video/video.md" ] && [ -f "$out/video/video.json" ]; then
             python3 -m optimum_iobinding.cli bench --report-only --out "$out/video"
           fi
           return $rc ;;
    tests) timeout 600 python3 -m pytest -q -p no:cacheprovider -rs -m gpu tests/gpu/test_gpu_wan.py ;;
    *) echo "unknown part: $1 (expected smoke, bench or tests)"; return 2 ;;
  esac
}
stamp start
for part in ${PARTS:-bench tests}; do
  run_part "$part" > "$out/$part.log" 2>&1
  stamp "$part rc $?"
  tar czf "/tmp/video-results.tgz" -C "$out" --exclude results.tgz . && mv /tmp/video-results.tgz "$out/results.tgz"
done
stamp done
