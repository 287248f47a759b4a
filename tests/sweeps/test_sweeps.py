"""Sweeps end to end: an Optuna study and a grid on tiny models land in MLflow; a crashing trial is recorded as
failed and the sweep goes on; a wrong objective is refused before compute."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import mlflow
import optuna
import pytest
from conftest import FAST, cpu_run, module_runs
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from flowlm.project import CONF_DIR
from runners.objectives import ObjectiveError, objective_values
from runners.train import train
from runners.trial import check_directions

QUIET = ["trainer.enable_progress_bar=false"]


def run_sweep(entry: str, overrides: list[str], root: Path, failed: int = 0) -> subprocess.CompletedProcess:
    """`flowlm-<entry> -m ...` in a fresh process, as a user runs it, with runs and data under ``root``; it exits
    with status 1, naming them, when ``failed`` > 0 of its trials failed (after running all of them)."""
    module = {"train": "runners.train", "eval": "runners.evaluate"}[entry]
    env = {**os.environ, "FLOWLM_RUNS": str(root / "runs"), "FLOWLM_DATA": str(root / "data")}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(
        [sys.executable, "-m", module, "--multirun", *overrides, *QUIET],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    if failed:
        assert proc.returncode == 1 and f"{failed} trial(s) failed" in proc.stderr, output
    else:
        assert proc.returncode == 0, f"the sweep stopped:\n{output}"
    return proc


def sweep_runs(root: Path, sweep: str):
    """The MLflow runs tagged with ``sweep``, one row per trial, in trial order."""
    mlflow.set_tracking_uri(f"sqlite:///{root / 'runs' / 'mlflow.db'}")
    runs = mlflow.search_runs(search_all_experiments=True, filter_string=f"tags.`flowlm.sweep` = '{sweep}'")
    return runs.sort_values("tags.flowlm.trial", key=lambda s: s.astype(int), ignore_index=True)


@pytest.fixture(scope="module")
def flow_ckpt(tmp_path_factory):
    """A 2-step FMLM+ checkpoint (unconditional 6×6) for the sampling-only sweeps."""
    from conftest import compose_config

    with module_runs(tmp_path_factory, "sweeps") as root:
        result = train(compose_config(overrides=cpu_run("sudoku_fmlm_plus_scratch_uncond")))
        yield Path(result["run_dir"], "checkpoints", "last.ckpt"), root


def test_optuna_multi_objective_sweep_over_a_checkpoint(flow_ckpt):
    ckpt, root = flow_ckpt
    run_sweep(
        "eval",
        [
            "hparams_search=pr_optuna",
            f"ckpt_path={ckpt}",
            "sweep.name=pr_test",
            "hydra.sweeper.n_trials=3",
            "eval.nfe=[4]",
            "eval.max_batches=1",
            "eval.samplers.pr.rounds=int(interval(1, 2))",
            "eval.samplers.pr.flow_steps=choice(1, 2)",
            "eval.samplers.pr.threshold=choice(0.5, 2.0)",  # PR refuses 2.0 before compute: a crashing trial
            "hydra.sweeper.sampler.seed=3",  # draws thresholds 2.0, 0.5, 0.5 (optuna 4.9): a failure, then the rest
        ],
        root,
        failed=1,
    )
    study = optuna.load_study(study_name="pr_test", storage=f"sqlite:///{root / 'runs' / 'optuna.db'}")
    assert study.directions == [optuna.study.StudyDirection.MAXIMIZE, optuna.study.StudyDirection.MINIMIZE]
    assert len(study.trials) == 3  # the sweep went on past the failed trial(s)
    failed = {t.number for t in study.trials if t.state == optuna.trial.TrialState.FAIL}
    assert failed == {t.number for t in study.trials if t.params["eval.samplers.pr.threshold"] == 2.0}
    assert 0 < len(failed) < 3, "the seeded sampler should draw both thresholds in 3 trials (pick another seed)"
    runs = sweep_runs(root, "pr_test")
    assert list(runs["tags.flowlm.trial"]) == ["0", "1", "2"]  # a fresh study: Hydra job number = Optuna trial
    assert runs["tags.mlflow.runName"].is_unique and runs["tags.flowlm.trial_id"].is_unique
    assert set(runs["tags.flowlm.study"]) == {"pr_test"} and set(runs["tags.flowlm.sweeper"]) == {"OptunaSweeper"}
    assert set(runs["tags.flowlm.objectives"]) == {"eval/pr/nfe4/valid_pct,eval/pr/nfe4/nfe"}
    for trial in study.trials:
        row = runs.iloc[trial.number]
        assert row["params.trial/eval.samplers.pr.threshold"] == str(trial.params["eval.samplers.pr.threshold"])
        if trial.number in failed:
            assert row["status"] == "FAILED"
            assert "PR threshold must lie in (0, 1]" in row["tags.flowlm.error"]
            continue
        assert row["status"] == "FINISHED"
        objectives = [row["metrics.sweep/objective_0"], row["metrics.sweep/objective_1"]]
        assert objectives == trial.values
        assert objectives == [row["metrics.eval/pr/nfe4/valid_pct"], row["metrics.eval/pr/nfe4/nfe"]]
        rounds, steps = trial.params["eval.samplers.pr.rounds"], trial.params["eval.samplers.pr.flow_steps"]
        assert objectives[1] == rounds * steps  # the NFE PR actually spent, not the cap of 4
    pareto = OmegaConf.load(root / "runs" / "sweeps" / "pr_test" / "optimization_results.yaml")
    assert pareto.solutions and all(len(s["values"]) == 2 for s in pareto.solutions)


@pytest.mark.slow  # two sweep launches
def test_a_relaunched_optuna_sweep_continues_with_new_trials(flow_ckpt):
    ckpt, root = flow_ckpt
    sweep = [
        "hparams_search=pr_optuna",
        f"ckpt_path={ckpt}",
        "sweep.name=relaunch",
        "hydra.sweeper.n_trials=2",
        "eval.nfe=[4]",
        "eval.max_batches=1",
        "eval.samplers.pr.rounds=int(interval(1, 2))",
        "eval.samplers.pr.flow_steps=choice(1, 2)",
    ]
    run_sweep("eval", sweep, root)
    run_sweep("eval", sweep, root)  # the same command again
    study = optuna.load_study(study_name="relaunch", storage=f"sqlite:///{root / 'runs' / 'optuna.db'}")
    points = [tuple(sorted(t.params.items())) for t in study.trials]
    assert len(points) == 4 and len(set(points)) == 4, points  # new proposals, not the first launch's again
    assert len(list((root / "runs" / "sweeps" / "relaunch").glob("trial-*"))) == 4
    runs = sweep_runs(root, "relaunch")
    assert len(runs) == 4 and runs["tags.flowlm.trial_id"].is_unique
    pareto = OmegaConf.load(root / "runs" / "sweeps" / "relaunch" / "optimization_results.yaml").solutions
    listed = [tuple(sorted(s["params"].items())) for s in pareto]
    assert listed and len(set(listed)) == len(listed)


def test_grid_sweep_trains_each_point_in_its_own_run(tmp_path):
    run_sweep(
        "train",
        [
            "hparams_search=grid_nfe_seed",
            "experiment=sudoku_mdm_uncond",
            "scale=cpu",
            *FAST,
            "seed=0,1",  # replaces the grid's seeds: 2 points
            "optimized_metric=eval/confidence/nfe2/valid_pct",
        ],
        tmp_path,
    )
    runs = sweep_runs(tmp_path, "grid_nfe_seed")
    assert list(runs["status"]) == ["FINISHED", "FINISHED"]
    assert list(runs["params.trial/seed"]) == ["0", "1"] and list(runs["params.seed"]) == ["0", "1"]
    assert set(runs["tags.flowlm.sweeper"]) == {"BasicSweeper"}
    run_dirs = [Path(d) for d in runs["tags.flowlm.run_dir"]]
    assert len(set(run_dirs)) == 2
    for run_dir in run_dirs:  # each point trained in its own folder under the sweep's
        assert run_dir.parent == tmp_path / "runs" / "sweeps" / "grid_nfe_seed"
        assert (run_dir / "checkpoints" / "last.ckpt").exists()
    assert list(runs["metrics.sweep/objective_0"]) == list(runs["metrics.eval/confidence/nfe2/valid_pct"])


def test_a_crashing_trial_does_not_stop_the_grid(flow_ckpt):
    ckpt, root = flow_ckpt
    overrides = [f"ckpt_path={ckpt}", "eval=sudoku_flow", "eval.nfe=[2]", "eval.max_batches=1", "sweep.name=crash"]
    overrides += ["optimized_metric=eval/pr/nfe2/valid_pct", "eval.samplers.pr.threshold=2.0,0.9"]  # 2.0 crashes
    proc = run_sweep("eval", overrides, root, failed=1)
    assert "  trial-" in proc.stderr and "PR threshold must lie in (0, 1], got 2.0" in proc.stderr
    runs = sweep_runs(root, "crash")
    assert list(runs["status"]) == ["FAILED", "FINISHED"]  # the first trial crashed, the second still ran
    assert "PR threshold must lie in (0, 1], got 2.0" in runs.loc[0, "tags.flowlm.error"]
    assert runs.loc[0, "params.trial/eval.samplers.pr.threshold"] == "2.0"
    assert runs.loc[1, "metrics.sweep/objective_0"] == runs.loc[1, "metrics.eval/pr/nfe2/valid_pct"]


@pytest.mark.parametrize(
    ("key", "match"),
    [
        ("valid_pct", "not an evaluation key"),
        ("eval/pr/nfe2/valid_pct", "no sampler 'pr'.*'ancestral', 'confidence'"),
        ("eval/confidence/nfe3/valid_pct", r"NFE budget 3 is not evaluated; eval.nfe = \[2\]"),
        ("eval/confidence/nfe2/accuracy", "logs .*'valid_pct'.*not 'accuracy'"),
    ],
)
def test_a_wrong_objective_fails_before_compute(key, match, runs_env):
    from conftest import compose_config

    cfg = compose_config(overrides=["experiment=sudoku_mdm_uncond", "scale=cpu", *FAST, f"optimized_metric={key}"])
    with pytest.raises(ObjectiveError, match=match):
        train(cfg)
    assert not list((runs_env / "runs").rglob("run_config.yaml")) and not list((runs_env / "runs").rglob("*.ckpt"))


def test_objectives_are_read_from_the_result_rows():
    rows = [
        {"sampler": "pr", "nfe_budget": 4, "nfe": 3.0, "valid_pct": 50.0},
        {"sampler": "pr", "nfe_budget": 8, "nfe": 8.0, "valid_pct": 75.0},
    ]
    assert objective_values(["eval/pr/nfe8/valid_pct", "eval/pr/nfe4/nfe"], rows) == [75.0, 3.0]
    assert objective_values(None, rows) == []
    with pytest.raises(ObjectiveError, match="eval/pr/nfe4/valid_pct"):
        objective_values("eval/pr/nfe16/valid_pct", rows)


SEARCHES = [
    ("train", "grid_nfe_seed", ["experiment=sudoku_mdm_medium", "scale=cpu"]),
    ("eval", "grid_nfe_seed", ["ckpt_path=some.ckpt"]),
    ("train", "train_optuna", ["experiment=sudoku_fmlm_plus_scratch_medium", "scale=cpu"]),
    ("eval", "pr_optuna", ["ckpt_path=some.ckpt"]),
    ("eval", "mlfm_optuna", ["ckpt_path=some.ckpt"]),
    (
        "train",
        "optuna",
        ["experiment=sudoku_mdm_medium", "scale=cpu", "optimized_metric=eval/confidence/nfe4/accuracy"],
    ),
]


@pytest.mark.parametrize(("entry", "search", "overrides"), SEARCHES)
def test_every_search_names_keys_of_its_config(entry, search, overrides, runs_env):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(entry, overrides=[f"hparams_search={search}", *overrides], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    for key in sweeper.params or {}:  # a renamed sampler or method option would otherwise fail only at launch
        assert OmegaConf.select(cfg, key, default="<absent>") != "<absent>", f"{search} sweeps {key}, not in the config"
    check_directions(cfg.optimized_metric, sweeper)  # an Optuna search gives one objective per direction
    assert Path(cfg.hydra.sweep.dir).name == cfg.sweep.name
    if "study_name" in sweeper:
        assert sweeper.study_name == cfg.sweep.name and sweeper.storage.startswith("sqlite:///")


def _documented_sweeps() -> list[tuple[str, list[str]]]:
    """The `flowlm-* -m` commands in the comments of conf/hparams_search/ (continuation lines joined)."""
    commands = []
    for path in sorted(Path(CONF_DIR, "hparams_search").glob("*.yaml")):
        text = "\n".join(line.lstrip("# ") for line in path.read_text().splitlines() if line.startswith("#"))
        for command in re.findall(r"flowlm-(?:train|eval) -m (?:[^\n]*\\\n)*[^\n]*", text.replace("\\\n", " ")):
            commands.append((path.name, shlex.split(command.split("   #")[0])[2:]))
    return commands


def test_the_documented_sweep_commands_parse_as_sweeps():
    # was: optuna.yaml documented 'hydra.sweeper.params.method.optim.lr=tag(log, interval(...))', which Hydra refuses
    # ("Sweeping over Hydra's configuration is not supported"): the search space goes on the command line as the key
    from hydra.core.override_parser.overrides_parser import OverridesParser

    documented = _documented_sweeps()
    assert len(documented) >= 6
    parser = OverridesParser.create()
    for name, overrides in documented:
        for override in parser.parse_overrides(overrides):
            assert not (override.is_sweep_override() and override.key_or_group.startswith("hydra.")), (name, override)


def test_an_optuna_sweep_without_objective_is_refused():
    sweeper = OmegaConf.create({"direction": ["maximize", "minimize"]})
    with pytest.raises(ObjectiveError, match=r"2 objective\(s\) \['maximize', 'minimize'\].*names 1"):
        check_directions("eval/pr/nfe4/valid_pct", sweeper)
    with pytest.raises(ObjectiveError, match="names 0"):
        check_directions(None, OmegaConf.create({"direction": "maximize"}))
    check_directions(None, OmegaConf.create({"params": {"seed": "0,1"}}))  # the basic sweeper needs none


@pytest.mark.parametrize("cost", ["nfe", "nfe_p90", "tpf", "sec_per_sample"])
def test_an_adaptive_decoders_costs_are_objectives(cost):
    """Every cost the evaluation logs beside the task metric (the NFE spent, its spread, TPF, seconds) may be
    optimised: a sweep over τ that maximises accuracy and TPF is not refused before compute."""
    from types import SimpleNamespace

    from flowlm.metrics.sudoku_metric import SudokuMetric
    from flowlm.tasks.sudoku.layout import SudokuLayout
    from flowlm.tasks.sudoku.spec import SudokuSpec
    from runners.objectives import check_objectives, metric_names

    evaluation = SimpleNamespace(samplers={"threshold": None}, nfe=[64], metric_factory=SudokuMetric)
    data = SimpleNamespace(layout=SudokuLayout(SudokuSpec(2, 3), conditional=True))
    assert "accuracy" in metric_names(evaluation, data)  # the metric's names are known: the check is not skipped
    check_objectives([f"eval/threshold/nfe64/{cost}", "eval/threshold/nfe64/accuracy"], evaluation, data)
    with pytest.raises(ObjectiveError, match="not 'tokens_per_second'"):
        check_objectives(["eval/threshold/nfe64/tokens_per_second"], evaluation, data)
