#!/usr/bin/env bash
# A trained Sudoku model's accuracy-versus-training curve (issue 47 item 2; docs/results.md#the-protocol): each
# checkpoint the tables sweep kept at an eighth of the budget (checkpoints/curve-step*.ckpt, the final one excepted:
# the training run sampled its final weights itself, on every val puzzle) sampled offline with `flowlm-eval`, with the
# run's own samplers (eval=sudoku_<family>) and seeds read from its run_config.yaml, at the budgets of the curves the
# report draws (analysis/sudoku_tables.py run_curve_nfe: conditional, NFE 4 and an MDM's one call per position;
# unconditional, an MDM's 36 and 9, PR's 9 and 4 on 6×6) — on the first 4 val batches (512 puzzles: ±4 points at 50 %;
# FLOWLM_CURVE_BATCHES sets how many: a step sampled on fewer puzzles than that asks is sampled again),
# its DiT blocks compiled and its precision as in training: the curve costs a small share of training. The rows go to
# <results>/<task>/<name>_seed<n>_eval.csv, one per checkpoint step (the rows' eval_step), which the report plots.
# Used by scripts/tables_campaign.sh after each model. Resumable: a step whose rows that file already holds at every
# one of these budgets is not sampled again (FLOWLM_CURVE_REDO=1 samples it anyway; its rows are replaced, nothing else).
#
#   scripts/sudoku_curve.sh RUN_DIR RESULTS_DIR [OVERRIDE ...]   # e.g. runs/sudoku_mdm_easy/cpu/seed0 results/sudoku
#
# $FLOWLM_PYTHON is the interpreter (default: the checkout's .venv); run from the code to evaluate with (its cwd).
set -euo pipefail
[[ $# -ge 2 ]] || { echo "usage: $0 RUN_DIR RESULTS_DIR [OVERRIDE ...]" >&2; exit 2; }
run="$1" results="$2"
shift 2
PYTHON="${FLOWLM_PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}"
batches="${FLOWLM_CURVE_BATCHES:-4}"  # val batches of 128 puzzles a checkpoint; 16 is all 2 000 (the budget study's)
[[ "$batches" =~ ^[1-9][0-9]*$ ]] || { echo "$0: FLOWLM_CURVE_BATCHES must be a positive integer, got '$batches'" >&2; exit 2; }
[[ -f "$run/run_config.yaml" && -f "$run/checkpoints/last.ckpt" ]] \
    || { echo "$0: $run holds no finished run (run_config.yaml and checkpoints/last.ckpt)" >&2; exit 2; }
# the run's evaluation settings, and its final step (its own rows; the curve's checkpoint there is not sampled again)
# (a command substitution, which bash waits for: a process substitution's interpreter could still be exiting, holding
# the campaign's lock that it inherited, when this script and the campaign have ended)
line="$("$PYTHON" -c '
import json, os, sys, yaml
from analysis.sudoku_tables import run_curve_nfe
c = yaml.safe_load(open(sys.argv[1]))
e = c["eval"]
nfe = run_curve_nfe(c)
d = c.get("data") or {}
batch = d.get("val_batch_size") or d.get("batch_size") or 128  # the puzzles a checkpoint is sampled on, at most
want = min(int(sys.argv[3]) * batch, d.get("num_val") or float("inf"))
print(c["trainer"]["max_steps"], ",".join(map(str, nfe)),
      os.path.join(sys.argv[2], c["task"], "%s_seed%s_eval.csv" % (sys.argv[4] or c["name"], c["seed"])), want,
      "eval=sudoku_%s seed=%s eval.nfe=[%s] eval.max_batches=%s eval.seed=%s eval.skip_unfit_budgets=%s compile=%s"
      % (c["family"], c["seed"], ",".join(map(str, nfe)), sys.argv[3], e["seed"],
         json.dumps(bool(e.get("skip_unfit_budgets"))), json.dumps(bool(c.get("compile"))))
      + (" trainer.precision=%s" % c["trainer"]["precision"] if (c.get("trainer") or {}).get("precision") else ""))' \
    "$run/run_config.yaml" "$results" "$batches" "${FLOWLM_CURVE_NAME:-}")" || line=""
read -r final budgets csv want settings <<<"$line"
[[ "$final" =~ ^[0-9]+$ ]] || { echo "$0: $run/run_config.yaml could not be read (above)" >&2; exit 2; }
# A run resumed past its recorded steps (scripts/sudoku_budget_study.sh) keeps its first run_config.yaml: the caller
# says up to which step (exclusive) the checkpoints are the curve's, and (FLOWLM_CURVE_NAME) the name its rows
# carry, whose CSV says which steps are sampled already
final="${FLOWLM_CURVE_UNTIL:-$final}"
[[ "$final" =~ ^[0-9]+$ ]] || { echo "$0: FLOWLM_CURVE_UNTIL must be a step count, got '$final'" >&2; exit 2; }
found=0
for ckpt in "$run"/checkpoints/curve-step*.ckpt; do
    [[ -f "$ckpt" ]] || continue
    step="$(basename "$ckpt" .ckpt)" step="$((10#${step#curve-step}))"
    ((step < final)) || continue
    found=$((found + 1))
    if [[ "${FLOWLM_CURVE_REDO:-0}" != 1 && -f "$csv" ]] && "$PYTHON" -c '
import csv, sys
rows = [r for r in csv.DictReader(open(sys.argv[1])) if r.get("eval_step") == sys.argv[2]]
have = {r["nfe_budget"] for r in rows if int(float(r.get("samples") or 0)) >= int(sys.argv[4])}
sys.exit(0 if set(sys.argv[3].split(",")) <= have else 1)' "$csv" "$step" "$budgets" "$want"; then
        echo "$(date -u +%FT%TZ) curve: step $step of $final already sampled ($csv)"
        continue
    fi
    echo "$(date -u +%FT%TZ) curve: step $step of $final"
    # shellcheck disable=SC2086  # $settings is seven overrides (eight with the run's precision)
    "$PYTHON" -m runners.evaluate "ckpt_path=$ckpt" $settings "results_csv=$results" "$@"
done
((found > 0)) || { echo "$0: $run kept no curve checkpoint (checkpoints/curve-step*.ckpt) before step $final" >&2; exit 2; }
echo "$(date -u +%FT%TZ) curve: $found checkpoint(s) of $run sampled"
