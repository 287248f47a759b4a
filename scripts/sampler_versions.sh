#!/usr/bin/env bash
# Whether several code versions sample the same numbers from one checkpoint: the tables pool rows written by
# different commits (results/sudoku/report/report.md names them), which is sound only where every change between
# them to the samplers, the model's inference path and the metric was speed or bookkeeping alone. Each commit is
# checked out in its own worktree under OUT (git worktree, outside the work tree) and runs `runners.evaluate` from
# there on the same checkpoint, seeds, budgets and batches; then every measured column of every (sampler, budget)
# row is compared across the commits, exactly (the same kernels on the same machine give the same bits).
#
#   scripts/sampler_versions.sh CKPT OUT COMMIT [COMMIT ...] -- OVERRIDE [OVERRIDE ...]
#   e.g. scripts/sampler_versions.sh ../flowlm_campaign/runs/sudoku_mdm_easy/cpu/seed2/checkpoints/last.ckpt \
#            /tmp/versions fdfad7a 2fead90 7f8ec36 HEAD -- eval=sudoku_mdm_fast eval.nfe=[4,18,41] eval.max_batches=2
#
# The overrides after `--` go to every commit's `runners.evaluate` (FLOWLM_DATA: the data cache, so that no commit
# generates the puzzles anew). Prints one line per (sampler, budget) row with the columns that are the same in every
# commit, and one per column that differs (its values), and exits 1 when any differs. Each commit's rows stay in
# OUT/rows-<commit>/, its log in OUT/<commit>.log; a rerun samples only the commits not yet done. The worktrees
# (OUT/code-<commit>) stay registered with this checkout: `rm -rf OUT && git worktree prune` when done.
set -euo pipefail
usage() { echo "usage: $0 CKPT OUT COMMIT [COMMIT ...] -- OVERRIDE [OVERRIDE ...]" >&2; exit 2; }
[[ $# -ge 4 ]] || usage
ckpt="$(realpath -e "$1")" || { echo "$0: no checkpoint $1" >&2; exit 2; }
out="$(realpath -m "$2")"
shift 2
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PYTHON="${FLOWLM_PYTHON:-$ROOT/.venv/bin/python}"
commits=()
while [[ $# -gt 0 && "$1" != "--" ]]; do commits+=("$1"); shift; done
[[ $# -gt 0 ]] || usage
shift
[[ ${#commits[@]} -ge 2 ]] || { echo "$0: name at least two commits to compare" >&2; exit 2; }
case "$out/" in "$ROOT"/*) echo "$0: OUT must lie outside the work tree ($ROOT)" >&2; exit 2 ;; esac
shas=()
for c in "${commits[@]}"; do  # every name resolves before any compute
    sha="$(git -C "$ROOT" rev-parse --verify --quiet "$c^{commit}")" || { echo "$0: no commit $c" >&2; exit 2; }
    shas+=("${sha:0:10}")
done
mkdir -p "$out"
for sha in "${shas[@]}"; do
    code="$out/code-$sha" rows="$out/rows-$sha"
    if [[ -s "$rows/done" ]]; then echo "$sha: sampled before ($rows)"; continue; fi
    [[ -d "$code" ]] || git -C "$ROOT" worktree add --detach --quiet "$code" "$sha"
    rm -rf "$rows" && mkdir -p "$rows"
    echo "$sha: sampling ($out/$sha.log)"
    # the commit's own code: python -m from its worktree finds its packages before the venv's editable install
    (cd "$code" && FLOWLM_RUNS="$out/runs-$sha" "$PYTHON" -c 'import flowlm, sys; sys.exit(0 if flowlm.__file__.startswith(sys.argv[1]) else 1)' "$code") \
        || { echo "$0: $code does not import its own flowlm" >&2; exit 1; }
    (cd "$code" && FLOWLM_RUNS="$out/runs-$sha" "$PYTHON" -m runners.evaluate "ckpt_path=$ckpt" "results_csv=$rows" "$@") \
        >"$out/$sha.log" 2>&1 || { echo "$0: $sha failed (tail of $out/$sha.log):" >&2; tail -5 "$out/$sha.log" >&2; exit 1; }
    echo "$sha" >"$rows/done"
done
"$PYTHON" - "$out" "${shas[@]}" <<'EOF'
import glob, sys
import pandas as pd

out, shas = sys.argv[1], sys.argv[2:]
MEASURED = ["nfe", "nfe_std", "nfe_min", "nfe_p50", "nfe_p90", "nfe_max", "samples", "accuracy", "exact_match",
            "valid_pct", "distinct_valid", "train_copy_pct", "auroc", "wrong_pct", "calibration_tokens",
            "forced_share"]
tables = {}
for sha in shas:
    files = [f for f in glob.glob(f"{out}/rows-{sha}/**/*.csv", recursive=True)]
    if not files:
        sys.exit(f"{sha}: wrote no rows under {out}/rows-{sha}")
    rows = pd.concat([pd.read_csv(f) for f in files], ignore_index=True)
    tables[sha] = rows.set_index(["sampler", "nfe_budget"]).sort_index()
keys = sorted(set.union(*(set(t.index) for t in tables.values())))
differs = 0
for key in keys:
    missing = [s for s, t in tables.items() if key not in t.index]
    if missing:
        print(f"{key[0]}@{key[1]}: no row from {', '.join(missing)}")
        differs += 1
        continue
    same = []
    for column in MEASURED:
        values = {s: t.loc[key].get(column) for s, t in tables.items() if column in t.columns}
        values = {s: v for s, v in values.items() if pd.notna(v)}
        if len(set(values.values())) > 1:
            differs += 1
            print(f"{key[0]}@{key[1]} {column}: DIFFERS " + ", ".join(f"{s} {v}" for s, v in values.items()))
        elif values and len(values) == len(shas):
            same.append(f"{column} {next(iter(values.values())):g}")
    print(f"{key[0]}@{key[1]}: the same in all {len(shas)}: " + ", ".join(same))
print(f"{len(keys)} sampler × budget rows over {len(shas)} commits: "
      + ("the same numbers" if not differs else f"{differs} difference(s)"))
sys.exit(1 if differs else 0)
EOF
