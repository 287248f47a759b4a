"""scripts/tables_campaign.sh's plan: a model whose rows are committed is skipped, unless `redo` asks for it again
(a protocol change: the rows are replaced when it finishes); a finished model is marked done. The training command is
a stand-in that records what it was asked to train."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowlm.project import PROJECT_DIR

SCRIPT = Path(PROJECT_DIR) / "scripts" / "tables_campaign.sh"
# a run that samples a curve: its settings come from analysis/sudoku_tables.py (torch, pandas and MLflow imported,
# seconds each on a loaded 2-core machine), once per trained model
SLOW = 240
COMMITTED = "sudoku_mdm_easy:0"  # committed_rows(): sudoku_mdm_easy_seed0{,_eval}.csv
CURVE = (  # the curve's checkpoint, sampled with the run's samplers and seed at its curves' budgets (run_config.yaml)
    "evaluate {exp}/cpu/seed{seed}/checkpoints/curve-step0000001.ckpt eval=sudoku_{family} seed={seed} "
    "eval.nfe=[{curve}] eval.max_batches=4 eval.seed={seed}"
)
FAST = (  # an MDM's fast decoders (only: the run sampled the fixed-step ones) at its budgets, puzzles and seed
    "evaluate sudoku_mdm_easy/cpu/seed{seed}/checkpoints/last.ckpt eval=sudoku_mdm_fast ~eval.samplers.ancestral "
    "~eval.samplers.confidence seed={seed} "
    "eval.nfe=[4,18,41] eval.max_batches=2 eval.seed={seed}"
)


def evaluations(seed: int, exp: str = "sudoku_mdm_easy") -> list[str]:
    """What the campaign samples once ``exp`` at ``seed`` is trained: its curve, then an MDM's fast decoders."""
    family = "mdm" if exp.startswith("sudoku_mdm") else "flow"
    curve = CURVE.format(exp=exp, seed=seed, family=family, curve="4,41" if family == "mdm" else "4")
    return [curve, FAST.format(seed=seed)] if family == "mdm" else [curve]


# The stand-in for the campaign's python: a training records the experiment and seed it was asked for and writes the
# run's run_config.yaml (its evaluation settings) and a checkpoint; an evaluation records the checkpoint and the
# overrides, and fails while the file `fail_eval` exists; `-c` snippets run in the real interpreter.
STAND_IN = """#!/bin/bash
if [[ "$1" == -c ]]; then exec {python} "$@"; fi
if [[ "$*" == *runners.evaluate* ]]; then
    [[ -e {tmp}/fail_eval ]] && exit 1
    echo "$*" | grep -o "trainer.precision=[a-z0-9-]*" >> {tmp}/eval_precision.txt
    echo "$*" | grep -o "runs/[a-z_]*/cpu/seed[0-9]*/checkpoints/[a-z0-9-]*.ckpt eval=[a-z_]* .*eval.seed=[0-9]*" \
        | sed "s|^runs/|evaluate |" >> {tmp}/trained.txt
    exit 0
fi
exp=$(echo "$*" | grep -o "experiment=[a-z_]*" | cut -d= -f2)
seed=$(echo "$*" | grep -o "seed=[0-9]*" | cut -d= -f2)
echo "experiment=$exp seed=$seed" >> {tmp}/trained.txt
run="$FLOWLM_RUNS/$exp/cpu/seed$seed"
family=$([[ $exp == sudoku_mdm* ]] && echo mdm || echo flow)
nfe=$([[ $family == mdm ]] && echo "4, 18, 41" || echo "4, 18")
mkdir -p "$run/checkpoints" && touch "$run/checkpoints/last.ckpt" "$run/checkpoints/curve-step0000001.ckpt"
printf "seed: $seed\\nfamily: $family\\nname: $exp\\ntask: sudoku_easy_6x6\\n" > "$run/run_config.yaml"
printf "trainer: {{max_steps: 2, precision: bf16-mixed}}\\n" \\
    >> "$run/run_config.yaml"
printf "data: {{box_rows: 2, box_cols: 3, conditional: true, difficulty: easy}}\\n" >> "$run/run_config.yaml"
printf "eval:\\n  nfe: [$nfe]\\n  max_batches: 2\\n  seed: $seed\\n" >> "$run/run_config.yaml"
if [[ -e {tmp}/block ]]; then  # a long training: it runs while `block` exists; SIGTERM ends it once `linger` is gone
    echo $$ >> {tmp}/trainers.txt
    trap 'while [[ -e {tmp}/linger ]]; do sleep 0.1; done; exit 143' TERM
    while [[ -e {tmp}/block ]]; do sleep 0.1; done
fi
"""


def campaign_env(tmp_path: Path, plan: str) -> dict[str, str]:
    """The environment of a campaign under ``tmp_path`` with the stand-in trainer (its clone made once)."""
    python = tmp_path / "python"
    python.write_text(STAND_IN.format(python=sys.executable, tmp=tmp_path))
    python.chmod(0o755)
    code = tmp_path / "campaign" / "code"
    if not code.exists():
        (code / "scripts").mkdir(parents=True)  # the clone's evaluation scripts, which the campaign runs
        shutil.copy(SCRIPT.with_name("mdm_fast_eval.sh"), code / "scripts")
        shutil.copy(SCRIPT.with_name("sudoku_curve.sh"), code / "scripts")
    committed = tmp_path / "committed"
    if not committed.exists():  # the committed rows: seed 0 of the easy MDM (and, superseded, seed 7's)
        for folder, name in [("easy", "sudoku_mdm_easy_seed0"), ("superseded/easy", "sudoku_mdm_easy_seed7")]:
            for suffix in ("", "_eval"):
                (committed / folder).mkdir(parents=True, exist_ok=True)
                (committed / folder / f"{name}{suffix}.csv").write_text("rows\n")
        subprocess.run(["git", "init", "-q", str(code)], check=True)
        subprocess.run(
            ["git", "-C", str(code), "commit", "-q", "--allow-empty", "-m", "x"],
            check=True,
            env={
                **os.environ,
                "GIT_AUTHOR_NAME": "t",
                "GIT_AUTHOR_EMAIL": "t@t",
                "GIT_COMMITTER_NAME": "t",
                "GIT_COMMITTER_EMAIL": "t@t",
            },
        )
    return {
        **os.environ,
        "FLOWLM_CAMPAIGN": str(tmp_path / "campaign"),
        "FLOWLM_PYTHON": str(python),
        "FLOWLM_CAMPAIGN_PLAN": plan,
        "FLOWLM_COMMITTED": str(committed),
    }


def campaign(
    tmp_path: Path, *args: str, plan: str = f"{COMMITTED} sudoku_mdm_easy:7"
) -> tuple[subprocess.CompletedProcess, list[str]]:
    trained = tmp_path / "trained.txt"
    env = campaign_env(tmp_path, plan)
    done = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=SLOW)
    return done, trained.read_text().splitlines() if trained.exists() else []


def test_the_evaluations_sample_in_the_runs_precision(tmp_path):
    """The curve and the fast decoders sample in the training run's precision (its final rows' own), not the
    evaluation trainer's default (float32 on a CPU without bf16 kernels)."""
    done, trained = campaign(tmp_path, "run", plan="sudoku_mdm_easy:7")
    assert done.returncode == 0 and trained == ["experiment=sudoku_mdm_easy seed=7", *evaluations(7)], done.stderr
    assert (tmp_path / "eval_precision.txt").read_text().splitlines() == ["trainer.precision=bf16-mixed"] * 2


def test_committed_rows_of_another_budget_do_not_count(tmp_path):
    """A model whose committed rows were trained to another budget (budget_steps 6 000, the tables' now 20 000)
    trains again without a `redo` (a new machine's campaign folder has none), and its evaluations follow; rows at
    the tables' budget are skipped."""
    campaign_env(tmp_path, "")  # the committed folder
    folder = tmp_path / "committed" / "easy"
    for seed, steps in ((3, 6000), (4, 20000)):
        for suffix in ("", "_eval"):
            (folder / f"sudoku_mdm_easy_seed{seed}{suffix}.csv").write_text(f"seed,budget_steps\n{seed},{steps}.0\n")
    done, trained = campaign(tmp_path, "run", plan="sudoku_mdm_easy:3 sudoku_mdm_easy:4")
    assert done.returncode == 0, done.stderr
    assert trained == ["experiment=sudoku_mdm_easy seed=3", *evaluations(3)]
    assert "skip sudoku_mdm_easy seed 4: its rows are committed" in done.stdout


def test_committed_rows_are_skipped_unless_redone(tmp_path):
    done, trained = campaign(tmp_path, "run")
    assert done.returncode == 0, done.stderr
    # seed 0's rows (and its evaluations' rows) are committed; seed 7's only superseded: it trains, then its curve
    # and its fast decoders are sampled
    assert trained == ["experiment=sudoku_mdm_easy seed=7", *evaluations(7)]
    assert "skip sudoku_mdm_easy seed 0" in done.stdout
    assert (tmp_path / "campaign" / "done" / "sudoku_mdm_easy_seed7").exists()

    redo, _ = campaign(tmp_path, "redo", "sudoku_mdm_easy", "0")
    assert redo.returncode == 0, redo.stderr
    again, trained = campaign(tmp_path, "run")
    assert again.returncode == 0, again.stderr
    # seed 7 is done; seed 0 trains again, and its fast decoders are evaluated again on the new weights
    assert trained[3:] == ["experiment=sudoku_mdm_easy seed=0", *evaluations(0)]
    assert not (tmp_path / "campaign" / "redo" / "sudoku_mdm_easy_seed0").exists()  # done: no longer asked for

    bad, _ = campaign(tmp_path, "redo", "sudoku_mdm_easy", "zero")
    assert bad.returncode == 2 and "usage" in bad.stderr


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (["redo", "sudoku_mdm_easy", "zero"], "redo: SEED must be an integer ≥ 0, got 'zero'; usage: "),
        (["update"], "update: no campaign clone in {campaign}/code (never started here): 'start' makes it"),
        (["nosuch"], "unknown command 'nosuch'; usage: "),
    ],
)
def test_a_campaign_user_error_names_what_was_wrong_in_one_line(tmp_path, args, line):
    """A bad seed, an `update` before any `start` (git's "fatal: cannot change to ...", exit 128) and an unknown
    command: one line saying what was wrong, exit 2, and no campaign folder made."""
    env = {**campaign_env(tmp_path, COMMITTED), "FLOWLM_CAMPAIGN": str(tmp_path / "nowhere")}
    done = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.splitlines()) == 1 and done.stderr.startswith(line.format(campaign=tmp_path / "nowhere"))
    assert not (tmp_path / "nowhere").exists()


def test_redo_names_a_bad_experiment_and_the_valid_ones(tmp_path):
    """A redo outside the plan would mark a model no turn ever comes for: refused in one line that names the bad
    experiment (or seed) and what the plan holds; nothing is marked."""
    plan = "sudoku_mdm_easy:0 sudoku_mdm_easy:7 sudoku_fmlm_plus_init_easy:7"
    bad, _ = campaign(tmp_path, "redo", "no_such_experiment", "0", plan=plan)
    assert bad.returncode == 2
    assert bad.stderr.splitlines() == [
        "redo: no experiment 'no_such_experiment' in the campaign's plan; one of: sudoku_mdm_easy "
        "sudoku_fmlm_plus_init_easy"
    ]
    seed, _ = campaign(tmp_path, "redo", "sudoku_fmlm_plus_init_easy", "3", plan=plan)
    assert seed.returncode == 2
    assert seed.stderr.splitlines() == [
        "redo: sudoku_fmlm_plus_init_easy seed 3 is not in the campaign's plan; its seeds there: 7"
    ]
    assert not (tmp_path / "campaign" / "redo").exists()


def test_a_failed_evaluation_stops_the_campaign_and_is_retried_alone(tmp_path):
    """A model's curve (and an MDM's fast decoders) are sampled once it is trained; a failure stops the plan (the
    FMLM+ built from it waits), and the relaunch evaluates again without retraining; a model that is no MDM gets its
    curve only."""
    plan = "sudoku_mdm_easy:7 sudoku_fmlm_plus_init_easy:7"
    (tmp_path / "fail_eval").touch()
    failed, trained = campaign(tmp_path, "run", plan=plan)
    assert failed.returncode == 1
    assert "FAILED sudoku_mdm_easy seed 7: sudoku_curve.sh" in failed.stdout
    assert trained == ["experiment=sudoku_mdm_easy seed=7"]
    status, _ = campaign(tmp_path, "status", plan=plan)
    assert "trained; its curve and evaluations are sampled next" in status.stdout

    (tmp_path / "fail_eval").unlink()
    again, trained = campaign(tmp_path, "run", plan=plan)
    assert again.returncode == 0, again.stdout + again.stderr
    assert trained[1:] == [
        *evaluations(7),
        "experiment=sudoku_fmlm_plus_init_easy seed=7",
        *evaluations(7, "sudoku_fmlm_plus_init_easy"),
    ]
    assert (tmp_path / "campaign" / "done" / "sudoku_mdm_easy_seed7_eval").exists()
    third, trained = campaign(tmp_path, "run", plan=plan)
    assert third.returncode == 0 and len(trained) == 5  # nothing left to do


def test_redo_fresh_moves_a_damaged_run_aside_and_trains_it_from_the_start(tmp_path):
    """`redo EXP SEED --fresh`: the run folder, sweep folder, logs and CSVs go to discarded/ (nothing is deleted), and
    the model trains again, then its evaluations; refused while the campaign runs."""
    plan = "sudoku_mdm_easy:7"
    first, _ = campaign(tmp_path, "run", plan=plan)
    assert first.returncode == 0, first.stdout + first.stderr
    root = tmp_path / "campaign"
    run = root / "runs" / "sudoku_mdm_easy" / "cpu" / "seed7"
    csv = root / "results" / "sudoku" / "sudoku_easy_6x6" / "sudoku_mdm_easy_seed7.csv"
    csv.parent.mkdir(parents=True)
    csv.write_text("rows of the damaged run\n")

    (root / "campaign.pid").write_text(str(os.getpid()))  # a live process holding the lock: the campaign runs
    with open(root / "campaign.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        refused, _ = campaign(tmp_path, "redo", "sudoku_mdm_easy", "7", "--fresh", plan=plan)
    assert refused.returncode == 2 and "stop it first" in refused.stderr and run.exists()
    (root / "campaign.pid").unlink()

    fresh, _ = campaign(tmp_path, "redo", "sudoku_mdm_easy", "7", "--fresh", plan=plan)
    assert fresh.returncode == 0, fresh.stderr
    assert not run.exists() and not csv.exists()
    (aside,) = (root / "discarded").iterdir()
    assert (aside / "seed7" / "run_config.yaml").exists() and (aside / "sudoku_mdm_easy_seed7.csv").exists()
    again, trained = campaign(tmp_path, "run", plan=plan)
    assert again.returncode == 0, again.stdout + again.stderr
    assert trained[3:] == ["experiment=sudoku_mdm_easy seed=7", *evaluations(7)]


def printing_python(tmp_path: Path) -> dict[str, str]:
    """The environment whose FLOWLM_PYTHON runs a script's settings snippet (`-c`) in the real interpreter and prints
    the evaluation's command line instead of running it."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/bash\nif [[ "$1" == -c ]]; then exec {sys.executable} "$@"; fi\necho "$*"\n')
    python.chmod(0o755)
    return {**os.environ, "FLOWLM_PYTHON": str(python)}


def test_the_fast_evaluation_repeats_the_runs_settings_null_included(tmp_path):
    """scripts/mdm_fast_eval.sh passes the run's budgets, puzzles, seeds and compile as overrides, the fast decoders
    only (the run sampled its final weights with the fixed-step ones); a null setting (all
    validation batches) as `null`, which Hydra reads as null, not Python's `None`, a string; a folder without a
    finished run is refused before anything runs."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "run_config.yaml").write_text(
        "seed: 2\ncompile: true\neval:\n  nfe: [4, 18]\n  max_batches: null\n  seed: 2\n"
    )
    script = [str(SCRIPT.with_name("mdm_fast_eval.sh")), str(run), str(tmp_path / "results"), "trainer=gpu"]
    env = printing_python(tmp_path)
    refused = subprocess.run(["bash", *script], env=env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "holds no finished run" in refused.stderr  # no checkpoint yet
    (run / "checkpoints" / "last.ckpt").touch()
    done = subprocess.run(["bash", *script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [
        "-m",
        "runners.evaluate",
        f"ckpt_path={run}/checkpoints/last.ckpt",
        "eval=sudoku_mdm_fast",
        "~eval.samplers.ancestral",
        "~eval.samplers.confidence",
        "seed=2",
        "eval.nfe=[4,18]",
        "eval.max_batches=null",
        "eval.seed=2",
        "compile=true",
        f"results_csv={tmp_path / 'results'}",
        "trainer=gpu",
    ]


def test_the_curve_samples_each_kept_checkpoint_but_the_final_one_with_the_runs_settings(tmp_path):
    """scripts/sudoku_curve.sh: every curve-step checkpoint before the run's last step (whose rows the training run
    wrote), in step order, with the run's family's samplers and its budgets, puzzles and seeds; a run that kept none
    is refused in one line; a rerun skips a step whose rows are all written (resumable), unless FLOWLM_CURVE_REDO=1."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").touch()
    (run / "run_config.yaml").write_text(
        "seed: 3\nfamily: mdm\nname: m\ntask: t\ncompile: true\ntrainer:\n  max_steps: 16\n"
        "data: {box_rows: 2, box_cols: 3, conditional: true, difficulty: easy}\n"
        "eval:\n  nfe: [4, 18, 41]\n  max_batches: null\n  seed: 3\n  skip_unfit_budgets: true\n"
    )
    script = [str(SCRIPT.with_name("sudoku_curve.sh")), str(run), str(tmp_path / "results")]
    env = printing_python(tmp_path)
    refused = subprocess.run(["bash", *script], env=env, capture_output=True, text=True, timeout=SLOW)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "kept no curve checkpoint" in refused.stderr
    for step in (16, 4, 12, 8):
        (run / "checkpoints" / f"curve-step{step:07d}.ckpt").touch()
    done = subprocess.run(["bash", *script], env=env, capture_output=True, text=True, timeout=SLOW)
    assert done.returncode == 0, done.stderr
    commands = [line.split() for line in done.stdout.splitlines() if line.startswith("-m runners.evaluate")]
    assert [c[2] for c in commands] == [f"ckpt_path={run}/checkpoints/curve-step{s:07d}.ckpt" for s in (4, 8, 12)]
    assert commands[0][3:] == [  # the headline budgets (4 and one call per position), 512 puzzles, compiled
        "eval=sudoku_mdm",
        "seed=3",
        "eval.nfe=[4,41]",
        "eval.max_batches=4",
        "eval.seed=3",
        "eval.skip_unfit_budgets=true",
        "compile=true",
        f"results_csv={tmp_path / 'results'}",
    ]

    rows = tmp_path / "results" / "t" / "m_seed3_eval.csv"  # step 4 sampled at both budgets, step 8 at one
    rows.parent.mkdir(parents=True)
    rows.write_text("eval_step,nfe_budget,samples\n4,4,512\n4,41,512\n8,4,512\n12,18,512\n")
    resumed = subprocess.run(["bash", *script], env=env, capture_output=True, text=True, timeout=SLOW)
    assert resumed.returncode == 0, resumed.stderr
    assert "step 4 of 16 already sampled" in resumed.stdout
    sampled = [line.split()[2] for line in resumed.stdout.splitlines() if line.startswith("-m runners.evaluate")]
    assert sampled == [f"ckpt_path={run}/checkpoints/curve-step{s:07d}.ckpt" for s in (8, 12)]
    # more puzzles asked (the budget study's 16 batches) than step 4 was sampled on: sampled again, on 16 batches
    more = subprocess.run(
        ["bash", *script], env={**env, "FLOWLM_CURVE_BATCHES": "16"}, capture_output=True, text=True, timeout=SLOW
    )
    lines = [line.split() for line in more.stdout.splitlines() if line.startswith("-m runners.evaluate")]
    assert [c[2] for c in lines] == [f"ckpt_path={run}/checkpoints/curve-step{s:07d}.ckpt" for s in (4, 8, 12)]
    assert all("eval.max_batches=16" in c for c in lines)
    # the budget study's run keeps its source's run_config.yaml (name m): its rows, named m_long, say what is done
    done = "".join(f"{s},{b},512\n" for s in (4, 8, 12) for b in (4, 41))
    (rows.parent / "m_long_seed3_eval.csv").write_text("eval_step,nfe_budget,samples\n" + done)
    named = subprocess.run(
        ["bash", *script], env={**env, "FLOWLM_CURVE_NAME": "m_long"}, capture_output=True, text=True, timeout=SLOW
    )
    assert "step 12 of 16 already sampled" in named.stdout and "-m runners.evaluate" not in named.stdout
    redone = subprocess.run(
        ["bash", *script], env={**env, "FLOWLM_CURVE_REDO": "1"}, capture_output=True, text=True, timeout=SLOW
    )
    assert redone.stdout.count("-m runners.evaluate") == 3
    # a run resumed past its recorded steps (the budget study): the caller says where the curve ends
    (run / "checkpoints" / "curve-step0000020.ckpt").touch()
    longer = subprocess.run(
        ["bash", *script], env={**env, "FLOWLM_CURVE_UNTIL": "24"}, capture_output=True, text=True, timeout=SLOW
    )
    assert longer.returncode == 0, longer.stderr
    assert [line.split()[2] for line in longer.stdout.splitlines() if line.startswith("-m runners.evaluate")] == [
        f"ckpt_path={run}/checkpoints/curve-step{s:07d}.ckpt" for s in (8, 12, 16, 20)
    ]


@pytest.mark.parametrize(
    ("family", "board", "nfe", "curve"),
    [  # the budgets of the curves the report draws (analysis/sudoku_tables.py curve_nfe) that the run evaluates;
        # conditional MDM and FMLM+ runs: the tests above
        ("mdm", "uncond", "[1, 2, 3, 4, 9, 12, 27, 36]", "[9,36]"),  # one call per cell, the paper's 9
        ("flow", "uncond", "[1, 2, 3, 4, 9, 12, 27, 36]", "[4,9]"),  # PR at the paper's 9 and its 9 cells a call
        ("mdm", "easy", "[4, 18]", "[4]"),  # a run without one call per position: not its curve's budget either
        ("mlfm", "easy", "[4, 18]", "[4,18]"),  # no curve in the report: NFE 4 and the run's largest
    ],
)
def test_the_curve_samples_the_budgets_the_report_draws(tmp_path, family, board, nfe, curve):
    """An unconditional run's curve is sampled where the report's curves read it (an MDM at 36 and 9, PR at 9 and
    4), not at NFE 4 and the largest budget alone: those left PR's headline budget (9) without a curve."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    for name in ("last", "curve-step0000004"):
        (run / "checkpoints" / f"{name}.ckpt").touch()
    conditional = "false" if board == "uncond" else "true, difficulty: easy"
    (run / "run_config.yaml").write_text(
        f"seed: 0\nfamily: {family}\nname: m\ntask: t\ntrainer:\n  max_steps: 8\n"
        f"data: {{box_rows: 2, box_cols: 3, conditional: {conditional}}}\n"
        f"eval:\n  nfe: {nfe}\n  max_batches: null\n  seed: 0\n"
    )
    script = [str(SCRIPT.with_name("sudoku_curve.sh")), str(run), str(tmp_path / "results")]
    env = printing_python(tmp_path)
    done = subprocess.run(["bash", *script], env=env, capture_output=True, text=True, timeout=SLOW)
    assert done.returncode == 0, done.stderr
    (command,) = [line.split() for line in done.stdout.splitlines() if line.startswith("-m runners.evaluate")]
    assert f"eval=sudoku_{family}" in command and f"eval.nfe={curve}" in command


def wait_for(condition, what: str, seconds: float = 30) -> None:
    """Poll ``condition`` until it holds (this machine is slow and shared), or fail naming ``what``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"waited {seconds} s for {what}"
        time.sleep(0.1)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_one_campaign_at_a_time_and_stop_ends_all_of_it(tmp_path):
    """Two `start`s at once: one runner trains, the other `start` is refused in one line naming it (two runners
    trained the same model, and `stop` ended the one whose pid was recorded last). `stop` ends the runner's whole
    process group and says so in the campaign log; while the trainer still ends (saving its checkpoint), `status`
    says "stopping" and a `start` is refused; then "not running"."""
    plan = "sudoku_mdm_easy:7"
    env = campaign_env(tmp_path, plan)
    (tmp_path / "block").touch()
    root = tmp_path / "campaign"
    try:
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
        starts = [subprocess.Popen(["bash", str(SCRIPT), "start"], env=env, **pipes) for _ in range(2)]
        outcomes = sorted((p.wait(timeout=60), *p.communicate()) for p in starts)
        assert [code for code, *_ in outcomes] == [0, 2], outcomes
        (_, started, _), (_, _, refused) = outcomes
        runner = int((root / "campaign.pid").read_text())
        assert started.startswith(f"started (pid {runner}")
        assert len(refused.splitlines()) == 1 and refused.startswith(f"refused: a campaign already runs in {root}")
        wait_for(lambda: (tmp_path / "trainers.txt").exists(), "the trainer")
        again = subprocess.run(["bash", str(SCRIPT), "start"], env=env, capture_output=True, text=True, timeout=60)
        assert again.returncode == 2 and f"(running, pid {runner}; runner pid {runner} on " in again.stderr
        time.sleep(1)  # a second runner, had one started, would have reached its trainer by now
        (trainer,) = map(int, (tmp_path / "trainers.txt").read_text().split())
        assert (tmp_path / "trained.txt").read_text().splitlines() == ["experiment=sudoku_mdm_easy seed=7"]

        status, _ = campaign(tmp_path, "status", plan=plan)
        assert f"campaign: {root} (running, pid {runner})" in status.stdout
        (tmp_path / "linger").touch()  # the trainer takes its time to end, as one saving a checkpoint does
        stop, _ = campaign(tmp_path, "stop", plan=plan)
        assert stop.returncode == 0 and stop.stdout.startswith("stopping (pid ") and str(trainer) in stop.stdout
        log = (root / "campaign.log").read_text()
        assert f"stop: SIGTERM to the runner (pid {runner}) and its group (pid " in log
        wait_for(lambda: not alive(runner), "the runner to end")
        assert alive(trainer)
        status, _ = campaign(tmp_path, "status", plan=plan)
        head = status.stdout.splitlines()[0]
        assert head.startswith(f"campaign: {root} (stopping: the runner has ended; its trainer still ends, saving ")
        assert str(trainer) in head.partition("(pid ")[2].rstrip(")").split(",")
        refused, _ = campaign(tmp_path, "start", plan=plan)
        assert refused.returncode == 2 and "(stopping: " in refused.stderr

        (tmp_path / "linger").unlink()
        wait_for(lambda: not alive(trainer), "the trainer to end")
        status, _ = campaign(tmp_path, "status", plan=plan)
        assert f"campaign: {root} (not running)" in status.stdout
    finally:  # nothing of the campaign outlives the test, whatever failed
        for name in ("block", "linger"):
            (tmp_path / name).unlink(missing_ok=True)
        pid = (root / "campaign.pid").read_text() if (root / "campaign.pid").exists() else ""
        if pid and alive(int(pid)):
            os.killpg(int(pid), signal.SIGTERM)


def test_status_writes_nothing(tmp_path):
    """`status` only reads: no campaign folder made where there is none, nothing changed in one that exists."""
    env = {**campaign_env(tmp_path, COMMITTED), "FLOWLM_CAMPAIGN": str(tmp_path / "nowhere")}
    status = subprocess.run(["bash", str(SCRIPT), "status"], env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0 and f"campaign: {tmp_path / 'nowhere'} (not started)" in status.stdout
    assert not (tmp_path / "nowhere").exists()
    done, _ = campaign(tmp_path, "run")
    assert done.returncode == 0, done.stderr

    def snapshot():
        return {(p, p.stat().st_mtime_ns, p.stat().st_size) for p in (tmp_path / "campaign").rglob("*")}

    before = snapshot()
    status, _ = campaign(tmp_path, "status")
    assert status.returncode == 0 and "(not running)" in status.stdout
    assert snapshot() == before


def test_status_gives_a_running_models_budget_and_the_hours_left_at_its_mean_rate(tmp_path):
    """A model with a record and no done marker: its step of the budget (its run_config.yaml's trainer.max_steps), val
    loss and minutes, and the hours its remaining steps take at its mean seconds a step so far; without a readable
    budget, the step alone. Running while a trainer holds its run.lock, else paused (started and left)."""
    run = tmp_path / "campaign" / "runs" / "sudoku_mdm_easy" / "cpu" / "seed7"
    run.mkdir(parents=True)
    record = {"steps": 5000, "wall_s": 9000.0, "final_val_loss": 0.012345}
    (run / "convergence.json").write_text(json.dumps(record))
    (run / "run_config.yaml").write_text("trainer:\n  max_steps: 20000\n")
    line = "step 5000 of 20000, val loss 0.0123, 150 min (≈ 7.5 h more at its mean 1.80 s a step)"
    with open(run / "run.lock", "a") as held:  # a trainer holds its run folder's lock while it trains
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        status, _ = campaign(tmp_path, "status", plan="sudoku_mdm_easy:7")
    assert status.returncode == 0, status.stderr
    assert f"running: {line}" in status.stdout, status.stdout  # 15 000 steps × 1.8 s
    status, _ = campaign(tmp_path, "status", plan="sudoku_mdm_easy:7")  # the lock let go: started and left
    assert f"paused: {line}" in status.stdout, status.stdout
    (run / "run_config.yaml").write_text("trainer: {}\n")
    status, _ = campaign(tmp_path, "status", plan="sudoku_mdm_easy:7")
    assert "paused: step 5000, val loss 0.0123, 150 min\n" in status.stdout, status.stdout


def test_the_budget_study_refuses_before_starting_anything(tmp_path):
    """scripts/sudoku_budget_study.sh start: a folder without a finished run, a run that is not a tables run, and a
    step count not past the run's own are refused in one line, and nothing is started or written."""
    study = tmp_path / "study"
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    script = ["bash", str(SCRIPT.with_name("sudoku_budget_study.sh")), "start", str(run)]
    env = {**os.environ, "FLOWLM_STUDY": str(study), "FLOWLM_PYTHON": sys.executable}

    def start(steps: str) -> subprocess.CompletedProcess:
        return subprocess.run([*script, steps], env=env, capture_output=True, text=True, timeout=60)

    missing = start("12000")
    assert missing.returncode == 2 and "holds no finished run" in missing.stderr
    (run / "checkpoints" / "last.ckpt").touch()
    (run / "run_config.yaml").write_text("name: sudoku_mdm_easy\nseed: 0\ntrainer:\n  max_steps: 6000\n")
    other = start("12000")
    assert other.returncode == 2 and "not a run of hparams_search=sudoku_tables" in other.stderr
    (run / "run_config.yaml").write_text(
        "name: sudoku_mdm_easy\nseed: 0\nsweep:\n  name: sudoku_tables\ntrainer:\n  max_steps: 6000\n"
    )
    short = start("6000")
    assert short.returncode == 2 and short.stderr.strip().endswith("is not past the run's own 6000 steps")
    bad = start("many")
    assert bad.returncode == 2 and bad.stderr.startswith("usage:")
    assert not study.exists()


def test_the_budget_study_names_the_budget_its_curves_accept(tmp_path):
    """scripts/sudoku_budget_study.sh budget: the tables' rows up to the run's budget and the study's past it, read
    from their folders as one curve (a row in both counted once): each step's gain over its last quarter, and the
    smallest step every curve accepts."""
    from callbacks.results_csv import write_rows
    from tests.analysis.test_sudoku_tables import row

    def points(steps_values, folder):
        rows = [
            row("MDM", "scratch", sampler, 41, 0, v + (10 if sampler == "confidence" else 0), eval_step=s, steps=s)
            for s, v in steps_values
            for sampler in ("ancestral", "confidence")
        ]
        write_rows(tmp_path / folder / "easy" / "mdm_seed0.csv", rows)

    points([(1500, 40.0), (3000, 70.0), (4500, 80.0), (6000, 84.0)], "tables")
    points([(6000, 84.0), (7500, 85.5), (9000, 86.0), (12000, 86.5)], "study")  # 6 000 in both folders
    script = ["bash", str(SCRIPT.with_name("sudoku_budget_study.sh")), "budget"]
    env = {**os.environ, "FLOWLM_STUDY": str(tmp_path / "none"), "FLOWLM_PYTHON": sys.executable}
    out = subprocess.run([*script, str(tmp_path / "tables"), str(tmp_path / "study")], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    # 12 000: 86.5 against 86.0 at 9 000 (+0.5) on both curves; 9 000: +2.0 against 6 000
    assert out.stdout.strip().endswith(
        "budget: none confirmed yet; 12000 steps provisionally (its curves accept it, no later step yet)"
    ), out.stdout
    assert " ancestral   41    9000         6000    84.0       86.0   2.0     False" in out.stdout


def test_a_campaign_keeps_its_plan_for_the_commands_after_it(tmp_path):
    """The plan a campaign ran with is kept in its folder (`plan`): `status` and `redo` without FLOWLM_CAMPAIGN_PLAN
    read it, not the default plan (two campaigns that split the plan would otherwise each train the other's models);
    the variable, when given again, replaces it."""
    done, trained = campaign(tmp_path, "run", plan="sudoku_mdm_easy:7")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "campaign" / "plan").read_text() == "sudoku_mdm_easy:7\n"
    env = {key: value for key, value in campaign_env(tmp_path, "").items() if key != "FLOWLM_CAMPAIGN_PLAN"}
    status = subprocess.run(["bash", str(SCRIPT), "status"], env=env, capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    models = [line.split()[:3] for line in status.stdout.splitlines()[1:]]
    assert models == [["sudoku_mdm_easy", "seed", "7"]], status.stdout  # not the default plan's 40-odd models
    redo = subprocess.run(
        ["bash", str(SCRIPT), "redo", "sudoku_fmlm_plus_scratch_easy", "0"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert redo.returncode == 2 and "sudoku_mdm_easy" in redo.stderr  # a model of the default plan, not of this one
    again, _ = campaign(tmp_path, "run", plan="sudoku_mdm_easy:7 sudoku_mdm_easy:8")
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "campaign" / "plan").read_text() == "sudoku_mdm_easy:7 sudoku_mdm_easy:8\n"


def test_collect_moves_a_models_rows_of_another_budget_aside(tmp_path):
    """`collect` copies a finished model's rows in; the same model's committed rows of another training budget (its
    final rows and its curve's, budget_steps) move to superseded-steps<old>/ with a README line, out of the tables,
    so the old curve is never read beside the new final rows; a model's rows at the same budget are replaced in
    place, an unfinished evaluation's rows are not copied, and the report is made of the committed folder."""
    env = campaign_env(tmp_path, "sudoku_mdm_easy:0 sudoku_mdm_easy:2")
    report = tmp_path / "report"
    report.write_text(f'#!/bin/bash\necho "$*" > {tmp_path}/report_args.txt\n')
    report.chmod(0o755)
    env["FLOWLM_REPORT"] = str(report)
    results, done = tmp_path / "campaign" / "results" / "sudoku" / "easy", tmp_path / "campaign" / "done"
    committed = tmp_path / "committed"
    results.mkdir(parents=True)
    done.mkdir(parents=True)

    def rows(path: Path, budget: int, accuracy: float) -> str:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = f"sampler,budget_steps,accuracy\nancestral,{budget},{accuracy}\n"
        path.write_text(text)
        return text

    new0 = rows(results / "sudoku_mdm_easy_seed0.csv", 20000, 91.0)  # trained; its curve still being sampled
    rows(results / "sudoku_mdm_easy_seed0_eval.csv", 20000, 60.0)
    new2 = rows(results / "sudoku_mdm_easy_seed2.csv", 20000, 92.0)
    (done / "sudoku_mdm_easy_seed0").touch()
    (done / "sudoku_mdm_easy_seed2").touch()
    old0 = rows(committed / "easy" / "sudoku_mdm_easy_seed0.csv", 6000, 84.4)
    old0_eval = rows(committed / "easy" / "sudoku_mdm_easy_seed0_eval.csv", 6000, 75.0)
    rows(committed / "easy" / "sudoku_mdm_easy_seed2.csv", 20000, 10.0)  # the same budget: replaced in place
    other = rows(committed / "easy" / "sudoku_mdm_easy_seed1.csv", 6000, 80.0)  # another model: untouched

    run = subprocess.run(["bash", str(SCRIPT), "collect"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "2 finished model(s) collected" in run.stdout, run.stdout
    easy, aside = committed / "easy", committed / "superseded-steps6000"
    assert (easy / "sudoku_mdm_easy_seed0.csv").read_text() == new0
    assert not (easy / "sudoku_mdm_easy_seed0_eval.csv").exists()  # the old curve aside, the new one not done yet
    assert (aside / "easy" / "sudoku_mdm_easy_seed0.csv").read_text() == old0
    assert (aside / "easy" / "sudoku_mdm_easy_seed0_eval.csv").read_text() == old0_eval
    assert (easy / "sudoku_mdm_easy_seed2.csv").read_text() == new2
    assert not (aside / "easy" / "sudoku_mdm_easy_seed2.csv").exists()
    assert (easy / "sudoku_mdm_easy_seed1.csv").read_text() == other
    readme = (aside / "README.md").read_text()
    for name in ("sudoku_mdm_easy_seed0.csv", "sudoku_mdm_easy_seed0_eval.csv"):
        assert f"- easy/{name}: trained to 6000 steps; retrained to 20000" in readme, readme
    assert (tmp_path / "report_args.txt").read_text().split() == [
        "--config-name",
        "report_sudoku",
        f"results_dir={committed}",
    ]
    # rows only under superseded-steps<N>/ are not committed rows: such a model still trains
    rows(aside / "easy" / "sudoku_mdm_easy_seed3.csv", 6000, 70.0)
    status = subprocess.run(
        ["bash", str(SCRIPT), "status"],
        env={**env, "FLOWLM_CAMPAIGN_PLAN": "sudoku_mdm_easy:3"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[1].split()[-1] == "waiting", status.stdout
