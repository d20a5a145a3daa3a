#!/usr/bin/env bash
# Sets up both test environments from scratch and runs the tests in each, on every core (CPU; GPU tests skip
# without CUDA):
#   .venv           main: diffusers 0.42, transformers 5, Ray Serve 2.60, PyAV 18   (constraints.txt)
#                   first the formatter and the lint set (ruff, pyproject.toml), the layering contracts
#                   (lint-imports, setup.cfg), then the whole suite
#   .venv-optimum   optimum-onnx: diffusers 0.39, transformers 4.57, optimum 2.1 (constraints-optimum.txt)
#                   what can differ with those library versions: optimum's own pipelines and exporter
#                   (tests/test_optimum.py) and every test of the pipelines and the export that compares with diffusers'
#                   or optimum's output or reads their folders, each in its first case (--first-case-only: the other
#                   cases mostly vary our side, which the main suite runs); ORT's fusions (the same onnxruntime in both),
#                   the runtime, the server, the command line and video I/O run once, in .venv
# Both run a test process per core (-n auto; conftest.py keeps each to one thread); the tests that start Ray run in one
# of them (--dist loadgroup, their xdist_group), the optimum set a module per process (--dist loadscope: each module's
# exports made once).
# Arguments go to both pytest runs (e.g. -x; a -k of yours replaces the optimum run's selection there).
set -euo pipefail
cd "$(dirname "$0")/.."
# The installs compile no bytecode up front (all of torch and Ray); what the tests import is compiled once, by the
# first process that imports it, and kept: with PYTHONDONTWRITEBYTECODE set, as on some machines, every test process,
# Ray worker and server would compile torch again.
unset PYTHONDONTWRITEBYTECODE
# Installs go through uv (pip's resolver and unpacking were a minute of the run; uv is seconds, and the second
# environment links the first one's files from uv's cache). uv reads no pip.conf: the machine's wheel folders and
# indexes, constraint and certificate pip is configured with are handed to it. Where uv cannot be installed or an
# install through it fails, pip does that install.
pip_setting() { python3 -m pip config get "global.$1" 2>/dev/null || true; }
uv_args=(--index-strategy unsafe-best-match)  # as pip: the best version on any index
for link in ${PIP_FIND_LINKS:-$(pip_setting find-links)}; do
  if [ -e "${link#file://}" ] || [[ $link == http* ]]; then uv_args+=(--find-links "$link"); fi
done
constraint=${PIP_CONSTRAINT:-$(pip_setting constraint)}  # the machine's own caps (torch's here)
if [ -n "$constraint" ] && [ -f "$constraint" ]; then uv_args+=(-c "$constraint"); fi
if [ -n "${PIP_CERT:-}" ]; then export SSL_CERT_FILE=${SSL_CERT_FILE:-$PIP_CERT}; fi
index=${PIP_INDEX_URL:-$(pip_setting index-url)}
if [ -n "$index" ]; then uv_args+=(--default-index "$index"); fi
for url in ${PIP_EXTRA_INDEX_URL:-$(pip_setting extra-index-url)}; do
  if [ -d "${url#file://}" ] || [[ $url == http* ]]; then uv_args+=(--index "$url"); fi
done
[ -x .venv/bin/python ] || python3 -m venv .venv
uv=.venv/bin/uv
[ -x "$uv" ] || .venv/bin/pip install -q -c constraints.txt uv >/dev/null 2>&1 || uv=
setup() {  # setup VENV CONSTRAINTS EXTRAS: uv, or pip where uv is missing or fails
  [ -x "$1/bin/python" ] || python3 -m venv "$1"
  if [ -z "$uv" ] || ! "$uv" pip install -q --python "$1/bin/python" "${uv_args[@]}" -c "$2" -e ".[$3]"; then
    "$1/bin/pip" install -q --no-compile -c "$2" -e ".[$3]"
  fi
}
setup .venv constraints.txt cpu,test,serve,video
# the optimum environment installs meanwhile (mostly downloads; its log is shown if it fails). The suites run one
# after the other, each a process per core: both are CPU-bound (a process more than cores made the main suite slower)
set -m  # in a process group of its own: stopped whole (pip too) if this script ends first
setup .venv-optimum constraints-optimum.txt cpu,test,optimum > .venv-optimum.log 2>&1 &
optimum_setup=$!
set +m
trap 'kill -- -"$optimum_setup" 2>/dev/null || true' EXIT
.venv/bin/ruff format --check --quiet .
.venv/bin/ruff check --quiet .
.venv/bin/lint-imports
.venv/bin/python -m pytest -q -n auto --dist loadgroup "$@"
wait "$optimum_setup" || { cat .venv-optimum.log >&2; exit 1; }
trap - EXIT
.venv-optimum/bin/python -m pytest -q -n auto --dist loadscope --first-case-only tests/test_optimum.py tests/pipelines \
  tests/export -k "(diffusers or optimum) and not fused and not optimiz" "$@"
