#!/usr/bin/env bash
# Sets up both test environments from scratch and runs the whole suite in each (CPU; GPU tests skip without CUDA):
#   .venv           main: diffusers 0.42, transformers 5, Ray Serve 2.60   (constraints.txt)
#   .venv-optimum   optimum-onnx: diffusers 0.39, transformers 4.57, optimum 2.1 (constraints-optimum.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
setup() {  # setup VENV CONSTRAINTS EXTRAS
  [ -x "$1/bin/python" ] || python3 -m venv "$1"
  "$1/bin/pip" install -q -c "$2" -e ".[$3]"
}
setup .venv constraints.txt cpu,test,serve
.venv/bin/python -m pytest -q "$@"
setup .venv-optimum constraints-optimum.txt cpu,test,optimum
.venv-optimum/bin/python -m pytest -q "$@"
