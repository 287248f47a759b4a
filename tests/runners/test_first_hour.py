"""The first hour (issue 39, round three): `--help` and `--cfg job` answer without Lightning or torch, a run names
its folder and MLflow run at its start and end, the libraries' notices that are not the user's concern are silenced
(precisely), a sweep ends with one summary line, evaluations are named after their checkpoint and the report does not
pool settings that share a name, and an `init_from` of another size is advised its size (docs/reliability.md)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Metric, Param
from omegaconf import OmegaConf

from analysis import build_report, load_runs
from analysis.load import eval_table, long_metrics, summarize
from lightning_modules.checkpoints import check_backbone_options, read_checkpoint_meta
from runners.console import quiet_library_notices, share_group_listing, shows_only
from runners.evaluate import evaluate, name_after_checkpoint
from runners.resolvers import cpu_precision, query_machine
from runners.train import train
from sweeps.multirun import summary_line
from tests.conftest import FAST, compose_config, isolate_runs
from tests.process_helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RUN = ["experiment=sudoku_mdm_uncond", "scale=cpu", *FAST, "eval.nfe=[2]"]  # 6×6 unconditional, 2 steps
# What the libraries printed in a first run that is not the user's concern (each line of the issue).
NOISE = ("💡 Tip", "litmodels", "litlogger", "LeafSpec", "FutureWarning", "has been deprecated", "converted to")


@pytest.fixture(scope="module")
def step2_ckpt(tmp_path_factory) -> Path:
    """last.ckpt of a 2-step untracked run (its own runs folder)."""
    root = tmp_path_factory.mktemp("trained")
    with pytest.MonkeyPatch.context() as mp:
        isolate_runs(mp, root)
        result = train(compose_config(overrides=[*RUN, "logger=none"]))
    return Path(result["run_dir"]) / "checkpoints" / "last.ckpt"


def _fresh(code: str, *args: str, root: Path) -> subprocess.CompletedProcess:
    """``code`` in a new interpreter (this checkout on the path, runs and data under ``root``)."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=subprocess_env(root),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


# ------------------------------------------------------------------ 1. --help, --cfg job, --info: no Lightning
HEAVY = ("lightning", "torch", "mlflow", "matplotlib")
IMPORTS = "import sys\nfor name in sys.argv[1:]: __import__(name)\nprint(sorted(set(sys.modules) & set({heavy})))"


def test_the_entry_modules_import_neither_lightning_nor_torch(tmp_path):
    modules = ["runners.train", "runners.evaluate", "runners.report", "runners.demo", "runners.export"]
    out = _fresh(IMPORTS.format(heavy=HEAVY), *modules, root=tmp_path).stdout
    assert out.strip() == "[]", out  # was: lightning and torch (~6 s of a 12 s `flowlm-train --help`)


SHOW = """
import contextlib, io, json, sys
from hydra.core.global_hydra import GlobalHydra
module = __import__(sys.argv[1], fromlist=["main"])
shown = {}
for flags in (["--help"], ["--cfg", "job"], ["--info"]):
    sys.argv = [sys.argv[0], *flags]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            module.main()
        except SystemExit as stop:
            assert not stop.code, (flags, stop.code)
    GlobalHydra.instance().clear()
    shown[" ".join(flags)] = out.getvalue()
print(json.dumps({"shown": shown, "heavy": sorted(set(sys.modules) & set(%r))}))
"""


@pytest.mark.parametrize("module", ["runners.train", "runners.evaluate", "runners.report", "runners.demo"])
def test_help_cfg_and_info_answer_without_lightning_or_torch(module, tmp_path):
    result = json.loads(_fresh(SHOW % (HEAVY,), module, root=tmp_path).stdout.splitlines()[-1])
    assert result["heavy"] == [], result["heavy"]
    assert "Powered by Hydra" in result["shown"]["--help"] and result["shown"]["--cfg job"].strip()
    assert "Config search path" in result["shown"]["--info"]
    if module == "runners.train":  # the CPU's precision is shown as written, not the stand-in of a shown config
        assert "bf16-mixed or 32-true" not in json.dumps(result["shown"])


def test_a_config_composed_without_the_machine_query_resolves_it_when_read():
    assert shows_only(["--help"]) and shows_only(["--cfg", "job"]) and shows_only(["-i"])
    assert not shows_only(["--cfg", "job", "--resolve"]) and not shows_only(["experiment=x", "-m"])
    previous = query_machine(False)  # what `flowlm-train --help` composes with
    try:
        cfg = compose_config(overrides=["experiment=sudoku_mdm_uncond", "scale=cpu"])
    finally:
        query_machine(previous)
    precision = cfg.trainer.precision  # the interpolation is kept: asked when a run reads it
    assert precision == cpu_precision() and precision in ("bf16-mixed", "32-true")


def test_help_lists_the_same_config_groups_from_one_copy_of_the_repository(monkeypatch):
    from hydra import initialize_config_dir
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra._internal.config_repository import CachingConfigRepository
    from hydra.core.global_hydra import GlobalHydra

    from flowlm.project import CONF_DIR

    copies = []
    made = CachingConfigRepository.__init__
    monkeypatch.setattr(CachingConfigRepository, "__init__", lambda self, d: copies.append(1) or made(self, d))
    monkeypatch.setattr(ConfigLoaderImpl, "get_group_options", ConfigLoaderImpl.get_group_options)  # restored
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        hydra = GlobalHydra.instance().hydra
        hydra_own = hydra.format_config_groups(lambda group: True)
        assert len(copies) > 100  # Hydra 1.3: a deep copy of the repository per listing (3.5 s of --help)
        copies.clear()
        share_group_listing()  # what `flowlm-train --help` does first
        shared = GlobalHydra.instance().hydra.format_config_groups(lambda group: True)
    assert shared == hydra_own and "scale/tinystories: cpu, paper" in shared
    assert len(copies) == 1


# ------------------------------------------------------------------ 2 + 3. a training names its run, quietly
def _mlflow_runs(root: Path) -> list:
    client = MlflowClient(f"sqlite:///{root / 'runs' / 'mlflow.db'}")
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def _run_ok(cmd: list[str], root: Path) -> tuple[subprocess.CompletedProcess, str]:
    """Run a console script under ``root`` (``subprocess_env``), asserting it succeeded; it and its whole output."""
    proc = subprocess.run(cmd, cwd=root, env=subprocess_env(root), capture_output=True, text=True, timeout=600)
    out = f"{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == 0, out[-4000:]
    return proc, out


@pytest.mark.slow
def test_flowlm_train_names_its_folder_and_mlflow_run_and_prints_no_library_notices(tmp_path):
    proc, out = _run_ok([str(BIN / "flowlm-train"), *RUN], tmp_path)
    (run,) = _mlflow_runs(tmp_path)
    runs = (tmp_path / "runs").resolve()
    folder = f"run folder: {runs / 'sudoku_mdm_uncond' / 'cpu' / 'seed0'}"
    tracked = f"MLflow run: {run.info.run_id} (sqlite:///{runs / 'mlflow.db'})"
    lines = proc.stdout.splitlines()
    assert lines.count(folder) == 2 and lines.count(tracked) == 2, proc.stdout[-4000:]
    table = lines.index("| run | sampler | NFE 2 |")  # the results, printed at the end of the run
    assert lines.index(folder) < table < len(lines) - 1 - lines[::-1].index(folder)  # at the start and at the end
    for noise in NOISE:
        assert noise not in out, f"{noise!r} in the output:\n{out[-4000:]}"
    assert "GPU available: False" in out and out.count("GPU available") == 1  # Lightning's own lines, once each


# ------------------------------------------------------------------ 3. each notice, silenced where it is raised
def test_each_library_notice_is_silenced_at_its_source_and_other_warnings_are_not():
    import lightning as L
    import optuna
    from hydra.utils import instantiate
    from hydra_plugins.hydra_optuna_sweeper._impl import create_params_from_overrides
    from hydra_plugins.hydra_optuna_sweeper.config import TPESamplerConfig
    from lightning.pytorch.utilities._pytree import _tree_flatten

    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    tips = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # where Lightning's rank-zero lines go
    level = tips.level
    tips.addHandler(handler)
    tips.setLevel(logging.INFO)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # nothing else hides them (pytest ignores FutureWarning by default)
            quiet_library_notices()
            L.Trainer(logger=False, accelerator="cpu", enable_progress_bar=False)  # the LitLogger tip
            _tree_flatten(1)  # Lightning builds torch's deprecated LeafSpec
            space, _ = create_params_from_overrides(["x=interval(0.0, 1.0)", "n=int(interval(1, 4))"])
            trial = optuna.create_study().ask()
            for name, distribution in space.items():
                trial._suggest(name, distribution)  # converted to FloatDistribution / IntDistribution
            optuna.distributions.json_to_distribution(  # a trial's distribution read back from the study
                '{"name": "UniformDistribution", "attributes": {"low": 0.0, "high": 1.0}}'
            )
            instantiate(OmegaConf.structured(TPESamplerConfig()))  # the sweeper passes every TPE argument
            # still shown: the same message from another module, another message from the same module
            warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, "mine.py", 1)
            warnings.warn_explicit("another notice", FutureWarning, "d.py", 1, module="optuna.distributions")
    finally:
        tips.removeHandler(handler)
        tips.setLevel(level)
    shown = [str(w.message) for w in caught]
    assert shown == ["`isinstance(treespec, LeafSpec)` is deprecated", "another notice"], shown
    logged = [r.getMessage() for r in records]
    assert any(m.startswith("GPU available") for m in logged), logged  # Lightning's other lines stay
    assert not [m for m in logged if "Tip" in m], logged


# ------------------------------------------------------------------ 4. a sweep's summary line
def _sweep(root: Path, **extra) -> object:
    return OmegaConf.create({"sweep": {"name": "s"}, "hydra": {"sweep": {"dir": str(root)}}, **extra})


def test_the_summary_names_the_folder_the_trials_and_the_best_value(tmp_path):
    done = {
        "trial-b": {"trial": 1, "values": [80.0, 4.0]},
        "trial-a": {"trial": 0, "values": [80.0, 2.0]},  # ties: the first trial is the best, as in Optuna
        "trial-c": {"trial": 2, "values": [55.5, 1.0]},
    }
    failed = {"trial-d": "ValueError: bad"}
    head = f"sweep s ({tmp_path.resolve()}): 4 trials, 3 done, 1 failed"
    assert summary_line(_sweep(tmp_path), done, failed) == head  # no objective
    one = _sweep(tmp_path, optimized_metric="eval/pr/nfe4/accuracy", hydra={"sweeper": {"direction": "maximize"}})
    one.hydra.sweep = {"dir": str(tmp_path)}
    single = {k: {**v, "values": v["values"][:1]} for k, v in done.items()}
    assert summary_line(one, single, failed) == f"{head}; best eval/pr/nfe4/accuracy = 80 (trial 0, trial-a)"
    two = _sweep(tmp_path, optimized_metric=["eval/pr/nfe4/accuracy", "eval/pr/nfe4/nfe"])
    two.hydra.sweeper = {"direction": ["maximize", "minimize"]}
    assert summary_line(two, done, failed) == (
        f"{head}; best eval/pr/nfe4/accuracy = 80 (trial 0, trial-a); best eval/pr/nfe4/nfe = 1 (trial 2, trial-c)"
    )
    basic = _sweep(tmp_path, optimized_metric="eval/pr/nfe4/accuracy")  # nothing optimised: the range
    assert summary_line(basic, single, {}) == (
        f"sweep s ({tmp_path.resolve()}): 3 trials, 3 done, 0 failed; eval/pr/nfe4/accuracy from 55.5 (trial 2, "
        "trial-c) to 80 (trial 0, trial-a)"
    )
    assert summary_line(one, {}, failed).endswith(": 1 trial, 0 done, 1 failed; no trial finished")


@pytest.mark.slow
def test_an_optuna_sweep_ends_with_its_summary_and_without_optuna_notices(step2_ckpt, tmp_path):
    import optuna

    objective = "eval/confidence/nfe2/valid_pct"
    proc, out = _run_ok(
        [
            str(BIN / "flowlm-eval"),
            "-m",
            "hparams_search=optuna",
            f"ckpt_path={step2_ckpt}",
            "eval.nfe=[2]",
            f"optimized_metric={objective}",
            "sweep.name=first_hour",
            "hydra.sweeper.n_trials=2",
            "eval.samplers.confidence.temperature=interval(0.5, 1.5)",  # the sweeper's pre-3.0 distributions
            "eval.max_batches=int(interval(1, 2))",
            "trainer.enable_progress_bar=false",
        ],
        tmp_path,
    )
    for noise in NOISE:
        assert noise not in out, f"{noise!r} in the output:\n{out[-4000:]}"
    study = optuna.load_study(study_name="first_hour", storage=f"sqlite:///{tmp_path / 'runs' / 'optuna.db'}")
    best = study.best_trial
    folder = (tmp_path / "runs" / "sweeps" / "first_hour").resolve()
    summary = re.compile(
        rf"sweep first_hour \({re.escape(str(folder))}\): 2 trials, 2 done, 0 failed; best {objective} = "
        rf"{best.value:.6g} \(trial {best.number}, trial-[0-9a-f]{{10}}\)"
    )
    assert summary.fullmatch(proc.stdout.splitlines()[-1]), proc.stdout[-2000:]
    assert not list(folder.glob(".trials-*"))  # the trials' notes are gone


# ------------------------------------------------------------------ 5. evaluations are named after the checkpoint
def test_an_evaluation_is_named_after_its_checkpoint_and_names_its_run(step2_ckpt, runs_env, capsys):
    recorded = read_checkpoint_meta(step2_ckpt)["config"]
    cfg = compose_config("eval", [f"ckpt_path={step2_ckpt}", "eval.nfe=[2]", "eval.max_batches=1", "run_name=e1"])
    folder = (runs_env / "runs" / "eval" / "e1").resolve()
    folder.mkdir(parents=True)  # Hydra's output folder, which the console script has made by now
    result = evaluate(cfg)
    client = MlflowClient(f"sqlite:///{runs_env / 'runs' / 'mlflow.db'}")
    run = client.get_run(result["mlflow_run_id"])
    experiment = client.get_experiment(run.info.experiment_id).name
    assert experiment == recorded["task"] == "sudoku_uncond_6x6"  # was: the experiment "eval", for every checkpoint
    assert (
        run.data.tags["flowlm.name"] == "eval/sudoku_mdm_uncond" and run.data.params["name"] == "eval/sudoku_mdm_uncond"
    )
    assert run.info.run_name == "eval/sudoku_mdm_uncond/e1"
    assert run.data.params["method/_target_"] == "lightning_modules.mdm.MDMModule"  # the report's method column
    (row,) = load_runs(client.tracking_uri).to_dict("records")
    assert (row["name"], row["method"]) == ("eval/sudoku_mdm_uncond", "MDMModule")
    lines = capsys.readouterr().out.splitlines()
    tracked = f"MLflow run: {run.info.run_id} (sqlite:///{(runs_env / 'runs').resolve() / 'mlflow.db'})"
    assert lines.count(f"run folder: {folder}") == 2 and lines.count(tracked) == 2, lines
    assert lines.index(tracked) < lines.index("| run | sampler | NFE 2 |") < len(lines) - 1 - lines[::-1].index(tracked)


def test_a_named_evaluation_keeps_its_name():
    cfg = compose_config("eval", ["ckpt_path=x.ckpt", "name=mine", "run_name=e1"])
    OmegaConf.resolve(cfg)
    name_after_checkpoint(cfg, {"config": {"name": "sudoku_mdm_uncond", "task": "sudoku_uncond_6x6"}})
    assert (cfg.name, cfg.task, cfg.logger.experiment_name, cfg.logger.run_name) == ("mine", "mine", "mine", "mine/e1")
    cfg = compose_config("eval", ["ckpt_path=x.ckpt", "run_name=e1", "logger.experiment_name=mine"])
    OmegaConf.resolve(cfg)
    name_after_checkpoint(cfg, {})  # a foreign model records no run: its path names it, its experiment is given
    assert (cfg.name, cfg.task, cfg.logger.experiment_name) == ("eval/x.ckpt", "eval", "mine")
    assert cfg.logger.run_name == "eval/x.ckpt/e1"


def _logged(client, experiment: str, name: str, params: dict, value: float, tags: dict | None = None) -> None:
    exp = client.get_experiment_by_name(experiment) or client.get_experiment(client.create_experiment(experiment))
    run = client.create_run(exp.experiment_id, run_name=name, tags={"flowlm.name": name, **(tags or {})})
    metrics = [Metric("eval/pr/nfe4/accuracy", value, 0, 10), Metric("eval/pr/nfe4/nfe", 4.0, 0, 10)]
    client.log_batch(run.info.run_id, metrics=metrics, params=[Param(k, str(v)) for k, v in params.items()])
    client.set_terminated(run.info.run_id)


def test_the_report_does_not_pool_settings_that_share_a_name(tmp_path):
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")

    def params(seed: int, lr: float, workers: int = 0) -> dict:
        return {
            "seed": seed,
            "method/_target_": "lightning_modules.fmlm_plus.FMLMPlusModule",
            "method/optim/lr": lr,
            "optim/lr": lr,  # the module's own copy of the same hyper-parameter
            "method/seed": seed,
            "data/seed": seed,
            "data/num_workers": workers,  # a knob that changes no score
            "trainer/default_root_dir": f"/runs/fmlm/lr{lr}/seed{seed}",
        }

    for seed in (0, 1):  # a base run, two seeds (other worker counts) ...
        _logged(client, "task", "fmlm", params(seed, 1e-3, workers=seed), 60.0 + seed)
    for seed in (0, 1):  # ... relaunched under the same name with another learning rate
        _logged(client, "task", "fmlm", params(seed, 3e-3), 70.0 + seed)
    for seed in (0, 1):  # another base run ...
        _logged(client, "task", "mdm", params(seed, 1e-3), 40.0 + seed)
    for seed in (0, 1, 2):  # ... and a grid over its seeds, the same configuration (the trial's override logged too)
        tags = {"flowlm.sweep": "grid", "flowlm.trial": str(seed)}
        _logged(client, "task", "mdm", {**params(seed, 1e-3), "trial/seed": seed}, 50.0 + seed, tags)
    for trial, (seed, lr) in enumerate([(0, 1e-3), (1, 1e-3), (0, 3e-3)]):  # one sweep over the learning rate
        tags = {"flowlm.sweep": "lr", "flowlm.trial": str(trial)}
        _logged(client, "task", "swept", {**params(seed, lr), "trial/method.optim.lr": lr}, 20.0 + 10 * lr, tags)
    for seed in (0, 1):  # evaluations of two seeds' checkpoints: seeds of one setting
        _logged(client, "task", "eval/fmlm", {**params(seed, 1e-3), "seed": 0}, 90.0 + seed)
    runs = load_runs(client.tracking_uri)
    summary = summarize(eval_table(long_metrics(runs)), "accuracy")
    rows = sorted(zip(summary["name"], summary["n"], summary["mean"], strict=True))
    assert rows == [  # was: one line "fmlm" of 4 runs, one "mdm" of 5 (seeds 0 and 1 twice), one "swept" of 3
        ("eval/fmlm", 2, 90.5),
        ("fmlm (lr=0.001)", 2, 60.5),
        ("fmlm (lr=0.003)", 2, 70.5),
        ("mdm", 2, 40.5),
        ("mdm [sweep grid]", 3, 51.0),
        ("swept", 1, 20.03),  # within one sweep: apart here, named by their swept values in the report
        ("swept", 2, 20.01),
    ], rows
    report = build_report(client.tracking_uri, tmp_path / "report")
    lines = dict(zip(report.tables["results/task"]["run"], report.tables["results/task"]["runs"], strict=True))
    assert lines == {
        "eval/fmlm": 2,
        "fmlm (lr=0.001)": 2,
        "fmlm (lr=0.003)": 2,
        "mdm": 2,
        "mdm [sweep grid]": 3,
        "swept (lr=0.001)": 2,
        "swept (lr=0.003)": 1,
    }, lines


# ------------------------------------------------------------------ 6. advice that fits
def _check_size(source: dict, target: dict) -> None:
    ckpt = {"hyper_parameters": {"backbone": source}}
    check_backbone_options(ckpt, target, "mini.ckpt", role="init_from", time_conditioned=False)


def test_an_init_from_of_another_size_is_advised_the_checkpoints_size():
    run = compose_config(overrides=["experiment=sudoku_fmlm_plus_init_uncond", "scale=cpu"])  # a tiny DiT
    target = OmegaConf.to_container(run.method.backbone, resolve=True)
    mini = OmegaConf.to_container(compose_config(overrides=["backbone=mini"]).backbone, resolve=True)
    with pytest.raises(ValueError) as refused:  # was: "n_heads=8 there, 4 here: set backbone.<option>", then shapes
        _check_size(mini, target)
    message = str(refused.value)
    assert "another backbone size, a DiT of d_model=512, n_layers=8 (here d_model=128, n_layers=4)" in message, message
    assert "(backbone=mini)" in message and "n_heads" not in message
    with pytest.raises(ValueError, match=r"\(backbone\.d_model=256 backbone\.n_layers=8 .*backbone\.n_heads=8\)"):
        _check_size({**mini, "d_model": 256}, target)  # no preset of that size: the options themselves
    with pytest.raises(ValueError, match=r"n_heads=8 there, 4 here\): set backbone.<option>"):
        _check_size({**target, "n_heads": 8}, target)  # the same shapes, another function: the option is the advice
    preset = {k: v for k, v in target.items() if k not in ("d_model", "n_layers", "n_heads", "cond_dim")}
    _check_size({**preset, "size": "tiny"}, target)  # a preset is spelled out: the same size


def test_an_evaluation_batch_larger_than_the_training_split_is_not_refused(step2_ckpt, runs_env):
    over = [f"ckpt_path={step2_ckpt}", "eval.nfe=[2]", "eval.max_batches=1", "logger=none"]
    evaluate(compose_config("eval", [*over, "data.num_val=16", "data.batch_size=256"]))  # 24 training examples
