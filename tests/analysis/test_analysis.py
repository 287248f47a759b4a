"""Analysis: a small MLflow store made here → long-format data, tables equal to what was logged, every figure."""

from pathlib import Path

import matplotlib.image as mpimg
import numpy as np
import pandas as pd
import pytest
import torch
from conftest import FAST, compose_config, isolate_runs
from mlflow.entities import Metric, Param
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from analysis import NoRunsError, build_report, eval_table, load_runs, log_report, long_metrics
from analysis.tables import fmt
from callbacks.sampling_eval import CalibrationBuffer, save_calibration
from flowlm.metrics.calibration import auroc, roc_curve
from flowlm.samplers import AncestralSampler, ConfidenceSampler, PosteriorRefinementSampler

UNCOND, COND, SWEEP = "sudoku_uncond_6x6", "sudoku_hard_6x6", "pr_sweep"
BUDGETS = (1, 3, 9)
SAMPLERS = {
    "mdm": {"ancestral": AncestralSampler(), "confidence": ConfidenceSampler()},
    "fmlm_plus": {"pr": PosteriorRefinementSampler(), "a_priori": PosteriorRefinementSampler(confidence="a_priori")},
}
MODULES = {"mdm": "lightning_modules.mdm.MDMModule", "fmlm_plus": "lightning_modules.fmlm_plus.FMLMPlusModule"}
SUDOKU = {"data/_target_": "datamodules.sudoku.SudokuDataModule", "data/box_rows": "2", "data/box_cols": "3"}


def _valid_pct(name: str, sampler: str, budget: int, seed: int) -> float:
    # Deterministic, not round: formatting and averaging are exercised, and the curves rise with NFE.
    return min(100.0, 7.3 * budget + 3.1 * len(sampler) + 1.37 * seed + (11.9 if name == "fmlm_plus" else 0.0))


def _calibration(path: Path, name: str, seed: int) -> Path:
    """Synthetic (confidence, correct) pairs: PR's confidence separates right from wrong tokens, a-priori less so."""
    rng = np.random.default_rng(seed)
    buffers = {}
    for sampler in SAMPLERS[name]:
        for budget in BUDGETS:
            correct = torch.from_numpy(rng.random((8, 36)) < 0.3 + 0.2 * np.log(budget))
            sharp = 3.0 if sampler == "pr" else 0.7
            conf = torch.sigmoid(sharp * (correct.float() - 0.5) + torch.from_numpy(rng.normal(size=(8, 36))))
            buffer = CalibrationBuffer(cap=200)
            buffer.add(conf, correct, torch.ones_like(correct))
            buffers[sampler, budget] = buffer
    return save_calibration(path, buffers, SAMPLERS[name])


def _run(client: MlflowClient, exp_id: str, name: str, params: dict, metrics: dict, tags: dict | None = None) -> str:
    run = client.create_run(exp_id, run_name=name, tags={"flowlm.name": name, **(tags or {})})
    client.log_batch(
        run.info.run_id,
        metrics=[Metric(key, value, 0, 10) for key, value in metrics.items()],
        params=[Param(key, str(value)) for key, value in params.items()],
    )
    return run.info.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """An MLflow store as the suite writes it: an unconditional task (2 methods × 2 seeds, calibration artifacts),
    a conditional task with no calibration, and a sampling sweep over PR threshold × rounds."""
    root = tmp_path_factory.mktemp("store")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    logged = {}
    exp = client.create_experiment(UNCOND, artifact_location=str(root / "art" / UNCOND))
    for name in ("mdm", "fmlm_plus"):
        for seed in (0, 1):
            metrics = {}
            for sampler in SAMPLERS[name]:
                for budget in BUDGETS:
                    value = _valid_pct(name, sampler, budget, seed)
                    logged[name, sampler, budget, seed] = value
                    prefix = f"eval/{sampler}/nfe{budget}"
                    metrics |= {f"{prefix}/valid_pct": value, f"{prefix}/nfe": float(budget)}
                    metrics |= {f"{prefix}/sec_per_sample": 1e-3 * budget, f"{prefix}/distinct_valid": 5.0 + seed}
            params = {"seed": seed, "method/_target_": MODULES[name], "data/conditional": "False", **SUDOKU}
            run_id = _run(client, exp, name, params, {**metrics, "train/loss": 1.0})
            client.log_artifact(run_id, str(_calibration(root / "calibration.npz", name, seed)), "eval/step0000010")
    exp = client.create_experiment(COND, artifact_location=str(root / "art" / COND))
    params = {"seed": 0, "method/_target_": MODULES["fmlm_plus"], "data/conditional": "True", "data/difficulty": "hard"}
    _run(client, exp, "fmlm_plus_hard", {**params, **SUDOKU}, {"eval/pr/nfe4/accuracy": 61.25, "eval/pr/nfe4/nfe": 4.0})
    exp = client.create_experiment(SWEEP, artifact_location=str(root / "art" / SWEEP))
    grid = {}
    for i, (threshold, rounds) in enumerate([(t, r) for t in (0.9, 0.99, 0.999) for r in (2, 4)]):
        for seed in (0, 1):
            value = 10 * rounds + 100 * threshold + seed
            grid.setdefault((threshold, rounds), []).append(value)
            params = {
                "seed": seed,
                "eval/samplers/pr/threshold": threshold,
                "samplers/pr/threshold": threshold,  # a module's own copy of the same hyper-parameter
                "trial/eval.samplers.pr.rounds": rounds,  # the sweep trial's override of it
                "eval/samplers/pr/rounds": rounds,
                "trainer/default_root_dir": f"/runs/trial{i}/seed{seed}",
            }
            metrics = {"eval/pr/nfe4/valid_pct": value, "eval/pr/nfe4/nfe": 4.0}
            _run(client, exp, f"trial{i}", params, metrics, {"flowlm.sweep": "grid", "flowlm.trial": str(i)})
    return {"uri": uri, "root": root, "logged": logged, "grid": grid}


@pytest.fixture(scope="module")
def report(store, tmp_path_factory):
    """The report over every experiment of the store."""
    return build_report(store["uri"], tmp_path_factory.mktemp("report"))


def test_long_format_one_row_per_run_sampler_budget_metric(store):
    runs = load_runs(store["uri"], experiments=[UNCOND])
    assert len(runs) == 4 and sorted(runs["seed"]) == [0, 0, 1, 1]
    assert set(runs["method"]) == {"MDMModule", "FMLMPlusModule"}
    long = long_metrics(runs)
    assert len(long) == 4 * 2 * len(BUDGETS) * 4  # runs × samplers × budgets × metrics
    assert set(long["metric"]) == {"valid_pct", "nfe", "sec_per_sample", "distinct_valid"}
    hit = long[(long["name"] == "fmlm_plus") & (long["sampler"] == "pr") & (long["nfe_budget"] == 3)]
    hit = hit[(hit["metric"] == "valid_pct") & (hit["seed"] == 1)]
    assert hit["value"].tolist() == [store["logged"]["fmlm_plus", "pr", 3, 1]]
    table = eval_table(long)
    assert len(table) == 4 * 2 * len(BUDGETS) and "train/loss" not in table
    sweep = load_runs(store["uri"], tags={"flowlm.sweep": "grid"})
    assert set(sweep["experiment"]) == {SWEEP} and len(sweep) == 12


def test_tables_equal_the_logged_numbers(store, report):
    logged = store["logged"]
    results = pd.read_csv(report.out / f"results_{UNCOND}.csv")
    assert len(results) == 2 * 2 * len(BUDGETS)
    for row in results.itertuples():
        values = [logged[row.name, row.sampler, row.nfe_budget, seed] for seed in (0, 1)]
        assert row.mean == pytest.approx(np.mean(values), abs=1e-12)
        assert row.std == pytest.approx(np.std(values, ddof=1), abs=1e-12)
        assert row.n == 2 and row.nfe == row.nfe_budget
    table = report.tables[f"results/{UNCOND}"].set_index(["run", "sampler"])
    values = [logged["mdm", "confidence", 9, seed] for seed in (0, 1)]
    assert table.loc[("mdm", "confidence"), "NFE 9"] == f"{np.mean(values):.1f} ± {np.std(values, ddof=1):.1f}"
    markdown = report.markdown.read_text()
    assert f"| mdm | confidence | 2 | {table.loc[('mdm', 'confidence'), 'NFE 1']} |" in markdown


def test_papers_tables_sit_beside_the_measured_rows(store, report):
    paper = report.tables[f"paper/{UNCOND}"]
    pr = paper[paper["sampler"] == "pr"].set_index("source")
    assert pr.loc["paper, 9×9", "NFE 3"] == "22.2" and pr.loc["paper, 9×9", "NFE 81"] == "99.6"
    mine = [store["logged"]["fmlm_plus", "pr", 9, seed] for seed in (0, 1)]
    assert pr.loc["measured, 6×6", "NFE 9"] == fmt(np.mean(mine), np.std(mine, ddof=1), 2)
    assert pr.loc["measured, 6×6", "NFE 81"] == ""  # not measured: no value is made up
    hard = report.tables[f"paper/{COND}"].set_index(["source", "sampler"])
    assert hard.loc[("paper, 9×9", "pr"), "NFE 4"] == "71.2"
    assert hard.loc[("measured, 6×6", "pr"), "NFE 4"] == "61.2"  # 61.25 to one decimal (round half to even)
    assert "(not in flowlm)" in set(hard.index.get_level_values("sampler"))  # Duo: paper only


def test_calibration_auroc_from_the_logged_tokens(store, report):
    table = report.tables[f"calibration/{UNCOND}"].set_index(["run", "sampler"])
    assert table.loc[("fmlm_plus", "pr"), "confidence"] == "a-posteriori"
    assert table.loc[("mdm", "confidence"), "confidence"] == "a-priori"
    with (
        np.load(_calibration(store["root"] / "check.npz", "fmlm_plus", 0)) as a,
        np.load(_calibration(store["root"] / "check1.npz", "fmlm_plus", 1)) as b,
    ):
        pick = lambda d: d["group"] == list(zip(d["samplers"], d["budgets"], strict=True)).index(("pr", 3))
        conf = np.concatenate([a["confidence"][pick(a)], b["confidence"][pick(b)]])
        ok = np.concatenate([a["correct"][pick(a)], b["correct"][pick(b)]])
    assert table.loc[("fmlm_plus", "pr"), "NFE 3"].startswith(f"{auroc(conf, ok):.3f} (")
    scored = pd.read_csv(report.out / f"calibration_{UNCOND}.csv")
    pr, prior = (scored[scored["sampler"] == s]["auroc"].mean() for s in ("pr", "a_priori"))
    assert pr > prior > 0.5  # the synthetic a-posteriori confidence is the sharper one


def test_sweep_heatmap_pivots_the_two_swept_params(store, report):
    grid = report.tables[f"heatmap/{SWEEP}/grid/pr"].set_index("eval/samplers/pr/rounds \\ eval/samplers/pr/threshold")
    assert list(grid.columns) == ["0.9", "0.99", "0.999"] and list(grid.index) == ["2", "4"]
    for (threshold, rounds), values in store["grid"].items():
        assert grid.loc[str(rounds), str(threshold)] == f"{np.mean(values):.1f}"
    assert not any(key.startswith(f"heatmap/{UNCOND}") for key in report.tables)  # methods differ in many params
    lines = report.tables[f"results/{SWEEP}"]  # one line per trial, named by its swept values; seeds pooled
    assert len(lines) == 6 and (lines["runs"] == 2).all()
    assert "trial0 (rounds=2, threshold=0.9)" in set(lines["run"])


def test_every_figure_renders(report):
    names = {p.name for p in report.figures}
    assert names == {
        f"speed_quality_{UNCOND}.png",
        f"speed_quality_{COND}.png",
        f"speed_quality_{SWEEP}.png",
        f"calibration_{UNCOND}.png",
        f"heatmap_{SWEEP}_grid_pr.png",
    }
    for path in report.figures:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
        image = mpimg.imread(path)
        assert min(image.shape[:2]) > 300 and image[..., :3].std() > 0.05  # drawn, not blank
    assert report.main_figure.name == f"speed_quality_{UNCOND}.png"
    html = report.html.read_text()
    assert html.count("data:image/png;base64,") == len(report.figures)  # self-contained
    for path in report.figures:
        assert f"]({path.name})" in report.markdown.read_text()


def test_report_is_logged_back_to_mlflow(store, report, tmp_path):
    run_id = log_report(report, store["uri"], artifact_location=str(tmp_path / "art"), name="report/test")
    client = MlflowClient(tracking_uri=store["uri"])
    run = client.get_run(run_id)
    assert run.data.tags["flowlm.kind"] == "report"
    # the reports experiment is a model-training one for MLflow's UI (flowlm/experiment_kind.py)
    assert client.get_experiment_by_name("reports").tags["mlflow.experimentKind"] == "custom_model_development"
    assert run.data.tags["flowlm.report.experiments"] == ",".join(sorted([COND, SWEEP, UNCOND]))
    files = {f.path for f in client.list_artifacts(run_id, "report")}
    assert {"report/report.md", "report/report.html", f"report/speed_quality_{UNCOND}.png"} <= files
    assert "reports" not in set(load_runs(store["uri"], exclude_experiments=["reports"])["experiment"])


def test_bad_input_fails_with_a_clear_error(store, tmp_path):
    with pytest.raises(NoRunsError, match=r"unknown MLflow experiment\(s\) \['nope'\].*holds: \["):
        build_report(store["uri"], tmp_path, experiments=["nope"])
    with pytest.raises(NoRunsError, match="no runs .* match tags"):
        build_report(store["uri"], tmp_path, tags={"flowlm.sweep": "missing"})
    client = MlflowClient(tracking_uri=store["uri"])
    client.create_run(client.create_experiment("empty_eval"), run_name="x")
    with pytest.raises(NoRunsError, match="none of the 1 runs logged eval/"):
        build_report(store["uri"], tmp_path, experiments=["empty_eval"])
    with pytest.raises(ValueError, match="logged no 'accuracy'"):
        build_report(store["uri"], tmp_path, experiments=[UNCOND], metric="accuracy")
    with pytest.raises(ValueError, match=r"unknown reference task\(s\) \{'x': 'sudoku_nope'\}"):
        build_report(store["uri"], tmp_path, reference={"x": "sudoku_nope"})
    with pytest.raises(ValueError, match="exactly two params"):
        build_report(store["uri"], tmp_path, experiments=[SWEEP], heatmap_params=["eval.samplers.pr.threshold"])


def test_auroc_and_roc_by_hand():
    ok = np.array([True, True, False, False])
    assert auroc(np.array([0.9, 0.8, 0.2, 0.1]), ok) == 1.0
    assert auroc(np.array([0.1, 0.2, 0.8, 0.9]), ok) == 0.0
    assert auroc(np.full(4, 0.5), ok) == 0.5  # ties count one half
    assert np.isnan(auroc(np.array([0.3, 0.4]), np.array([True, True])))
    fpr, tpr = roc_curve(np.array([0.9, 0.5, 0.5, 0.1]), np.array([True, True, False, False]))
    assert fpr.tolist() == [0.0, 0.0, 0.5, 1.0] and tpr.tolist() == [0.0, 0.5, 1.0, 1.0]
    rng = np.random.default_rng(0)
    conf, ok = np.round(rng.random(300), 2), rng.random(300) < 0.6
    fpr, tpr = roc_curve(conf, ok)
    assert auroc(conf, ok) == pytest.approx(np.trapezoid(tpr, fpr), abs=1e-12)


def test_cli_config_builds_and_logs_the_report(store, tmp_path):
    from runners.report import report

    out = tmp_path / "cli"
    cfg = compose_config(
        "report",
        overrides=[f"tracking_uri={store['uri']}", f"out={out}", f"experiments=[{UNCOND}]", f"paths.root={tmp_path}"],
    )
    built, run_id = report(cfg)
    assert built.markdown == out / "report.md" and built.markdown.exists()
    client = MlflowClient(tracking_uri=store["uri"])
    assert client.get_run(run_id).data.tags["flowlm.name"] == "report/latest"
    assert "report/report.html" in {f.path for f in client.list_artifacts(run_id, "report")}


def test_demo_ends_with_the_report_of_its_experiments(store, tmp_path):
    from hydra import compose, initialize_config_dir

    from flowlm.project import CONF_DIR
    from runners.demo import demo_report

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        run_cfgs = [
            compose("train", overrides=[f"experiment={e}", "scale=cpu"]) for e in ("demo_mdm", "demo_fmlm_plus")
        ]
        for cfg in run_cfgs:  # as train() leaves them: resolved, tracked in the store made above
            OmegaConf.update(cfg, "paths.root", str(tmp_path))
            OmegaConf.update(cfg, "task", UNCOND)
            OmegaConf.update(cfg, "logger.tracking_uri", store["uri"])
        built = demo_report(run_cfgs, ["run_name=demo", "log_to_mlflow=false"])
    assert built.out == tmp_path / "report" / "demo"
    assert set(built.runs["experiment"]) == {UNCOND} and built.main_figure.exists()


def test_a_real_evaluation_logs_calibration_the_report_reads(tmp_path, monkeypatch):
    from runners.train import train

    isolate_runs(monkeypatch, tmp_path)
    for experiment in ("sudoku_mdm_uncond", "sudoku_fmlm_plus_scratch_uncond"):
        train(compose_config(overrides=[f"experiment={experiment}", "scale=cpu", *FAST, "eval.calibration_tokens=50"]))
    uri = f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}"
    built = build_report(uri, tmp_path / "report", experiments=[UNCOND])
    table = built.tables[f"calibration/{UNCOND}"]
    assert set(zip(table["sampler"], table["confidence"], strict=True)) == {
        ("ancestral", "a-priori"),
        ("confidence", "a-priori"),
        ("pr", "a-posteriori"),
        ("a_priori", "a-priori"),
    }
    scored = pd.read_csv(built.out / f"calibration_{UNCOND}.csv")
    assert (scored["tokens"] == 50).all()  # the cap, from 8 grids × 36 cells
    assert (built.out / f"calibration_{UNCOND}.png").stat().st_size > 10_000


def test_the_demo_verdict_compares_best_samplers_where_the_later_run_leads_most_and_at_full_budget():
    from runners.demo import verdict

    table = {  # (run, sampler): values at NFE 3, 6, 36
        ("mdm", "ancestral"): (0.0, 0.0, 2.0),
        ("mdm", "confidence"): (0.0, 1.0, 28.1),
        ("flow", "pr"): (0.2, 8.4, 28.9),
        ("flow", "a_priori"): (0.0, 0.2, 35.2),
    }
    rows = [
        {"run": run, "sampler": sampler, "nfe_budget": b, "valid_pct": v}
        for (run, sampler), values in table.items()
        for b, v in zip((3, 6, 36), values, strict=True)
    ]
    line = verdict(rows, "valid_pct", [("mdm", 1000, False), ("flow", 300, None)], "6×6 unconditional Sudoku")
    assert "at NFE 6, flow (pr) 8.4 against mdm (confidence) 1.0" in line  # the largest lead: 7.4 points
    assert "at NFE 36, flow (a_priori) 35.2 against mdm (confidence) 28.1" in line
    assert "mdm 1000 steps, not converged by the suite's rule; flow 300 steps" in line
    assert verdict(rows[:6], "valid_pct", [], "") == ""  # one run: nothing to compare
