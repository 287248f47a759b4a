"""`flowlm-eval` draws as the checkpoint's run did: ``seed`` left unset is the run's own, so a re-evaluated seed-3
model gives its training rows again and its MLflow run records seed 3 (with 0 fixed it drew other samples and logged
seed 0 beside the checkpoint's 3, and MLflow warned that the parameters differ from a first launch)."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

from mlflow import MlflowClient

from runners.evaluate import evaluate
from runners.train import train
from tests.conftest import FAST, compose_config

EVAL = ["eval.nfe=[1,4]", "eval.max_batches=1"]


def _rows(path: Path) -> dict[tuple[str, str], tuple[str, ...]]:
    """Per sampler and budget: what the drawn grids decide (a 2-step model solves none: % solved alone is 0 for any
    draws; the AUROC of its confidences and the share of wrong tokens are not) and the model's seed."""
    with path.open() as f:
        return {
            (r["sampler"], r["nfe_budget"]): (r["accuracy"], r["auroc"], r["wrong_pct"], r["seed"])
            for r in csv.DictReader(f)
        }


def test_flowlm_eval_draws_with_the_checkpoint_runs_seed(runs_env, monkeypatch):
    results = runs_env / "results"
    run = train(
        compose_config(
            overrides=["experiment=sudoku_mdm_easy", "scale=cpu", *FAST, "seed=3", *EVAL]
            + [f"callbacks.results_csv.dir={results}"]
        )
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        evaluate(
            compose_config(
                "eval",
                [f"ckpt_path={Path(run['run_dir']) / 'checkpoints' / 'last.ckpt'}", *EVAL, f"results_csv={results}"],
            )
        )
    assert not [w for w in caught if "parameters differ" in str(w.message)]
    (trained,) = results.rglob("sudoku_mdm_easy_seed3.csv")
    again = _rows(trained.with_name("sudoku_mdm_easy_seed3_eval.csv"))
    # the ancestral sampler draws at temperature 1: another seed gives other grids
    assert again == _rows(trained) and {row[-1] for row in again.values()} == {"3"}

    client = MlflowClient(f"sqlite:///{runs_env / 'runs' / 'mlflow.db'}")
    (evaluation,) = [
        r
        for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
        if r.data.params.get("name", "").startswith("eval/")
    ]
    assert evaluation.data.params["seed"] == "3"
    assert "flowlm.resume_changed_params" not in evaluation.data.tags

    # compile=true compiles the loaded module's DiT blocks as training's `compile: true` does (the Sudoku curve's
    # offline sampling); recorded here, not compiled (minutes on the CPU)
    import lightning_modules.sharding as sharding

    compiled = []
    monkeypatch.setattr(sharding, "compile_blocks", lambda module: compiled.append(type(module).__name__) or True)
    ckpt = Path(run["run_dir"]) / "checkpoints" / "last.ckpt"
    evaluate(compose_config("eval", [f"ckpt_path={ckpt}", *EVAL, "compile=true"]))
    assert compiled == ["MDMModule"]


def test_an_explicit_seed_is_kept():
    from omegaconf import OmegaConf

    from runners.evaluate import inherit_seed

    for given, recorded, expected in [(None, 3, 3), (None, None, 0), (5, 3, 5), (0, 3, 0)]:
        cfg = OmegaConf.create({"seed": given, "eval": {"seed": "${seed}"}})
        inherit_seed(cfg, {"config": {} if recorded is None else {"seed": recorded}})
        assert cfg.eval.seed == expected


def test_an_optuna_sweep_of_flowlm_eval_seeds_its_sampler():
    """`hydra.sweeper.sampler.seed: ${seed}` is resolved when Hydra builds the sweeper, before `inherit_seed`: with
    `flowlm-eval`'s seed null the Optuna sampler went unseeded (its proposals not reproducible). It takes 0 then, and
    a given seed otherwise."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from flowlm.project import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        for extra, expected in [([], 0), (["seed=5"], 5)]:
            cfg = compose("eval", ["ckpt_path=x.ckpt", "hparams_search=pr_optuna", *extra], return_hydra_config=True)
            assert OmegaConf.select(cfg, "hydra.sweeper.sampler.seed") == expected
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", ["hparams_search=pr_optuna", "seed=2"], return_hydra_config=True)
        assert OmegaConf.select(cfg, "hydra.sweeper.sampler.seed") == 2
