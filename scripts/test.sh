#!/usr/bin/env bash
# Sets up both test environments from scratch and runs the tests in each, on every core (CPU; GPU tests skip
# without CUDA):
#   .venv           main: diffusers 0.42, transformers 5, Ray Serve 2.60, PyAV 18   (constraints.txt)
#                   first the layering contracts (lint-imports, setup.cfg), then the whole suite
#   .venv-optimum   optimum-onnx: diffusers 0.39, transformers 4.57, optimum 2.1 (constraints-optimum.txt)
#                   the tests whose outcome can differ between those library versions: all but the ones that never
#                   touch diffusers, transformers or optimum (the model's own, shapes, CUDA policy, the load test),
#                   the server's (no Ray there), the GPU's (no CUDA on the CI machines) and video I/O's (it touches
#                   none of those libraries, and that environment has no video extra)
# Arguments go to both pytest runs (e.g. -k lora, -x).
set -euo pipefail
cd "$(dirname "$0")/.."
setup() {  # setup VENV CONSTRAINTS EXTRAS
  [ -x "$1/bin/python" ] || python3 -m venv "$1"
  "$1/bin/pip" install -q -c "$2" -e ".[$3]"
}
setup .venv constraints.txt cpu,test,serve,video
.venv/bin/lint-imports
.venv/bin/python -m pytest -q -n auto "$@"
setup .venv-optimum constraints-optimum.txt cpu,test,optimum
.venv-optimum/bin/python -m pytest -q -n auto \
  --ignore=tests/runtime/test_model.py --ignore=tests/runtime/test_shapes.py \
  --ignore=tests/runtime/test_cuda_policy.py --ignore=tests/serve/test_loadtest.py \
  --ignore=tests/serve/test_serve.py --ignore=tests/gpu/test_gpu.py --ignore=tests/test_video.py "$@"
