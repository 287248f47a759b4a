#!/usr/bin/env bash
# The Sudoku tables' budget study (issue 47 item 1, docs/results.md#the-budget-study): a finished tables model trained
# on past its budget under the same recipe, so that its accuracy-versus-training curve shows where the last quarter
# of the steps gains < 1 point at one call per generated position. The model's last.ckpt is copied into a study run
# (name <experiment>_long, its own folder: the tables' run and rows stay as they are), which resumes from it to
# MAX_STEPS with the tables' settings unchanged (the same warm-up steps, learning rate, EMA, bf16; a checkpoint at
# every eighth of the original budget); then scripts/sudoku_curve.sh samples every kept checkpoint at NFE 4 and one
# call per position (512 puzzles). Rows: <study>/results/sudoku/<task>/<experiment>_long_seed<n>{,_eval}.csv.
# Resumable: run it again (after a stop, a session's end, a reboot) and it goes on from the last checkpoint, and
# samples only the checkpoints not sampled yet. One study at a time per folder (its run folder's lock).
#
#   scripts/sudoku_budget_study.sh budget                    # the rule on every curve point so far: each step's
#                                                            # gain over its last quarter, and the budget it gives
#   scripts/sudoku_budget_study.sh start RUN_DIR MAX_STEPS   # e.g. ../flowlm_campaign/runs/sudoku_mdm_easy/cpu/seed0 24000
#   scripts/sudoku_budget_study.sh status
#   scripts/sudoku_budget_study.sh stop
#
# Its folder: $FLOWLM_STUDY (default ../flowlm_budget_study beside the checkout): code/ (a clone of this checkout),
# runs/, data/, results/, study.log, study.pid.
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
STUDY="$(realpath -m "${FLOWLM_STUDY:-$ROOT/../flowlm_budget_study}")"
PYTHON="${FLOWLM_PYTHON:-$ROOT/.venv/bin/python}"
# One thread a process by default: two campaigns (one per model) and the tests share the 2-core machine, and a
# 2-thread training beside another job ran 3–10× slower than on one thread (docs/results.md#the-campaign)
THREADS="${FLOWLM_THREADS:-1}"

running() { [[ -f "$STUDY/study.pid" ]] && kill -0 "$(cat "$STUDY/study.pid")" 2>/dev/null; }

case "${1:-status}" in
start)
    [[ $# -eq 3 && "$3" =~ ^[0-9]+$ ]] || { echo "usage: $0 start RUN_DIR MAX_STEPS" >&2; exit 2; }
    src="$(realpath -m "$2")" max="$3"
    [[ -f "$src/run_config.yaml" && -f "$src/checkpoints/last.ckpt" ]] \
        || { echo "$0: $src holds no finished run (run_config.yaml and checkpoints/last.ckpt)" >&2; exit 2; }
    [[ -x "$PYTHON" ]] || { echo "no $PYTHON: run 'make venv' first (or set FLOWLM_PYTHON)" >&2; exit 2; }
    if running; then echo "refused: a study runs in $STUDY (pid $(cat "$STUDY/study.pid")); 'stop' ends it" >&2; exit 2; fi
    read -r exp seed budget < <("$PYTHON" -c '
import sys, yaml
c = yaml.safe_load(open(sys.argv[1]))
if c.get("sweep", {}).get("name") != "sudoku_tables":
    sys.exit(f"{sys.argv[1]}: not a run of hparams_search=sudoku_tables")
print(c["name"], c["seed"], c["trainer"]["max_steps"])' "$src/run_config.yaml") || exit 2
    ((max > budget)) || { echo "$0: MAX_STEPS $max is not past the run's own $budget steps" >&2; exit 2; }
    run="$STUDY/runs/${exp}_long/cpu/seed$seed"
    mkdir -p "$STUDY" "$run/checkpoints"
    if [[ ! -f "$run/checkpoints/last.ckpt" ]]; then  # the study's first leg starts from the finished model
        cp "$src/run_config.yaml" "$run/run_config.yaml"
        cp "$src/checkpoints/last.ckpt" "$run/checkpoints/last.ckpt"
    fi
    if [[ ! -d "$STUDY/code/.git" ]]; then git clone -q "$ROOT" "$STUDY/code"; fi
    # The tables' recipe with the budget it was trained under (its warm-up steps and the curve's interval are the
    # run's own; the interval may be widened, FLOWLM_STUDY_EVERY): only the step count and the name change. In legs of
    # FLOWLM_STUDY_LEG steps (default 3 000), each followed by the curve of the checkpoints kept so far, so a session
    # that ends mid-study keeps what it sampled; only the last leg samples its final weights (on every val puzzle).
    every="${FLOWLM_STUDY_EVERY:-$((budget / 8))}" leg="${FLOWLM_STUDY_LEG:-3000}"
    [[ "$every" =~ ^[1-9][0-9]*$ && "$leg" =~ ^[1-9][0-9]*$ ]] \
        || { echo "$0: FLOWLM_STUDY_EVERY and FLOWLM_STUDY_LEG must be positive integers" >&2; exit 2; }
    # The curve on every val puzzle (16 batches: 2 000), not the tables' 512: the rule reads gains of about a point,
    # under the ±1.5-point error of 512 puzzles at 88 %; a point sampled on fewer is sampled again
    export FLOWLM_CURVE_BATCHES="${FLOWLM_STUDY_BATCHES:-16}"
    # the rows' name (the run folder keeps the source run's run_config.yaml, named after it): the curve's resume reads
    # the study's own CSV, so each leg samples only its new checkpoints
    export FLOWLM_CURVE_NAME="${exp}_long"
    setsid nohup bash -c '
        set -euo pipefail
        study="$1" threads="$2" python="$3" exp="$4" seed="$5" budget="$6" max="$7" every="$8" leg="$9"
        cd "$study/code"
        export PYTHONPATH="$study/code" FLOWLM_RUNS="$study/runs" FLOWLM_DATA="$study/data" \
            FLOWLM_RESULTS="$study/results" OMP_NUM_THREADS="$threads" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
            MPLBACKEND=Agg FLOWLM_PYTHON="$python"
        run="$study/runs/${exp}_long/cpu/seed$seed"
        step() {  # the step of the run folder'"'"'s last.ckpt
            "$python" -c "import sys, torch; print(torch.load(sys.argv[1], map_location=\"cpu\", weights_only=False)[\"global_step\"])" \
                "$run/checkpoints/last.ckpt"
        }
        at="$(step)"
        while ((at < max)); do
            end=$((at + leg < max ? at + leg : max))
            final=false; if ((end == max)); then final=true; fi
            echo "$(date -u +%FT%TZ) train $exp seed $seed from step $at to $end of $max (code $(git rev-parse --short HEAD))"
            nice -n 10 "$python" -m runners.train -m hparams_search=sudoku_tables "experiment=$exp" "seed=$seed" \
                "budget=$budget" "trainer.max_steps=$end" "eval.every_n_steps=$max" "final_eval=$final" \
                "callbacks.curve.every_n_train_steps=$every" "name=${exp}_long" \
                "hydra.sweep.dir=$study/multirun/${exp}_long_seed$seed"
            echo "$(date -u +%FT%TZ) at step $end: the curve so far"
            FLOWLM_CURVE_UNTIL="$end" nice -n 10 bash scripts/sudoku_curve.sh "$run" "$study/results/sudoku"
            at="$(step)"
        done
        echo "$(date -u +%FT%TZ) done: step $at"
    ' _ "$STUDY" "$THREADS" "$PYTHON" "$exp" "$seed" "$budget" "$max" "$every" "$leg" >>"$STUDY/study.log" 2>&1 </dev/null &
    echo "$!" >"$STUDY/study.pid"
    echo "started (pid $!): $exp seed $seed from step $budget to $max; log: $STUDY/study.log"
    ;;
status)
    if running; then echo "study: running (pid $(cat "$STUDY/study.pid"))"; else echo "study: not running"; fi
    if [[ -f "$STUDY/study.log" ]]; then tail -n 3 "$STUDY/study.log"; fi
    ;;
stop)
    if running; then
        pid="$(cat "$STUDY/study.pid")"
        kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid"
        echo "$(date -u +%FT%TZ) stop: SIGTERM to the study's group (pid $pid); 'start' resumes" | tee -a "$STUDY/study.log"
    else
        echo "study: not running"
    fi
    ;;
budget)
    # The rule applied to every curve point so far: the committed tables' rows (the run's own steps) and the study's
    # (committed under results/sudoku_budget_study/ and still in $STUDY/results), one row per (row, seed, step)
    shift
    (($# > 0)) || set -- "$ROOT/results/sudoku" "$ROOT/results/sudoku_budget_study" "$STUDY/results"
    cd "$ROOT" && "$PYTHON" -c '
import sys
from pathlib import Path
import pandas as pd
from analysis.sudoku_tables import KEY, STEP, budget_candidates, chosen_budget, curve_points, read_results
rows = pd.concat([read_results(f) for f in sys.argv[1:] if Path(f).is_dir()], ignore_index=True)
rows = rows.sort_values("date").drop_duplicates(subset=[*KEY, "seed", STEP], keep="last")
table = budget_candidates(curve_points(rows))
print(table.to_string(index=False, float_format=lambda v: f"{v:.1f}"))
chosen, provisional = chosen_budget(table), chosen_budget(table, confirmed=False)
if chosen:
    print(f"budget: {chosen} steps (every curve accepts it and every later step)")
elif provisional:
    print(f"budget: none confirmed yet; {provisional} steps provisionally (its curves accept it, no later step yet)")
else:
    print("budget: none accepted yet")' "$@"
    ;;
*)
    echo "usage: $0 start RUN_DIR MAX_STEPS | status | stop | budget [RESULTS_DIR ...]" >&2
    exit 2
    ;;
esac
