#!/usr/bin/env bash
# The whole Sudoku tables sweep on one GPU (issue 35): seeds 0–2 of all 19 models of hparams_search=sudoku_tables,
# the same protocol and CSVs as the CPU campaign (scripts/tables_campaign.sh), many runs side by side on one card.
#
#   bash benchmarks/gpu_tables.sh                       # on a GPU machine (CUDA build of torch in .venv, README)
#   bash benchmarks/gpu_tables.sh --out "$OUT/tables"   # where runs/ and results/ go (default runs/gpu_tables)
#   bash benchmarks/gpu_tables.sh --seeds "0" --jobs 8  # fewer seeds, fewer runs at once
#   bash benchmarks/gpu_tables.sh --dry-run             # no GPU: CPU, 3 models × 1 seed × 20 steps, every code path
#
# Order: phase 1 trains the four MDMs of every seed at once; phase 2 every run built from them (FMLM+ initialised
# and distilled, MLFM) and the FMLM+ from scratch, --jobs at a time, after the finished MDMs' fast decoders
# (scripts/mdm_fast_eval.sh, sampling only: <model>_seed<n>_eval.csv), as the CPU campaign evaluates them. A relaunch
# resumes every unfinished run (each has a deterministic folder); a finished run is only re-evaluated. The results CSVs land in <out>/results/sudoku/<task>/:
# copy them into the repository's results/sudoku/ and run `flowlm-report --config-name report_sudoku`; each row
# records its precision (bf16-mixed here) and device, and the report says when a table mixes machines.
#
# Size (an estimate, not yet measured on a GPU): the CPU campaign's runs converge in ≈ 1 150 steps (MDM) and
# ≈ 3 650 (FMLM+ initialised), ≤ 6 000 by the rule's cap. The tiny DiT's step (≈ 23 GFLOP at batch 128 for an MDM,
# ≈ 1.7× that for FMLM+) is ≈ 0.1 ms of H200 compute, so a step costs its launch and Python overhead: ≈ 10–15 ms (MDM)
# and ≈ 25 ms (FMLM+) a step with one process. Serially one seed is ≈ 25 min (4 MDMs ≈ 1.5 min, 15 derived and
# scratch runs ≈ 23 min at ≈ 4 000 steps); 16 processes share the card (16 CPU cores, each run ≈ 1 GiB of GPU
# memory), so three seeds take ≈ 10 min when the overhead parallelises ≈ 8×. A 600 s limit (--budget-s) stops it
# otherwise; a second launch continues where it stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY="$(command -v python3)"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}" HF_DATASETS_OFFLINE="${HF_DATASETS_OFFLINE:-1}" MPLBACKEND=Agg

out="runs/gpu_tables" seeds="0 1 2" jobs=16 budget=600 dry=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --seeds) seeds="$2"; shift 2 ;;
    --jobs) jobs="$2"; shift 2 ;;
    --budget-s) budget="$2"; shift 2 ;;
    --dry-run) dry=1; shift ;;
    *) echo "gpu_tables: unknown argument $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
case "$jobs$budget" in *[!0-9]*) echo "gpu_tables: --jobs and --budget-s take whole numbers" >&2; exit 2 ;; esac
for s in $seeds; do
  case "$s" in *[!0-9]*) echo "gpu_tables: --seeds takes whole numbers, got '$s'" >&2; exit 2 ;; esac
done

tasks="easy medium hard uncond"
mdms="" derived=""
for t in $tasks; do mdms="$mdms sudoku_mdm_$t"; done
for t in $tasks; do
  derived="$derived sudoku_fmlm_plus_init_$t sudoku_fmlm_plus_distill_$t sudoku_fmlm_plus_scratch_$t"
  [ "$t" = uncond ] || derived="$derived sudoku_mlfm_$t"
done
extra=(trainer=gpu) eval_extra=(trainer=gpu)
if [ "$dry" = 1 ]; then
  mdms="sudoku_mdm_easy" derived="sudoku_fmlm_plus_init_easy sudoku_mlfm_easy" seeds="0" jobs=2
  out="${out%/}_dry_run"
  extra=(trainer=cpu trainer.max_steps=20 trainer.val_check_interval=10 data.num_train=512 data.num_val=64)
  eval_extra=(trainer=cpu)
else
  if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_tables: no CUDA device visible to torch; install a CUDA build of torch (README), or pass --dry-run" >&2
    exit 2
  fi
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || true
fi
mkdir -p "$out/logs" "$out/done"
out="$(cd "$out" && pwd)"
deadline=$(($(date +%s) + budget))

run_one() {  # experiment seed: train (or resume) one run, its log in <out>/logs/
  local left=$((deadline - $(date +%s)))
  if [ "$left" -le 10 ]; then echo "skipped (budget spent): $1 seed $2"; return 0; fi
  local source
  source="$(sed -n 's/^source: *\([A-Za-z0-9_]*\).*/\1/p' "conf/experiment/$1.yaml")"
  if [ -n "$source" ] && [ ! -e "$out/done/${source}_seed$2" ]; then
    echo "skipped: $1 seed $2 (its source $source did not finish)"; return 0
  fi
  if timeout "$left" env FLOWLM_RUNS="$out/runs" FLOWLM_DATA="$out/data" FLOWLM_RESULTS="$out/results" \
    OMP_NUM_THREADS=1 "$PY" -m runners.train -m hparams_search=sudoku_tables "experiment=$1" "seed=$2" \
    "hydra.sweep.dir=$out/multirun/$1_seed$2" "${extra[@]}" >"$out/logs/$1_seed$2.log" 2>&1; then
    touch "$out/done/$1_seed$2"
    echo "done: $1 seed $2"
  else
    echo "NOT finished (rc $?): $1 seed $2 — see $out/logs/$1_seed$2.log"
  fi
}
eval_one() {  # experiment seed: a finished MDM's fast decoders (scripts/mdm_fast_eval.sh), its log in <out>/logs/
  local left=$((deadline - $(date +%s)))
  if [ "$left" -le 10 ]; then echo "skipped (budget spent): $1 seed $2, fast decoders"; return 0; fi
  if [ ! -e "$out/done/$1_seed$2" ]; then echo "skipped: $1 seed $2, fast decoders (it did not finish)"; return 0; fi
  if [ -e "$out/done/$1_seed$2_eval" ]; then return 0; fi
  if timeout "$left" env FLOWLM_PYTHON="$PY" FLOWLM_RUNS="$out/runs" FLOWLM_DATA="$out/data" OMP_NUM_THREADS=1 \
    bash scripts/mdm_fast_eval.sh "$out/runs/$1/cpu/seed$2" "$out/results/sudoku" "${eval_extra[@]}" \
    >"$out/logs/$1_seed$2_eval.log" 2>&1; then
    touch "$out/done/$1_seed$2_eval"
    echo "done: $1 seed $2, fast decoders"
  else
    echo "NOT finished (rc $?): $1 seed $2, fast decoders — see $out/logs/$1_seed$2_eval.log"
  fi
}
export -f run_one eval_one
export out deadline PY
export EXTRA="${extra[*]}" EVAL_EXTRA="${eval_extra[*]}"

phase() {  # name, then "function experiment seed" lines on stdin: run them --jobs at a time, in that order
  echo "== $1 ($(date -u +%T))"
  xargs -P "$jobs" -L 1 bash -c 'extra=($EXTRA) eval_extra=($EVAL_EXTRA); "$0" "$1" "$2"'
}
for s in $seeds; do for e in $mdms; do echo "run_one $e $s"; done; done | phase "phase 1: the MDMs"
{  # the fast decoders first: short, and not left to a budget the derived runs spent
  for s in $seeds; do for e in $mdms; do echo "eval_one $e $s"; done; done
  for s in $seeds; do for e in $derived; do echo "run_one $e $s"; done; done
} | phase "phase 2: the MDMs' fast decoders, then the runs built from them"
echo "== results: $out/results/sudoku ($(find "$out/results" -name '*.csv' 2>/dev/null | wc -l) CSV files)"
