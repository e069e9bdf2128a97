#!/usr/bin/env bash
# The NCCL path on a CUDA machine (see bench/gpu_check.py): snapshot stall, restarts
# (a worker kill -9; a node kill -9 with two GPUs or more) and the in-place re-form
# scenarios (2-4 local agents, one rank each, on one GPU node: a user script on
# elastic.Run and our CNN worker, each against a worker kill -9, a node kill -9 and a
# frozen worker). Prints JSON. Extra arguments go to gpu_check.py, e.g.
#   --dry-run                  the plan as JSON, exit 0 (anywhere, no GPU needed)
#   --checks inplace --ranks 3 --only user:node_kill --repeats 3
#   --inplace-backend gloo     the same scenarios on gloo (CUDA tensors, user script);
#                              the default with fewer GPUs than --ranks: NCCL refuses two
#                              ranks of one communicator on one GPU (Duplicate GPU detected)
#   --cpu                      everything on gloo/CPU, to test the script
#   --json-out bench/results-gpu.json
# Without CUDA (and without --cpu or --dry-run) it says so in one sentence and exits 3.
# A device session's budget is short: a full run takes ~10-15 min; --checks inplace with
# --only picks what fits (each in-place scenario takes ~1-2 min with --ranks 3).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" bench/gpu_check.py "$@"
