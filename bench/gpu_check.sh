#!/usr/bin/env bash
# The NCCL path on a CUDA machine (see bench/gpu_check.py): snapshot stall, a worker
# killed with kill -9, a node killed (two GPUs or more). Prints JSON; on a machine
# without CUDA it prints {"skipped": ...}. Extra arguments go to gpu_check.py
# (e.g. --json-out bench/results-gpu.json, or --cpu to exercise it on gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" bench/gpu_check.py "$@"
