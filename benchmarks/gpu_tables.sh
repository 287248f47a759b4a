#!/usr/bin/env bash
# The Sudoku tables on one GPU (issues 35, 47, 51): every model of hparams_search=sudoku_tables under its fixed-budget
# protocol (docs/results.md#the-protocol), by default at the paper's scale — 9×9 boards, the `mini` DiT, batch 256,
# the released 20 000 steps (scale=paper budget=20000) — writing the same CSVs as the CPU campaign
# (scripts/tables_campaign.sh), several runs side by side on one card.
#
#   bash benchmarks/gpu_tables.sh                       # on a GPU machine (CUDA build of torch in .venv, README)
#   bash benchmarks/gpu_tables.sh --out "$OUT/tables"   # where runs/, results/ and logs/ go (default runs/gpu_tables)
#   bash benchmarks/gpu_tables.sh --scale cpu           # the CPU campaign's models (6×6, tiny, 20 000 steps) on a GPU
#   bash benchmarks/gpu_tables.sh --seeds "0" --jobs 4 --budget-s 3000   # fewer seeds or runs at once, a time limit
#   bash benchmarks/gpu_tables.sh --scale cpu --seeds "0 1 2 3 4" \
#     --models "sudoku_mdm_easy sudoku_fmlm_plus_scratch_easy"   # some of the 19 models (issue 47's headline pair)
#   bash benchmarks/gpu_tables.sh --plan ...            # print the two phases and the seeds the arguments give, run none
#   bash benchmarks/gpu_tables.sh --archive out.tgz     # also pack results/, logs/ and done/ into one file at the end
#   bash benchmarks/gpu_tables.sh --dry-run             # no GPU: CPU, 3 models × 1 seed × 16 steps, every code path,
#                                                       # and the measured seconds a step of each, scaled to the plan
#   bash benchmarks/gpu_tables.sh --wheels .whl         # a machine without internet whose python3 holds a CUDA torch:
#                                                       # the other packages from scripts/wheelhouse.py's wheels
#
# Order: phase 1 trains every model that starts from scratch (the MDMs first, then FMLM+ from scratch), each sampled
# offline once finished (its curve, then an MDM's fast decoders: scripts/sudoku_curve.sh, scripts/mdm_fast_eval.sh,
# as the campaign does); phase 2 the runs built from an MDM (FMLM+ initialised and distilled, MLFM), sampled likewise.
# A model of --models whose source MDM is neither in --models nor finished in <out> is refused before anything runs.
# A run still going at the time limit (--budget-s) gets SIGTERM (it saves its checkpoint), SIGKILL 30 s later.
# A relaunch resumes: each run has a deterministic folder and continues from its last checkpoint; a finished run or
# evaluation (marked in <out>/done/) is not repeated. The script prints the resume command when time runs out.
# Shared by the jobs: one inductor compile cache (<out>/inductor_cache: the second process of a shape compiles from
# it), one MLflow tracking server (scripts/mlflow_server.sh on 127.0.0.1, its SQLite store written by one process:
# sixteen jobs writing one SQLite file directly wait on its lock), and the data cache.
# The results CSVs land in <out>/results/sudoku/<task>/: copy them into the repository's results/sudoku/ and run
# `flowlm-report --config-name report_sudoku`; each row records its precision (bf16-mixed) and device.
#
# Size at the paper's scale (an estimate from FLOPs, not measured on a GPU): the `mini` DiT (25 M parameters) at
# batch 256 × 180 tokens is ≈ 7 TFLOP a training step (6 N tokens, attention aside) for an MDM, ≈ 1.7× that for an
# FMLM+ (its teacher passes); at ≈ 300 TFLOP/s of bf16 (a third of an H100's dense peak) a step is ≈ 25 ms (MDM) and
# ≈ 40 ms (FMLM+): 20 000 steps ≈ 8 and 14 min, the curve's sampling ≈ 1 min more. One seed of the 19 models is
# ≈ 4 h on one card (compute-bound: running them side by side does not shorten it), three seeds ≈ 12 h. At
# --scale cpu the step is launch-bound (≈ 10–25 ms), 20 000 steps ≈ 3–8 min a model, one seed ≈ 2.5 h serially,
# ≈ 35 min with 16 jobs. `--dry-run` measures the seconds a step on this machine and prints the plan's estimate.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}" MPLBACKEND=Agg

out="runs/gpu_tables" seeds="0 1 2" jobs=16 limit=600 dry=0 scale=paper wheels="" models="" plan=0 archive=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --seeds) seeds="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --budget-s) limit="$2"; shift 2 ;;
    --scale) scale="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --wheels) wheels="$2"; shift 2 ;;
    --models) models="$2"; shift 2 ;;
    --plan) plan=1; shift ;;
    --archive) archive="$2"; shift 2 ;;
    *) echo "gpu_tables: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
case "$jobs$limit" in *[!0-9]*|"") echo "gpu_tables: --jobs and --budget-s take whole numbers" >&2; exit 2 ;; esac
for s in $seeds; do
  case "$s" in *[!0-9]*) echo "gpu_tables: --seeds takes whole numbers, got '$s'" >&2; exit 2 ;; esac
done
case "$scale" in
  paper) scale_args=(scale=paper budget=20000) ;;  # the released Sudoku script's 20 000 steps (warm-up 2 500)
  cpu) scale_args=(scale=cpu) ;;                   # the campaign's budget (conf/hparams_search/sudoku_tables.yaml)
  *) echo "gpu_tables: --scale takes paper or cpu, got '$scale'" >&2; exit 2 ;;
esac

tasks="easy medium hard uncond"
all=""  # the 19 models, sources first
for t in $tasks; do all="$all sudoku_mdm_$t"; done
for t in $tasks; do all="$all sudoku_fmlm_plus_scratch_$t"; done
for t in $tasks; do
  all="$all sudoku_fmlm_plus_init_$t sudoku_fmlm_plus_distill_$t"
  [ "$t" = uncond ] || all="$all sudoku_mlfm_$t"
done
extra=(trainer=gpu "${scale_args[@]}") eval_extra=(trainer=gpu)
if [ "$dry" = 1 ]; then
  [ -n "$models" ] || models="sudoku_mdm_easy sudoku_fmlm_plus_init_easy sudoku_mlfm_easy"
  seeds="0" jobs=2 scale=cpu
  out="${out%/}_dry_run"
  extra=(trainer=cpu scale=cpu budget=16 trainer.val_check_interval=8 data.num_train=512 data.num_val=64)
  eval_extra=(trainer=cpu)
fi
source_of() {  # experiment: the MDM it starts from (its file's `source:` line), empty for a model from scratch
  sed -n 's/^source: *\([A-Za-z0-9_]*\).*/\1/p' "conf/experiment/$1.yaml"
}
[ -n "$models" ] || models="$all"
for m in $models; do
  case " $all " in *" $m "*) ;; *) echo "gpu_tables: --models: $m is not one of the tables' models:$all" >&2; exit 2 ;; esac
done
sources="" derived=""  # phase 1 and phase 2, each in the order of $all
for m in $all; do
  case " $models " in *" $m "*) ;; *) continue ;; esac
  src="$(source_of "$m")"
  if [ -z "$src" ]; then sources="$sources $m"; continue; fi
  derived="$derived $m"
  case " $models " in *" $src "*) continue ;; esac
  for s in $seeds; do
    if [ ! -e "$out/done/${src}_seed$s" ]; then
      echo "gpu_tables: --models: $m starts from $src, which is neither in --models nor finished in $out (seed $s)" >&2
      exit 2
    fi
  done
done
if [ -n "$archive" ]; then  # its folder must exist and take a file: refused now, not after the runs
  case "$archive" in /*) ;; *) archive="$PWD/$archive" ;; esac
  if [ ! -d "$(dirname "$archive")" ] || [ ! -w "$(dirname "$archive")" ]; then
    echo "gpu_tables: --archive $archive: its folder does not exist or cannot be written" >&2
    exit 2
  fi
fi
if [ "$plan" = 1 ]; then
  echo "phase 1, from scratch:${sources:- none}"
  echo "phase 2, from an MDM:${derived:- none}"
  echo "seeds: $seeds; at most $jobs at once; time limit $limit s; out: $out"
  exit 0
fi
if [ -n "$wheels" ]; then  # after every check of the arguments, before anything imports torch
  source benchmarks/wheels.sh
  use_wheels "$wheels" "$PY" || exit $?
fi
if [ "$dry" != 1 ]; then
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_tables: no CUDA device visible to torch; install a CUDA build of torch (README), or pass --dry-run" >&2
    exit 2
  fi
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
fi
mkdir -p "$out/logs" "$out/done"
out="$(cd "$out" && pwd)"
deadline=$(($(date +%s) + limit))
export TORCHINDUCTOR_CACHE_DIR="$out/inductor_cache"

# One tracking server for every job (its SQLite store has a single writer); stopped when this script ends.
port="$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
# Its `mlflow` command: the wheels' (use_wheels), else the one beside $PY, else scripts/mlflow_server.sh's own choice.
if [ -z "${MLFLOW:-}" ] && [ -x "$(dirname "$PY")/mlflow" ]; then export MLFLOW="$(dirname "$PY")/mlflow"; fi
FLOWLM_RUNS="$out/runs" MLFLOW_PORT="$port" bash scripts/mlflow_server.sh >"$out/logs/mlflow_server.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
# Ready when /health answers (a minute or more on a loaded machine); no job starts before, none at all without it.
"$PY" - "http://127.0.0.1:$port/health" "$server" <<'EOF' || { echo "gpu_tables: the tracking server did not start: $out/logs/mlflow_server.log" >&2; exit 1; }
import os, sys, time, urllib.request

deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    try:
        urllib.request.urlopen(sys.argv[1], timeout=5)
        sys.exit(0)
    except OSError:
        os.kill(int(sys.argv[2]), 0)  # the server ended: ProcessLookupError, exit 1
        time.sleep(1)
sys.exit(1)
EOF
export MLFLOW_TRACKING_URI="http://127.0.0.1:$port"
extra+=(logger=mlflow_server)

run_one() {  # experiment seed: train (or resume) one run, then sample it offline; its logs in <out>/logs/
  local left=$((deadline - $(date +%s))) source
  if [ "$left" -le 10 ]; then echo "skipped (time limit): $1 seed $2"; return 0; fi
  source="$(source_of "$1")"
  if [ -n "$source" ] && [ ! -e "$out/done/${source}_seed$2" ]; then
    echo "skipped: $1 seed $2 (its source $source did not finish)"; return 0
  fi
  if [ ! -e "$out/done/$1_seed$2" ]; then
    local t0=$SECONDS
    if timeout -k 30 "$left" env FLOWLM_RUNS="$out/runs" FLOWLM_DATA="$out/data" FLOWLM_RESULTS="$out/results" \
      OMP_NUM_THREADS=1 "$PY" -m runners.train -m hparams_search=sudoku_tables "experiment=$1" "seed=$2" \
      "hydra.sweep.dir=$out/multirun/$1_seed$2" "${extra[@]}" >"$out/logs/$1_seed$2.log" 2>&1; then
      touch "$out/done/$1_seed$2"
      echo "done: $1 seed $2 ($((SECONDS - t0)) s)"
    else
      echo "NOT finished (rc $?): $1 seed $2 — see $out/logs/$1_seed$2.log"; return 0
    fi
  fi
  eval_one "$1" "$2"
}
eval_one() {  # experiment seed: a finished run's curve, then an MDM's fast decoders (sampling only)
  [ -e "$out/done/$1_seed$2_eval" ] && return 0
  local script scripts=(sudoku_curve.sh) left
  [[ "$1" == sudoku_mdm_* ]] && scripts+=(mdm_fast_eval.sh)
  for script in "${scripts[@]}"; do
    left=$((deadline - $(date +%s)))
    if [ "$left" -le 10 ]; then echo "skipped (time limit): $1 seed $2, $script"; return 0; fi
    if timeout -k 30 "$left" env FLOWLM_PYTHON="$PY" FLOWLM_RUNS="$out/runs" FLOWLM_DATA="$out/data" \
      OMP_NUM_THREADS=1 bash "scripts/$script" "$out/runs/$1/$scale/seed$2" "$out/results/sudoku" "${eval_extra[@]}" \
      >>"$out/logs/$1_seed$2_eval.log" 2>&1; then :; else
      echo "NOT finished (rc $?): $1 seed $2, $script — see $out/logs/$1_seed$2_eval.log"; return 0
    fi
  done
  touch "$out/done/$1_seed$2_eval"
  echo "done: $1 seed $2, evaluations"
}
export -f run_one eval_one source_of
export out deadline PY scale
export EXTRA="${extra[*]}" EVAL_EXTRA="${eval_extra[*]}"

phase() {  # name, then "experiment seed" lines on stdin: run them --jobs at a time, in that order (none: nothing)
  local lines
  lines="$(cat)"
  if [ -z "$lines" ]; then echo "== $1: none"; return 0; fi
  echo "== $1 ($(date -u +%T))"
  printf '%s\n' "$lines" | xargs -r -P "$jobs" -L 1 bash -c 'extra=($EXTRA) eval_extra=($EVAL_EXTRA); run_one "$0" "$1"'
}
for s in $seeds; do for e in $sources; do echo "$e $s"; done; done | phase "phase 1: the models from scratch"
for s in $seeds; do for e in $derived; do echo "$e $s"; done; done | phase "phase 2: the runs built from an MDM"
unfinished=0
for s in $seeds; do for e in $sources $derived; do
  [ -e "$out/done/${e}_seed${s}_eval" ] || unfinished=$((unfinished + 1))
done; done
echo "== results: $out/results/sudoku ($(find "$out/results" -name '*.csv' 2>/dev/null | wc -l) CSV files)"
if [ "$dry" = 1 ]; then  # seconds a step measured here (the runs' own wall time, evaluations included)
  "$PY" - "$out/runs" <<'EOF'
import json, sys
from pathlib import Path

for record in sorted(Path(sys.argv[1]).glob("*/cpu/seed*/convergence.json")):
    r = json.loads(record.read_text())
    print(f"{record.parts[-4]}: {r['steps']} steps in {r['wall_s']:.0f} s ({r['wall_s'] / max(r['steps'], 1):.2f} s a step, "
          "compile and evaluation included)")
EOF
fi
if [ "$unfinished" -gt 0 ]; then
  echo "== $unfinished model(s) not finished; to resume: bash $0 --out $out --scale $scale --seeds \"$seeds\" --jobs $jobs" \
    "--models \"$(echo $models)\"${wheels:+ --wheels $wheels}"
fi
if [ -n "$archive" ]; then  # the CSVs, logs and markers in one file (a machine whose files come back few at a time)
  mkdir -p "$out/results"
  tar -czf "$archive" -C "$out" results logs done
  echo "== archive: $archive ($(du -h "$archive" | cut -f1))"
fi
