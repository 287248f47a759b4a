"""The convergence protocol (callbacks/convergence.py) on hand-made loss histories, and in two tiny training runs:
the stop, the MLflow record, the results CSV (callbacks/results_csv.py) and the budget of a run built on another."""

import csv
import json
from types import SimpleNamespace

import pytest
import torch
from conftest import FAST, compose_config, isolate_runs
from mlflow.tracking import MlflowClient

from callbacks.convergence import CONVERGENCE_FILE, Convergence, check_convergence
from callbacks.results_csv import COLUMNS
from callbacks.sampling_eval import SamplingEvaluation
from runners.train import train


def test_a_plateau_converges_and_an_improving_loss_does_not():
    plateau = [(100, 2.0), (200, 1.5), (300, 1.2), (400, 1.0), (500, 0.998)]
    verdict = check_convergence(plateau)  # window: steps > 400 → {500}; best before 1.0, in it 0.998: 0.2 % < 1 %
    assert verdict.converged
    assert verdict.best_before == 1.0 and verdict.best_window == 0.998
    assert verdict.gain == pytest.approx(0.002)
    improving = [(100, 2.0), (200, 1.5), (300, 1.2), (400, 1.0), (500, 0.98)]  # 2 % ≥ 1 %
    assert not check_convergence(improving).converged
    assert check_convergence(improving, rel_tol=0.03).converged


def test_a_loss_decaying_to_zero_converges_on_its_share_of_the_descent():
    # Window {500}: best before 0.1, in it 0.095: a relative gain of 5 % (≥ 1 %, the relative rule says "improving"),
    # but 0.005 of a descent of 2.0 − 0.095 = 1.905 since the first validation: 0.26 % < 1 % → converged.
    history = [(100, 2.0), (200, 0.5), (300, 0.2), (400, 0.1), (500, 0.095)]
    verdict = check_convergence(history)
    assert verdict.converged
    assert verdict.gain == pytest.approx(0.05) and verdict.progress == pytest.approx(0.005 / 1.905)
    assert not check_convergence(history, progress_tol=None).converged  # the relative rule alone
    assert not check_convergence([*history[:4], (500, 0.07)]).converged  # 0.03 / 1.93 = 1.55 % ≥ 1 %
    # Geometric decay towards 0 (Sudoku's losses): the relative gain per window never falls under 1 %, the share of
    # the descent does.
    decay = [(100 * k, 0.9**k) for k in range(1, 201)]
    assert not any(check_convergence(decay[:k], progress_tol=None).converged for k in range(3, 201))
    first = next(k for k in range(3, 201) if check_convergence(decay[:k]).converged)
    verdict = check_convergence(decay[:first])
    assert verdict.gain > 0.01 and verdict.progress < 0.01
    with pytest.raises(ValueError, match="progress_tol"):
        check_convergence([], progress_tol=0.0)


def test_the_window_is_the_last_fifth_of_the_steps_and_compares_bests():
    # At step 1000 the window is steps > 800: {900, 1000}. The best before it (step 800) is 1.0; the window's best
    # is 0.995 (a bump at 1000 does not hide the gain at 900): 0.5 % < 1 % → converged.
    history = [(200, 3.0), (400, 2.0), (600, 1.5), (800, 1.0), (900, 0.995), (1000, 1.3)]
    verdict = check_convergence(history)
    assert verdict.converged and verdict.best_window == 0.995
    # A lower loss in the window by ≥ 1 %, even early in it, means still improving.
    assert not check_convergence([*history[:4], (900, 0.95), (1000, 1.3)]).converged
    # A wider window (last 50 %: steps > 500) holds 600 and 800 too: 1.5 → 0.995 is a large gain.
    assert not check_convergence(history, window=0.5).converged


def test_the_tables_sweep_does_not_stop_on_an_early_plateau():
    """The easy MDM of seed 1 (the campaign, 2026-12-05; val loss every 50 steps): three validations in, its plateau
    at ≈ 1.6 met the rule (gain 0.75 %) and the sweep stopped it at step 150, 0 % solved; a rerun left it at step 200.
    The tables sweep's floor of 20 validations lets it through; a real plateau later still stops it."""
    from hydra import compose, initialize_config_dir

    from flowlm.project import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", overrides=["hparams_search=sudoku_tables", "experiment=sudoku_mdm_easy", "scale=cpu"])
    floor = cfg.callbacks.convergence.min_evals
    early = [(49, 1.982), (99, 1.611), (149, 1.599)]
    assert check_convergence(early).converged  # the rule without the floor stops it
    assert not check_convergence(early, min_evals=floor).converged
    later = [(50 * i, 2.0 / i) for i in range(1, 16)] + [(50 * i, 0.1329) for i in range(16, 21)]
    assert check_convergence(later, min_evals=floor).converged
    rerun = [(49, 1.981), (99, 1.647), (149, 1.609), (199, 1.601)]
    assert not check_convergence(rerun, min_evals=floor).converged
    assert floor * cfg.trainer.val_check_interval <= cfg.trainer.max_steps


def test_too_few_evaluations_never_converge_and_bad_settings_fail():
    assert not check_convergence([]).converged
    assert not check_convergence([(100, 1.0), (200, 1.0)]).converged  # min_evals 3
    assert check_convergence([(100, 1.0), (200, 1.0)], min_evals=2).converged
    assert not check_convergence([(100, 1.0), (200, 1.0), (250, 1.0)], window=0.9).converged  # nothing before
    with pytest.raises(ValueError, match="window"):
        check_convergence([], window=1.0)
    with pytest.raises(ValueError, match="rel_tol"):
        check_convergence([], rel_tol=0.0)


def test_a_resumed_run_keeps_its_history_and_wall_time_and_a_converged_one_stops_at_once():
    plateau = [(100, 2.0), (200, 1.5), (300, 1.2), (400, 1.0), (500, 0.998)]
    saved = Convergence(stop=True)
    saved.load_state_dict({"history": plateau, "wall_s": 42.0})
    state = saved.state_dict()
    resumed = Convergence(stop=True)
    resumed.load_state_dict(state)
    assert resumed.history == plateau and resumed.wall_s() == pytest.approx(42.0, abs=1.0)
    trainer = SimpleNamespace(should_stop=False)
    resumed.on_train_start(trainer, None)
    assert trainer.should_stop  # converged before the relaunch: no more steps
    going = Convergence(stop=True)
    going.load_state_dict({"history": plateau[:-1] + [(500, 0.5)], "wall_s": 0.0})
    going.on_train_start(trainer := SimpleNamespace(should_stop=False), None)
    assert not trainer.should_stop
    assert resumed.record()["steps"] == 500 and resumed.record()["converged"] is True


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """An MDM that converges (a lax rule) and stops at step 4 of 8, then an FMLM+ initialised from it, 2 steps;
    both tracked in MLflow and writing their results CSV."""
    root = tmp_path_factory.mktemp("convergence")
    mp = pytest.MonkeyPatch()
    isolate_runs(mp, root)
    results = root / "results"
    common = [
        *FAST,
        f"callbacks.results_csv.dir={results}",
        "eval.nfe=[1,4]",
        "eval.calibration_tokens=64",
    ]
    mdm = train(
        compose_config(
            overrides=[
                "experiment=sudoku_mdm_easy",
                "scale=cpu",
                *common,
                "trainer.max_steps=8",
                "callbacks.convergence.stop=true",
                "callbacks.convergence.min_evals=2",
                "callbacks.convergence.rel_tol=10",  # any change of < 1000 % counts as converged
            ]
        )
    )
    init = train(
        compose_config(
            overrides=[
                "experiment=sudoku_fmlm_plus_init_easy",
                "scale=cpu",
                *common,
                "eval.samplers.pr.rounds=1",
                "callbacks.convergence.min_evals=2",
            ]
        )
    )
    yield root, results, mdm, init
    mp.undo()


def read_csv(path):
    with path.open() as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
def test_a_converged_run_stops_and_records_it(two_runs):
    root, results, mdm, _ = two_runs
    assert mdm["global_step"] == 4  # converged at the second validation, before max_steps = 8
    record = json.loads((root / "runs" / "sudoku_mdm_easy" / "cpu" / "seed0" / CONVERGENCE_FILE).read_text())
    assert record["converged"] is True and record["steps"] == 4 and record["budget_steps"] == 4
    assert record["wall_s"] > 0 and record["final_val_loss"] > 0
    client = MlflowClient(tracking_uri=f"sqlite:///{root / 'runs' / 'mlflow.db'}")
    run = client.get_run(mdm["mlflow_run_id"])
    assert run.data.tags["flowlm.converged"] == "true"
    assert run.data.metrics["convergence/steps"] == 4
    assert run.data.metrics["convergence/final_val_loss"] == pytest.approx(record["final_val_loss"])


@pytest.mark.slow
def test_results_csv_rows_and_the_budget_of_an_initialised_run(two_runs):
    root, results, _, init = two_runs
    mdm_rows = read_csv(results / "sudoku_easy_6x6" / "sudoku_mdm_easy_seed0.csv")
    assert list(mdm_rows[0]) == COLUMNS
    assert {(r["sampler"], r["nfe_budget"]) for r in mdm_rows} == {
        (s, b) for s in ("ancestral", "confidence") for b in ("1", "4")
    }
    row = mdm_rows[0]
    assert (row["method"], row["variant"], row["difficulty"], row["board"]) == ("MDM", "scratch", "easy", "6x6")
    assert row["converged"] == "True" and row["steps"] == "4" and row["budget_steps"] == "4"
    assert float(row["accuracy"]) >= 0 and row["valid_pct"] == ""
    assert int(row["calibration_tokens"]) == 64
    assert row["precision"] in {"32-true", "bf16-mixed"} and row["device"].startswith("cpu: ")  # machines merge
    init_rows = read_csv(results / "sudoku_easy_6x6" / "sudoku_fmlm_plus_init_easy_seed0.csv")
    pr = next(r for r in init_rows if r["sampler"] == "pr")
    assert (pr["method"], pr["variant"], pr["confidence_kind"]) == ("FMLM+", "init", "a-posteriori")
    assert json.loads(pr["sampler_settings"])["rounds"] == 1
    # 2 own steps (not converged: one validation, nothing to compare) + the MDM's 4
    assert pr["steps"] == "2" and pr["budget_steps"] == "6" and pr["converged"] == "False"
    assert init["global_step"] == 2


def test_a_validation_that_did_not_sample_leaves_the_rows_of_the_last_evaluation(tmp_path, monkeypatch):
    """With ``eval.every_n_steps`` most validations compute only the val loss: the CSV is written at the steps that
    sampled, with that step's training facts, and not rewritten with later facts beside earlier metrics."""
    from types import SimpleNamespace

    from callbacks.results_csv import ResultsCSV

    evaluation = SamplingEvaluation.__new__(SamplingEvaluation)
    evaluation.results = [{"step": 500}]
    monkeypatch.setattr(ResultsCSV, "rows", staticmethod(lambda *a: [{"task": "t", "eval_step": 500}]))
    callback = ResultsCSV(dir=str(tmp_path))
    module = SimpleNamespace(run_config={"task": "t", "name": "m", "seed": 0}, device=torch.device("cpu"))
    path = tmp_path / "t" / "m_seed0.csv"
    for step, written in ((850, False), (500, True)):
        trainer = SimpleNamespace(
            sanity_checking=False, is_global_zero=True, callbacks=[evaluation], global_step=step, precision="32-true"
        )
        callback.on_validation_end(trainer, module)
        assert path.exists() is written, step


def test_a_sources_steps_come_from_its_record_else_its_checkpoint_and_a_hub_name_counts_none(tmp_path):
    from callbacks.convergence import source_steps

    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"global_step": 7}, ckpt)
    assert source_steps(str(ckpt)) == 7 and source_steps(None) == 0
    (tmp_path / "run" / CONVERGENCE_FILE).write_text(json.dumps({"budget_steps": 11}))
    assert source_steps(str(ckpt)) == 11  # a chain: the record's budget, its own source included
    with pytest.warns(RuntimeWarning, match="not a local checkpoint"):
        assert source_steps("kuleshov-group/mdlm-owt") == 0
