#!/usr/bin/env bash
# The Sudoku tables campaign (docs/results.md#the-campaign): the models of hparams_search=sudoku_tables trained one
# after another in the background, resumable, on any machine; each finished model's results CSV is then collected
# into the repository's results/ and committed with the report.
#
#   scripts/tables_campaign.sh start      # clone this checkout to $CAMPAIGN/code, train the plan below in the
#                                         # background (nohup, nice 10); a relaunch resumes the unfinished model;
#                                         # each model, once trained, is sampled offline (its <exp>_seed<n>_eval.csv):
#                                         # its curve (scripts/sudoku_curve.sh: the checkpoints at each eighth of
#                                         # the budget) and, for an MDM, the fast decoders (scripts/mdm_fast_eval.sh)
#   scripts/tables_campaign.sh status     # each model: done / running (its step of the budget, val loss, and the
#                                         # hours left at its mean seconds a step so far) / paused (the same, started
#                                         # and left: resumed in its turn) / waiting
#   scripts/tables_campaign.sh collect    # copy finished CSVs into results/sudoku/ (a committed CSV of the same model
#                                         # at another budget moves to superseded-steps<N>/), regenerate the report
#   scripts/tables_campaign.sh update     # the campaign's clone takes this checkout's new commits (next model on)
#   scripts/tables_campaign.sh stop       # end the background campaign, every process it started (a relaunch
#                                         # resumes the model it was on); `status` says "stopping" until they end
#   scripts/tables_campaign.sh redo EXP SEED   # train EXP at SEED again when its turn comes (resumed from its last
#                                         # checkpoint here: a protocol change, e.g. a later stop), though committed
#   scripts/tables_campaign.sh redo EXP SEED --fresh   # the same from the start (a damaged run): with the campaign
#                                         # stopped, its run folder, sweep folder, logs and CSVs go to discarded/
#
# Its folders live outside the work tree (which may be laid anew): $FLOWLM_CAMPAIGN, default ../flowlm_campaign
# beside the checkout: code/ (the clone it trains from, so editing the checkout never changes a running campaign),
# runs/, data/, results/, done/ (one marker per finished model), campaign.log and one log per model in logs/.
# Committed rows are read from $FLOWLM_COMMITTED (default: this checkout's results/sudoku; its report/ and
# superseded*/ folders are not rows of the tables). One campaign at a time: `start` takes campaign.lock (an exclusive flock, as runners/common.py takes a run folder's
# run.lock) and hands it to its runner, whose every process inherits it; a second `start` is refused, naming the
# running one, until the last of them has ended. `status` only reads.
# If the machine was replaced (the folders are gone), `start` begins again with the first unfinished model; the
# committed CSVs are what lasts. A model whose rows are already committed under results/sudoku/ at the tables'
# budget is skipped, unless a later unfinished model of the plan is built from it (its `source:`), whose checkpoint
# must then exist here; rows of another budget do not count (the model trains again, `collect` moves them aside).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
CAMPAIGN="$(realpath -m "${FLOWLM_CAMPAIGN:-$ROOT/../flowlm_campaign}")"  # made by the commands that write in it
LOCK="$CAMPAIGN/campaign.lock"
PYTHON="${FLOWLM_PYTHON:-$ROOT/.venv/bin/python}"
# One thread a process by default: two campaigns (one per model) and the tests share the 2-core machine, and a
# 2-thread training beside another job ran 3–10× slower than on one thread (docs/results.md#the-campaign)
THREADS="${FLOWLM_THREADS:-1}"
COMMITTED="${FLOWLM_COMMITTED:-$ROOT/results/sudoku}"

# The plan, in order (experiment:seed), issue 47's fixed-budget protocol: (a) the headline pair, the easy MDM and
# FMLM+ from scratch, seeds 0–4 (the easy MDM of seed 0 first: its curve checks the budget); (b) the unconditional
# pair, seeds 0–2; (c) the easy strategy rows (MDM-initialised, distilled, MLFM), seeds 0–2; (d) medium and hard,
# seed 0. Override with FLOWLM_CAMPAIGN_PLAN="exp:seed exp:seed ...".
PLAN_DEFAULT="
sudoku_mdm_easy:0 sudoku_fmlm_plus_scratch_easy:0 sudoku_mdm_easy:1 sudoku_fmlm_plus_scratch_easy:1
sudoku_mdm_easy:2 sudoku_fmlm_plus_scratch_easy:2 sudoku_mdm_easy:3 sudoku_fmlm_plus_scratch_easy:3
sudoku_mdm_easy:4 sudoku_fmlm_plus_scratch_easy:4
sudoku_mdm_uncond:0 sudoku_fmlm_plus_scratch_uncond:0 sudoku_mdm_uncond:1 sudoku_fmlm_plus_scratch_uncond:1
sudoku_mdm_uncond:2 sudoku_fmlm_plus_scratch_uncond:2
sudoku_fmlm_plus_init_easy:0 sudoku_fmlm_plus_distill_easy:0 sudoku_mlfm_easy:0
sudoku_fmlm_plus_init_easy:1 sudoku_fmlm_plus_distill_easy:1 sudoku_mlfm_easy:1
sudoku_fmlm_plus_init_easy:2 sudoku_fmlm_plus_distill_easy:2 sudoku_mlfm_easy:2
sudoku_mdm_medium:0 sudoku_fmlm_plus_scratch_medium:0 sudoku_fmlm_plus_init_medium:0
sudoku_fmlm_plus_distill_medium:0 sudoku_mlfm_medium:0
sudoku_mdm_hard:0 sudoku_fmlm_plus_scratch_hard:0 sudoku_fmlm_plus_init_hard:0 sudoku_fmlm_plus_distill_hard:0
sudoku_mlfm_hard:0
"
# The plan a campaign was started with is kept in $CAMPAIGN/plan (by `start` and `run`), so that every later command
# on that folder (`status`, `redo`, `collect`, a relaunch) reads the same plan without the variable: two campaigns
# that split the plan (one per model kind) never fall back to the default, which would train the other's models too.
# FLOWLM_CAMPAIGN_PLAN, when set, wins (and `start` / `run` keep it as the new plan).
if [[ -n "${FLOWLM_CAMPAIGN_PLAN:-}" ]]; then
    PLAN="$FLOWLM_CAMPAIGN_PLAN"
elif [[ -s "$CAMPAIGN/plan" ]]; then
    PLAN="$(cat "$CAMPAIGN/plan")"
else
    PLAN="$PLAN_DEFAULT"
fi
keep_plan() { mkdir -p "$CAMPAIGN" && echo "$PLAN" | xargs >"$CAMPAIGN/plan"; }  # one line, as `status` reads it

source_of() {  # the experiment a model is built from (its config's `source:` line), or nothing
    sed -n 's/^source: *\([A-Za-z0-9_]*\).*/\1/p' "$ROOT/conf/experiment/$1.yaml"
}

# Before a model's new rows are copied in (`collect`): its committed CSVs (<task>/<exp>_seed<n>.csv and _eval.csv)
# whose training budget (the rows' budget_steps) is not the new rows' move to $COMMITTED/superseded-steps<old>/<task>/,
# out of the tables (analysis/sudoku_tables.py reads no superseded* folder) and kept for the record, with a README
# line on why: a model retrained under a changed budget (issue 47: 6 000 steps, then the released 20 000) would
# otherwise have its old curve and fast decoders' rows read beside its new final rows.
supersede_other_budget() {  # $1: the campaign's new CSV, $2: its path below results/sudoku (<task>/<name>.csv)
    "$PYTHON" -c '
import csv, os, shutil, sys
new, rel, committed = sys.argv[1:]
task, model = os.path.dirname(rel), os.path.basename(rel)[: -len(".csv")].removesuffix("_eval")
def budgets(path):
    with open(path, newline="") as f:
        return {str(int(float(r["budget_steps"]))) for r in csv.DictReader(f) if (r.get("budget_steps") or "").strip()}
mine = budgets(new)
for suffix in ("", "_eval"):
    old = os.path.join(committed, task, model + suffix + ".csv")
    theirs = budgets(old) if os.path.isfile(old) else mine
    if not mine or theirs == mine:
        continue
    folder = "superseded-steps" + "+".join(sorted(theirs, key=int)) if theirs else "superseded-steps-unknown"
    os.makedirs(os.path.join(committed, folder, task), exist_ok=True)
    shutil.move(old, os.path.join(committed, folder, task, os.path.basename(old)))
    readme = os.path.join(committed, folder, "README.md")
    line = "- %s/%s: trained to %s steps; retrained to %s (the tables budget then), moved here by collect\n" % (
        task, os.path.basename(old), "+".join(sorted(theirs, key=int)) or "?", "+".join(sorted(mine, key=int)))
    if not os.path.isfile(readme):
        with open(readme, "w") as f:
            f.write("# Rows of an earlier training budget\n\nOut of the tables (analysis/sudoku_tables.py reads no "
                    "superseded* folder); read them with flowlm-report --config-name report_sudoku "
                    "results_dir=<this folder> out=/tmp/old_budget.\n\n")
    with open(readme, "a") as f:
        f.write(line)
    print("superseded %s (budget %s steps; the new rows: %s) -> %s/" % (old, "+".join(sorted(theirs)), "+".join(sorted(mine)), folder))
' "$1" "$2" "$COMMITTED"
}

# The tables' training budget (conf/hparams_search/sudoku_tables.yaml `budget:`): committed rows of another budget
# (the rows' budget_steps) are not the model's rows under this protocol, so the model trains again (and `collect`
# then moves those rows aside). Without this a new machine, whose campaign folder has no `redo` marker, skipped a
# model retrained to the new budget whose old rows were still committed.
BUDGET="$(sed -n 's/^budget: *\([0-9][0-9]*\).*/\1/p' "$ROOT/conf/hparams_search/sudoku_tables.yaml")"

of_budget() {  # whether the rows of CSV $1 were trained to the tables' budget (rows recording none: taken as such)
    [[ -n "$BUDGET" ]] || return 0
    "$PYTHON" -c '
import csv, sys
with open(sys.argv[1], newline="") as f:
    budgets = {str(int(float(r["budget_steps"]))) for r in csv.DictReader(f) if (r.get("budget_steps") or "").strip()}
sys.exit(0 if budgets <= {sys.argv[2]} else 1)' "$1" "$BUDGET"
}

committed_csv() {  # the committed results CSV of experiment $1, seed $2 at the tables' budget, if there is one
    local csv
    [[ -d "$COMMITTED" ]] || return 0
    csv="$(find "$COMMITTED" \( -path "$COMMITTED/report" -o -path "$COMMITTED/superseded*" \) -prune -o \
        -name "$1_seed$2.csv" -print | head -n 1)"
    if [[ -n "$csv" ]] && of_budget "$csv"; then echo "$csv"; fi
}

is_done() { [[ -e "$CAMPAIGN/done/$1_seed$2" ]]; }

is_redo() { [[ -e "$CAMPAIGN/redo/$1_seed$2" ]]; }  # committed rows to be replaced (`redo`)

needed_later() {  # whether an unfinished model after position $3 of the plan is built from $1 at seed $2
    local i=0 item exp seed
    for item in $PLAN; do
        i=$((i + 1))
        ((i > $3)) || continue
        exp="${item%%:*}" seed="${item##*:}"
        if [[ "$seed" == "$2" && "$(source_of "$exp")" == "$1" ]] && ! is_done "$exp" "$seed" \
            && { [[ -z "$(committed_csv "$exp" "$seed")" ]] || is_redo "$exp" "$seed"; }; then
            return 0
        fi
    done
    return 1
}

train_one() {  # train (or resume) one model from the campaign's clone; the marker is written only on success
    local exp="$1" seed="$2"
    mkdir -p "$CAMPAIGN/logs" "$CAMPAIGN/done"
    echo "$(date -u +%FT%TZ) start $exp seed $seed ($(git -C "$CAMPAIGN/code" rev-parse --short HEAD))"
    if (cd "$CAMPAIGN/code" && env PYTHONPATH="$CAMPAIGN/code" FLOWLM_RUNS="$CAMPAIGN/runs" \
        FLOWLM_DATA="$CAMPAIGN/data" FLOWLM_RESULTS="$CAMPAIGN/results" OMP_NUM_THREADS="$THREADS" \
        HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MPLBACKEND=Agg \
        nice -n 10 "$PYTHON" -m runners.train -m hparams_search=sudoku_tables "experiment=$exp" "seed=$seed" \
        "hydra.sweep.dir=$CAMPAIGN/multirun/${exp}_seed$seed") >>"$CAMPAIGN/logs/${exp}_seed$seed.log" 2>&1; then
        touch "$CAMPAIGN/done/${exp}_seed$seed"
        rm -f "$CAMPAIGN/redo/${exp}_seed$seed"
        echo "$(date -u +%FT%TZ) done $exp seed $seed"
    else
        echo "$(date -u +%FT%TZ) FAILED $exp seed $seed: see $CAMPAIGN/logs/${exp}_seed$seed.log"
        return 1
    fi
}

eval_due() {  # whether the model $1 at seed $2 is finished and its offline evaluations are still to be run
    is_done "$1" "$2" && ! is_done "$1" "$2_eval" \
        && { [[ -z "$(committed_csv "$1" "$2_eval")" ]] || is_redo "$1" "$2_eval"; }
}

eval_script() {  # run the clone's evaluation script $1 on the run of $2 at seed $3 (sampling only)
    (cd "$CAMPAIGN/code" && env PYTHONPATH="$CAMPAIGN/code" FLOWLM_PYTHON="$PYTHON" FLOWLM_RUNS="$CAMPAIGN/runs" \
        FLOWLM_DATA="$CAMPAIGN/data" OMP_NUM_THREADS="$THREADS" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 MPLBACKEND=Agg \
        nice -n 10 bash "$CAMPAIGN/code/scripts/$1" "$CAMPAIGN/runs/$2/cpu/seed$3" "$CAMPAIGN/results/sudoku")
}

eval_one() {  # a finished model sampled offline: its curve (issue 47), then an MDM's fast decoders (issue 35)
    local exp="$1" seed="$2" script scripts=(sudoku_curve.sh)
    [[ "$exp" == sudoku_mdm_* ]] && scripts+=(mdm_fast_eval.sh)
    echo "$(date -u +%FT%TZ) start $exp seed $seed: evaluations (${scripts[*]})"
    for script in "${scripts[@]}"; do
        if [[ ! -f "$CAMPAIGN/code/scripts/$script" ]]; then  # the clone's, as its code: a clone from before it
            echo "$(date -u +%FT%TZ) FAILED $exp seed $seed: the campaign's clone has no scripts/$script: 'update'"
            return 1
        fi
        if ! eval_script "$script" "$exp" "$seed" >>"$CAMPAIGN/logs/${exp}_seed${seed}_eval.log" 2>&1; then
            echo "$(date -u +%FT%TZ) FAILED $exp seed $seed: $script, see $CAMPAIGN/logs/${exp}_seed${seed}_eval.log"
            return 1
        fi
    done
    touch "$CAMPAIGN/done/${exp}_seed${seed}_eval"
    rm -f "$CAMPAIGN/redo/${exp}_seed${seed}_eval"
    echo "$(date -u +%FT%TZ) done $exp seed $seed: evaluations"
}

run_plan() {
    local i=0 item exp seed
    for item in $PLAN; do
        i=$((i + 1))
        exp="${item%%:*}" seed="${item##*:}"
        if is_done "$exp" "$seed"; then
            if eval_due "$exp" "$seed"; then eval_one "$exp" "$seed" || exit 1; fi
            continue
        fi
        if [[ -n "$(committed_csv "$exp" "$seed")" ]] && ! is_redo "$exp" "$seed" && ! needed_later "$exp" "$seed" "$i"; then
            echo "$(date -u +%FT%TZ) skip $exp seed $seed: its rows are committed"
            continue
        fi
        train_one "$exp" "$seed" || exit 1  # a failure stops the campaign: it is not silently skipped
        if eval_due "$exp" "$seed"; then eval_one "$exp" "$seed" || exit 1; fi
    done
    echo "$(date -u +%FT%TZ) the plan is finished"
}

# The lock lives on descriptor 9 of the runner and of every process it starts (fd 9 is not closed on exec: each child
# inherits it), so the kernel drops it only when the last of them has ended, the trainer saving its checkpoint after
# `stop` included, in any way (SIGKILL too): it cannot go stale. On NFS and Lustre, see runners/common.py's LOCK_FILE.
lock_held() {  # whether a process holds the campaign's lock (a shared probe: it writes nothing, creates no file)
    local rc=0
    [[ -e "$LOCK" ]] || return 1
    flock -n -s -E 99 "$LOCK" true 2>/dev/null || rc=$?
    [[ "$rc" == 99 ]]
}

holder() {  # the campaign that holds the lock, as its holder recorded itself
    local info
    info="$(head -c 1000 "$LOCK" 2>/dev/null || true)"
    echo "${info:-a campaign that has not recorded itself yet (it is starting)}"
}

running_pid() {  # the campaign's runner (campaign.pid), while it lives and holds the lock
    local pid
    pid="$(cat "$CAMPAIGN/campaign.pid" 2>/dev/null || true)"
    [[ "$pid" =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 0
    # a live pid without the lock is another process that took a stale pid's number (or a campaign started before
    # the lock existed, which made no lock file)
    if [[ ! -e "$LOCK" ]] || lock_held; then echo "$pid"; fi
}

group_members() {  # the live processes of the runner's group ($1: its pid, its group's id: `start` runs it in setsid)
    pgrep -g "$1" 2>/dev/null | paste -sd, - || true
}

state() {  # the campaign's state in words: running, stopping or not running
    local pid members
    pid="$(running_pid)"
    if [[ -n "$pid" ]]; then
        echo "running, pid $pid"
    elif lock_held; then
        pid="$(cat "$CAMPAIGN/campaign.pid" 2>/dev/null || true)"
        members="$([[ "$pid" =~ ^[0-9]+$ ]] && group_members "$pid" || true)"
        echo "stopping: the runner has ended; its trainer still ends, saving its checkpoint${members:+ (pid $members)}"
    else
        echo "not running"
    fi
}

run_held() {  # whether a process holds the run folder's run.lock (a trainer training it now)
    [[ -f "$1/run.lock" ]] && ! flock -n "$1/run.lock" true 2>/dev/null
}

take_lock() {  # the campaign's lock on fd 9 for this process: inherited from `start`, or taken now; else refuse
    command -v flock >/dev/null || { echo "refused: no flock command (util-linux): install it first" >&2; exit 2; }
    if [[ "$(readlink /dev/fd/9 2>/dev/null)" == "$LOCK" ]] && flock -n 9; then return 0; fi  # `start` handed it over
    mkdir -p "$CAMPAIGN"
    exec 9>>"$LOCK"
    # a second's wait: a `status` may be probing the lock at this instant; a running campaign holds it for good
    if [[ -n "$(running_pid)" ]] || ! flock -w 1 9; then
        echo "refused: a campaign already runs in $CAMPAIGN ($(state); $(holder)); 'stop' ends it" >&2
        exit 2
    fi
}

# `status` of a running model: its record's step, val loss and training minutes, the budget from its run_config.yaml
# and the hours left at its mean seconds a step so far (argv[1]: its convergence.json)
RUNNING_PY=$(cat <<'PY'
import json, pathlib, sys

import yaml

record = pathlib.Path(sys.argv[1])
r = json.loads(record.read_text())
v = r["final_val_loss"]
try:  # the budget from the run's config; what is left at the run's mean seconds a step so far
    budget = int(yaml.safe_load((record.parent / "run_config.yaml").read_text())["trainer"]["max_steps"])
except (OSError, KeyError, TypeError, ValueError, yaml.YAMLError):
    budget = None
step = "step {}".format(r["steps"]) + (" of {}".format(budget) if budget else "")
line = "running: {}, val loss {}, {:.0f} min".format(step, v if v is None else round(v, 4), r["wall_s"] / 60)
if budget and 0 < r["steps"] < budget:
    rate = r["wall_s"] / r["steps"]
    line += " (≈ {:.1f} h more at its mean {:.2f} s a step)".format((budget - r["steps"]) * rate / 3600, rate)
print(line)
PY
)
case "${1:-status}" in
start)
    [[ -x "$PYTHON" ]] || { echo "no $PYTHON: run 'make venv' first (or set FLOWLM_PYTHON)" >&2; exit 2; }
    take_lock  # before the clone: two starts at once clone, spawn and record nothing twice
    if [[ ! -d "$CAMPAIGN/code/.git" ]]; then git clone -q "$ROOT" "$CAMPAIGN/code"; fi
    keep_plan
    setsid nohup bash "$0" run >>"$CAMPAIGN/campaign.log" 2>&1 </dev/null &  # fd 9, the lock, goes with it
    pid=$! code="$(git -C "$CAMPAIGN/code" rev-parse --short HEAD)"
    echo "$pid" >"$CAMPAIGN/campaign.pid"
    echo "runner pid $pid on $(hostname), started $(date -u +%FT%TZ), code at $code" >"$LOCK"
    echo "started (pid $pid, code at $code); log: $CAMPAIGN/campaign.log"
    ;;
run)
    take_lock
    keep_plan
    run_plan
    ;;
update)
    if [[ ! -d "$CAMPAIGN/code/.git" ]]; then  # git's own "fatal: cannot change to ..." said neither why nor the fix
        echo "update: no campaign clone in $CAMPAIGN/code (never started here): 'start' makes it from this checkout" >&2
        exit 2
    fi
    git -C "$CAMPAIGN/code" pull -q --ff-only "$ROOT" HEAD
    echo "the campaign's clone is at $(git -C "$CAMPAIGN/code" rev-parse --short HEAD): the next model trains from it"
    ;;
redo)
    usage="usage: $0 redo EXPERIMENT SEED [--fresh] (a model of the campaign's plan)"
    [[ $# -eq 3 || ($# -eq 4 && "$4" == --fresh) ]] || { echo "$usage" >&2; exit 2; }
    [[ "$3" =~ ^[0-9]+$ ]] || { echo "redo: SEED must be an integer ≥ 0, got '$3'; $usage" >&2; exit 2; }
    if [[ " $PLAN " != *[[:space:]]"$2:$3"[[:space:]]* ]]; then  # only the plan trains: a redo elsewhere did nothing
        planned="$(for item in $PLAN; do echo "${item%%:*}"; done | awk '!seen[$0]++' | paste -sd' ' -)"
        seeds="$(for item in $PLAN; do if [[ "${item%%:*}" == "$2" ]]; then echo "${item##*:}"; fi; done \
            | paste -sd' ' -)"
        if [[ -n "$seeds" ]]; then echo "redo: $2 seed $3 is not in the campaign's plan; its seeds there: $seeds" >&2
        else echo "redo: no experiment '$2' in the campaign's plan; one of: $planned" >&2; fi
        exit 2
    fi
    if [[ "${4:-}" == --fresh ]]; then  # from the start: what the damaged run left is moved aside, not deleted
        if [[ -n "$(running_pid)" ]] || lock_held; then
            echo "the campaign is $(state): stop it first ('start' resumes it), then redo --fresh" >&2
            exit 2
        fi
        aside="$CAMPAIGN/discarded/$2_seed$3-$(date -u +%Y%m%dT%H%M%SZ)"
        mkdir -p "$aside"
        for what in "runs/$2/cpu/seed$3" "multirun/$2_seed$3" "logs/$2_seed$3.log" "logs/$2_seed$3_eval.log"; do
            if [[ -e "$CAMPAIGN/$what" ]]; then mv "$CAMPAIGN/$what" "$aside/$(basename "$what")"; fi
        done
        if [[ -d "$CAMPAIGN/results" ]]; then
            find "$CAMPAIGN/results" -name "$2_seed$3.csv" -o -name "$2_seed$3_eval.csv" \
                | while IFS= read -r csv; do mv "$csv" "$aside/"; done
        fi
        echo "moved what $2 seed $3 left to $aside"
    fi
    mkdir -p "$CAMPAIGN/redo" && touch "$CAMPAIGN/redo/$2_seed$3" && rm -f "$CAMPAIGN/done/$2_seed$3"
    touch "$CAMPAIGN/redo/$2_seed$3_eval" && rm -f "$CAMPAIGN/done/$2_seed$3_eval"  # new weights: sampled again
    if [[ "${4:-}" == --fresh ]]; then echo "$2 seed $3 trains again from the start when its turn in the plan comes"
    else echo "$2 seed $3 trains again when its turn in the plan comes (from its last checkpoint where there is one)"; fi
    ;;
stop)
    pid="$(running_pid)"
    if [[ -z "$pid" ]]; then echo "$(state)"; exit 0; fi
    # the runner leads its process group (setsid): SIGTERM to the group reaches the trainer and whatever it started
    members="$(group_members "$pid")"
    if ! kill -TERM -- "-$pid" 2>/dev/null; then echo "$(state)"; exit 0; fi  # it ended meanwhile
    echo "$(date -u +%FT%TZ) stop: SIGTERM to the runner (pid $pid) and its group (pid ${members:-$pid})" \
        "by $(id -un 2>/dev/null || echo '?'); 'start' resumes" >>"$CAMPAIGN/campaign.log"
    echo "stopping (pid ${members:-$pid}): the trainer saves its checkpoint; 'status' says when it has ended"
    ;;
status)
    echo "campaign: $CAMPAIGN ($(if [[ -d "$CAMPAIGN" ]]; then state; else echo "not started"; fi))"
    for item in $PLAN; do
        exp="${item%%:*}" seed="${item##*:}"
        record="$CAMPAIGN/runs/$exp/cpu/seed$seed/convergence.json"
        if eval_due "$exp" "$seed"; then state="trained; its curve and evaluations are sampled next"
        elif is_done "$exp" "$seed"; then state="done"
        elif [[ -f "$record" ]]; then
            state="$("$PYTHON" -c "$RUNNING_PY" "$record")" || state="running (record unreadable)"
            # a trainer holds its run folder's run.lock (runners/common.py) while it trains: without it, the model
            # was started and left (the campaign stopped, or another model's turn first): paused, resumed in its turn
            if ! run_held "${record%/*}"; then state="paused${state#running}"; fi
        elif [[ -n "$(committed_csv "$exp" "$seed")" ]]; then state="rows committed earlier"
        else state="waiting"; fi
        printf '  %-36s seed %s  %s\n' "$exp" "$seed" "$state"
    done
    ;;
collect)
    n=0
    while IFS= read -r csv; do
        rel="${csv#"$CAMPAIGN/results/sudoku/"}"  # <task>/<name>.csv
        name="$(basename "$csv" .csv)"
        if [[ -e "$CAMPAIGN/done/$name" ]]; then
            supersede_other_budget "$csv" "$rel"
            mkdir -p "$COMMITTED/$(dirname "$rel")"
            cp "$csv" "$COMMITTED/$rel" && n=$((n + 1)) && echo "collected $COMMITTED/$rel"
        fi
    done < <(find "$CAMPAIGN/results/sudoku" -name '*.csv' -not -path '*/report/*' 2>/dev/null)
    echo "$n finished model(s) collected; the report:"
    where=()  # the default, results/sudoku, as the report names it (relative to the checkout)
    [[ "$COMMITTED" == "$ROOT/results/sudoku" ]] || where=("results_dir=$COMMITTED")
    (cd "$ROOT" && "${FLOWLM_REPORT:-$ROOT/.venv/bin/flowlm-report}" --config-name report_sudoku "${where[@]}")
    ;;
*)
    echo "unknown command '$1'; usage: $0 start|status|collect|update|redo|stop" >&2
    exit 2
    ;;
esac
