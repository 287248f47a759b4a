#!/usr/bin/env bash
# A trained Sudoku MDM re-evaluated with the field's fast decoders (issue 35 item 3): `flowlm-eval
# eval=sudoku_mdm_fast` without its fixed-step samplers (threshold, margin and EB; sampling only; the training run
# sampled its final weights with ancestral and confidence itself, on the same puzzles and seeds) at the training
# run's NFE budgets, puzzles and seeds, its DiT blocks compiled and its precision as in training, all read from its
# run_config.yaml.
# The rows go to <results>/<task>/<name>_seed<n>_eval.csv beside the training run's, which the report merges. Used
# by scripts/tables_campaign.sh and benchmarks/gpu_tables.sh.
#
#   scripts/mdm_fast_eval.sh RUN_DIR RESULTS_DIR [OVERRIDE ...]   # e.g. runs/sudoku_mdm_easy/cpu/seed1 results/sudoku
#
# $FLOWLM_PYTHON is the interpreter (default: the checkout's .venv); run from the code to evaluate with (its cwd).
set -euo pipefail
[[ $# -ge 2 ]] || { echo "usage: $0 RUN_DIR RESULTS_DIR [OVERRIDE ...]" >&2; exit 2; }
run="$1" results="$2"
shift 2
PYTHON="${FLOWLM_PYTHON:-$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python}"
[[ -f "$run/run_config.yaml" && -f "$run/checkpoints/last.ckpt" ]] \
    || { echo "$0: $run holds no finished run (run_config.yaml and checkpoints/last.ckpt)" >&2; exit 2; }
settings="$("$PYTHON" -c '
import json, sys, yaml
c = yaml.safe_load(open(sys.argv[1]))
e = c["eval"]
precision = (c.get("trainer") or {}).get("precision")  # the run sampled its final weights in it
print("seed=%s eval.nfe=[%s] eval.max_batches=%s eval.seed=%s compile=%s"
      % (c["seed"], ",".join(map(str, e["nfe"])), json.dumps(e["max_batches"]), e["seed"],
         json.dumps(bool(c.get("compile")))) + (" trainer.precision=%s" % precision if precision else ""))' \
    "$run/run_config.yaml")"
# shellcheck disable=SC2086  # $settings is five overrides (six with the run's precision)
exec "$PYTHON" -m runners.evaluate "ckpt_path=$run/checkpoints/last.ckpt" eval=sudoku_mdm_fast \
    "~eval.samplers.ancestral" "~eval.samplers.confidence" $settings "results_csv=$results" "$@"
