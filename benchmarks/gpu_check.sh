#!/usr/bin/env bash
# GPU performance check (issue 8): training tokens/s and MFU of the `small` backbone with and without torch.compile
# (bf16 autocast, SDPA), Lightning vs bare loop, and the sampler-overhead ratios, on one GPU; under 10 minutes on an
# H100/H200 (a 600 s timeout stops it otherwise; the Python side also skips later sections past --budget-s).
#
#   bash benchmarks/gpu_check.sh                          # on a GPU machine (CUDA build of torch in .venv, README)
#   bash benchmarks/gpu_check.sh --peak-tflops 165        # a card the script does not know
#   bash benchmarks/gpu_check.sh --json runs/gpu_check.json   # default: runs/gpu_check/<UTC time>.json
#   bash benchmarks/gpu_check.sh --dry-run                # no GPU needed: CPU, tiny sizes, every code path
#   bash benchmarks/gpu_check.sh --wheels .whl            # a machine without internet whose python3 holds a CUDA
#                                                         # torch: the other packages from scripts/wheelhouse.py
#
# Without a CUDA device (and without --dry-run / --device cpu) it stops at once with a message and status 2.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}"

args=()  # "$@" less --wheels DIR, which is this script's
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels)
      [ $# -ge 2 ] || { echo "gpu_check: --wheels takes a folder of wheels" >&2; exit 2; }
      source benchmarks/wheels.sh
      use_wheels "$2" "$PY" || exit $?
      shift 2 ;;
    *) args+=("$1"); shift ;;
  esac
done
set -- ${args[@]+"${args[@]}"}
cpu_mode=0
for arg in "$@"; do
  case "$arg" in --dry-run|cpu) cpu_mode=1 ;; esac
done
if [ "$cpu_mode" = 0 ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1 && [ ! -e /dev/nvidia0 ]; then
    echo "gpu_check: no CUDA device on this machine (no nvidia-smi, no /dev/nvidia0); run it on a GPU machine, or pass --dry-run for the CPU smoke mode" >&2
    exit 2
  fi
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: no CUDA device visible to torch ($("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo 'torch missing')); install a CUDA build of torch (README), or pass --dry-run" >&2
    exit 2
  fi
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
fi
# The figures file is rewritten after every line and section (status running / stopped / done): a timeout keeps
# what was measured. Without --json it goes to runs/gpu_check/<UTC time>.json.
json_given=0
for arg in "$@"; do
  case "$arg" in --json|--json=*) json_given=1 ;; esac
done
if [ "$json_given" = 0 ]; then
  set -- "$@" --json "runs/gpu_check/$(date -u +%Y%m%dT%H%M%SZ).json"
  echo "gpu_check: figures written as they come to ${*: -1}"
fi
exec timeout 600 "$PY" benchmarks/gpu_check.py "$@"
