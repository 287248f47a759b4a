"""The Sudoku tables' sweep (conf/hparams_search/sudoku_tables.yaml): its budgets, its composition with the
experiments it lists, and a tiny two-job multirun that trains an MDM, then an FMLM+ from it in order, each in its
experiment's own folder, writing the results CSVs the report merges."""

import csv
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from analysis.sudoku_tables import CURVE_FAMILIES, curve_nfe, run_curve_nfe
from flowlm.project import CONF_DIR
from runners.resolvers import steps_share, sudoku_table_nfe
from tests.sweeps.test_sweeps import run_sweep

# debug=fast without its NFE list (the sweep's budgets are what the tiny sweep checks), spelled out
FAST_KEEP_NFE = [
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "eval.max_batches=1",
    "method.optim.warmup_steps=1",
    "data.num_train=24",
    "data.num_val=8",
    "data.batch_size=8",
    "data.gen_workers=1",
]


def test_the_budgets_of_the_tables():
    assert sudoku_table_nfe(True, 2, 3, "easy") == [4, 18]  # 36 cells − 18 clues
    assert sudoku_table_nfe(True, 2, 3, "hard") == [4, 23]
    # the paper's 1 / 3 / 9 / 27 / 81 as they are, and by tokens per call (⌈36 · NFE / 81⌉: 1, 2, 4, 12, 36)
    assert sudoku_table_nfe(False, 2, 3, None) == [1, 2, 3, 4, 9, 12, 27, 36]
    assert sudoku_table_nfe(False, 3, 3, None) == [1, 3, 9, 27, 81]  # the paper's budgets on 9×9
    assert sudoku_table_nfe(False, 2, 2, None) == [1, 2, 3, 6, 9, 16]
    # an MDM also at one call per generated position (cells + separators): the paper's MDLM @128 on 89 positions
    assert sudoku_table_nfe(True, 2, 3, "easy", "mdm") == [4, 18, 41]
    assert sudoku_table_nfe(True, 3, 3, "easy", "mdm") == [4, 41, 89]
    assert sudoku_table_nfe(True, 2, 3, "easy", "fmlm") == [4, 18]
    assert sudoku_table_nfe(False, 2, 3, None, "mdm") == [1, 2, 3, 4, 9, 12, 27, 36]  # n² calls: one cell each


def test_the_warm_up_is_the_released_share_of_the_budget():
    assert steps_share(20_000, 0.125) == 2_500  # scripts/train/sudoku.sh: 2 500 of 20 000 steps
    assert steps_share(6_000, 0.125) == 750
    assert steps_share(1_000, 0.3) == 300 and steps_share(7, 0.5) == 4  # any share, rounded
    with pytest.raises(ValueError, match="share"):
        steps_share(6_000, 1.5)


def _compose(overrides, hydra: bool = False):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=hydra)


def _family(name: str) -> str:
    return next(k for k in ("mdm", "mlfm", "fmlm") if f"_{k}" in name)


def _task(name: str) -> str:
    return next(t for t in ("easy", "medium", "hard", "uncond") if f"_{t}" in name)


def check_job(name: str, job, experiments: list[str], i: int, nfe_of) -> None:
    """One job of the sweep: the protocol's settings, the tables' samplers and budgets, its MDM trained earlier."""
    samplers = {"mdm": {"ancestral", "confidence"}, "fmlm": {"pr", "a_priori"}}
    samplers["mlfm"] = {"mlfm", "mlfm_ccfg", "mlfm_ccfg_otp"}
    OmegaConf.resolve(job)
    # the fixed-budget protocol: the released optimizer and schedule, no early stop, a checkpoint every eighth
    assert job.trainer.max_steps == job.budget == 20000 and job.callbacks.convergence.stop is False, name
    assert job.method.optim.lr == 3e-4 and job.method.optim.warmup_steps == 2500, name  # the released 2 500
    assert job.method.optim.weight_decay == 0.0 and list(job.method.optim.betas) == [0.9, 0.999], name
    assert (job.callbacks.ema.decay, job.callbacks.ema.warmup) == (0.9999, True), name
    assert job.trainer.precision == "bf16-mixed" and job.trainer.gradient_clip_val == 1.0, name
    curve = job.callbacks.curve
    assert (curve.every_n_train_steps, curve.save_top_k, curve.save_last) == (2500, -1, False), name
    assert curve.dirpath == job.callbacks.checkpoint.dirpath and curve.filename.startswith("curve-"), name
    assert job.data.num_val == 2000 and job.eval.max_batches is None, name
    assert job.callbacks.results_csv.dir.endswith("sudoku") and job.sweep.run_dirs == "experiment", name
    assert (job.data.box_rows, job.data.box_cols) == (2, 3), name
    assert set(job.eval.samplers) == samplers[_family(name)], name
    assert list(job.eval.nfe) == nfe_of(job.data.conditional, 2, 3, job.data.difficulty, _family(name)), name
    # the run evaluates its final weights at every budget its curves are drawn at (scripts/sudoku_curve.sh samples the
    # earlier checkpoints there): each curve ends in the run's own rows
    assert job.family in (*CURVE_FAMILIES, "mlfm"), name  # MLFM: no curve in the report
    if job.family in CURVE_FAMILIES:
        drawn = sorted(curve_nfe("6x6", _task(name))[CURVE_FAMILIES[job.family]])
        assert run_curve_nfe(OmegaConf.to_container(job)) == drawn, name
    source = job.method.get("init_from") or job.method.get("teacher")
    if source:  # the MDM it is built on trains earlier in the sweep, in the folder the path names
        mdm = next(e for e in experiments if _family(e) == "mdm" and _task(e) == _task(name))
        assert experiments.index(mdm) < i, name
        assert Path(source) == Path(job.paths.root) / mdm / "cpu" / "seed0" / "checkpoints" / "last.ckpt", name


def test_every_listed_experiment_composes_with_the_protocol(runs_env):
    cfg = _compose(["hparams_search=sudoku_tables"], hydra=True)
    experiments = [e.strip() for e in cfg.hydra.sweeper.params.experiment.split(",")]
    assert len(experiments) == 19 and cfg.hydra.sweeper.params.scale == "cpu"  # no MLFM on unconditional boards
    for i, name in enumerate(experiments):
        job = _compose(["hparams_search=sudoku_tables", f"experiment={name}", "scale=cpu", "seed=0"])
        check_job(name, job, experiments, i, sudoku_table_nfe)


def test_the_job_check_fails_for_a_run_listed_before_its_mdm(runs_env):
    experiments = ["sudoku_mdm_easy", "sudoku_fmlm_plus_init_easy"]
    with pytest.raises(AssertionError):  # built on an MDM that would train after it
        job = _compose(["hparams_search=sudoku_tables", f"experiment={experiments[1]}", "scale=cpu"])
        check_job(experiments[1], job, experiments[::-1], 0, sudoku_table_nfe)


@pytest.mark.slow
def test_a_tiny_tables_sweep_trains_in_order_and_writes_the_csvs(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWLM_RESULTS", str(tmp_path / "results"))
    run_sweep(
        "train",
        [
            "hparams_search=sudoku_tables_quick",
            "experiment=sudoku_mdm_easy,sudoku_fmlm_plus_init_easy",
            "compile=false",  # compiling costs ≈ 20 s a model; this tests the order and the CSVs
            "budget=16",  # the warm-up (2 steps) and the curve's checkpoints (every 2) follow it
            *(o for o in FAST_KEEP_NFE if not o.startswith(("trainer.max_steps", "method.optim.warmup"))),
        ],
        tmp_path,
    )
    runs = tmp_path / "runs"
    checkpoints = runs / "sudoku_mdm_easy" / "cpu" / "seed0" / "checkpoints"
    assert (checkpoints / "last.ckpt").exists()
    curve = sorted(p.name for p in checkpoints.glob("curve-*.ckpt"))
    assert curve == [f"curve-step{s:07d}.ckpt" for s in range(2, 17, 2)]
    files = sorted((tmp_path / "results" / "sudoku" / "sudoku_easy_6x6").glob("*.csv"))
    assert [f.name for f in files] == ["sudoku_fmlm_plus_init_easy_seed0.csv", "sudoku_mdm_easy_seed0.csv"]
    with files[0].open() as f:
        rows = list(csv.DictReader(f))
    assert {(r["sampler"], r["nfe_budget"]) for r in rows} == {(s, b) for s in ("pr", "a_priori") for b in ("4", "18")}
    assert {r["budget_steps"] for r in rows} == {"32"}  # its 16 steps + the MDM's 16


def test_a_budget_a_sampler_refuses_is_skipped_only_when_asked():
    from callbacks.sampling_eval import SamplingEvaluation
    from flowlm.samplers import MLFMSampler

    samplers = {"mlfm": MLFMSampler(), "mlfm_ccfg": MLFMSampler(guidance=2.0)}  # CCFG: 2 NFE per step
    with pytest.raises(ValueError, match="below one step"):
        SamplingEvaluation(samplers=samplers, nfe=[1, 3], metric=lambda **_: None)
    evaluation = SamplingEvaluation(samplers=samplers, nfe=[1, 3], metric=lambda **_: None, skip_unfit_budgets=True)
    assert list(evaluation.skipped) == [("mlfm_ccfg", 1)]
