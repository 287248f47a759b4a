"""Issue 49 (bad input, faults and leaks, round four): booleans are booleans (a crafted checkpoint given with
``trust_pickle=no`` is refused, its payload never runs), ``--mlflow_tracking_uri none`` is untracked, results rows
are keyed by what made them, secrets in tracking URIs are never written, numbers are checked for what they are
(docs/reliability.md)."""

# ruff: noqa: F811 - the fixtures imported from the modules that define them are test arguments here
from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from flowlm.options import as_bool, as_int
from lightning_modules.checkpoints import UntrustedCheckpointError, load_module, read_checkpoint, read_checkpoint_meta
from runners import lm_harness, mt_bench
from runners.common import RUN_SWITCHES
from runners.lm_harness import FlowLM
from tests.conftest import FAST, compose_config
from tests.pretrained.test_safe_loading import crafted
from tests.runners.test_lm_harness import TASKS, local_tasks  # noqa: F401 - a fixture
from tests.runners.test_lm_harness import checkpoints as lm_checkpoints  # noqa: F401 - a fixture
from tests.runners.test_mt_bench import SMALL, checkpoints, config, questions, write_answers  # noqa: F401 - fixtures


# ------------------------------------------------------------------------------------------------ booleans
@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), (1, True), (0, False), ("no", False), ("No", False), ("OFF", False),
     ("0", False), ("false", False), ("yes", True), ("on", True), ("1", True), ("True", True), (" true ", True)],
)  # fmt: skip
def test_the_usual_spellings_are_booleans(value, expected):
    assert as_bool("trust_pickle", value) is expected


@pytest.mark.parametrize("value", ["maybe", "", "nope", 2, -1, 0.0, 1.5, None, [], "yes please"])
def test_anything_else_is_refused_in_one_line_naming_the_option(value):
    with pytest.raises(ValueError, match=r"^trust_pickle must be true or false .*got") as refused:
        as_bool("trust_pickle", value)
    assert "\n" not in str(refused.value) and "trust_pickle=false" in str(refused.value)


@pytest.fixture
def crafted_checkpoint(tmp_path):
    """(checkpoint, marker): a flowlm checkpoint whose unpickling writes ``marker``."""
    marker = tmp_path / "marker"
    return crafted(tmp_path / "crafted.ckpt", marker), marker


@pytest.mark.parametrize("no", ["no", "No", "off", "0", "false", 0, False])
def test_a_crafted_checkpoint_with_trust_pickle_no_is_refused_by_every_reader(crafted_checkpoint, no):
    path, marker = crafted_checkpoint
    for reader in (read_checkpoint, read_checkpoint_meta, load_module):
        with pytest.raises(UntrustedCheckpointError):
            reader(path, trust_pickle=no)
    assert not marker.exists()


def test_lm_eval_model_args_trust_pickle_no_is_refused_and_the_payload_never_runs(crafted_checkpoint, tmp_path):
    """The command line's path (``tracked``: the MLflow run is made from the checkpoint's record) and the model's
    own (``FlowLM``, what ``lm_eval.simple_evaluate`` builds from the parsed model_args)."""
    path, marker = crafted_checkpoint
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"

    def never(model=None, model_args=None):
        pytest.fail("the evaluation ran")

    with pytest.raises(UntrustedCheckpointError):
        lm_harness.tracked(never, store)(model="flowlm", model_args=f"checkpoint={path},trust_pickle=no")
    with pytest.raises(UntrustedCheckpointError):
        FlowLM(checkpoint=str(path), trust_pickle="no", device="cpu")
    assert not marker.exists()
    with pytest.raises(ValueError, match="trust_pickle must be true or false") as refused:
        lm_harness.tracked(never, store)(model="flowlm", model_args=f"checkpoint={path},trust_pickle=maybe")
    assert "\n" not in str(refused.value)
    with pytest.raises(ValueError, match="trust_pickle must be true or false"):
        FlowLM(checkpoint=str(path), trust_pickle="maybe", device="cpu")
    assert not marker.exists()


def test_mt_bench_generate_trust_pickle_no_is_refused_and_the_payload_never_runs(
    crafted_checkpoint, questions, tmp_path
):
    path, marker = crafted_checkpoint
    common = [f"ckpt_path={path}", f"questions={questions}", "step=generate", "logger=none"]
    with pytest.raises(UntrustedCheckpointError):
        mt_bench.run(config(tmp_path, *common, "generate.trust_pickle=no"))
    assert not marker.exists()
    with pytest.raises(ValueError, match="^generate.trust_pickle must be true or false") as refused:
        mt_bench.run(config(tmp_path, *common, "generate.trust_pickle=maybe"))
    assert "\n" not in str(refused.value) and not marker.exists()


def test_mt_bench_overwrite_no_does_not_replace_written_answers(checkpoints, questions, tmp_path):
    answers = write_answers(tmp_path, "tiny_mdm")
    before = answers.read_text()
    common = [f"ckpt_path={checkpoints['mdm']}", f"questions={questions}", "step=generate", *SMALL]
    with pytest.raises(FileExistsError, match="overwrite=true"):
        mt_bench.run(config(tmp_path, *common, "overwrite=no"))
    with pytest.raises(ValueError, match="^overwrite must be true or false"):
        mt_bench.run(config(tmp_path, *common, "overwrite=perhaps"))
    assert answers.read_text() == before


@pytest.mark.parametrize(
    ("command", "overrides", "key"),
    [("train", ["final_eval=maybe"], "final_eval"), ("eval", ["ckpt_path=x.ckpt", "compile=perhaps"], "compile")],
)
def test_train_and_eval_refuse_a_switch_that_is_not_a_boolean_before_the_task_runs(command, overrides, key):
    """`final_eval=maybe`, `compile=perhaps` (conf/train.yaml, conf/eval.yaml) were read as `if cfg.x:`: true."""
    from runners.trial import run_trial

    def never(cfg):
        pytest.fail("the task ran")

    with pytest.raises(ValueError, match=rf"^{key} must be true or false .*give {key}=true or {key}=false$"):
        run_trial(never, compose_config(command, overrides))


def test_train_and_eval_read_the_usual_spellings_of_their_switches_as_booleans(runs_env):
    """`final_eval=no` is the string "no" in Hydra's config, truthy: it evaluated; each switch is a real bool by
    the time the task reads it (MLflow's `logger.log_model=all` kept)."""
    from runners.trial import run_trial

    seen = {}

    def task(cfg):
        seen.update({key: OmegaConf.select(cfg, key) for key in RUN_SWITCHES})
        return {"rows": []}

    overrides = ["final_eval=no", "compile=off", "sweep.continue_on_error=0", "logger.log_model=all", "tf32=yes"]
    run_trial(task, compose_config("train", overrides))
    assert seen == {
        **{"compile": False, "activation_checkpointing": False, "final_eval": False, "tf32": True},
        **{"sweep.continue_on_error": False, "logger.resilient": True, "logger.log_model": "all"},
    }


def test_the_report_refuses_log_to_mlflow_maybe_before_reading_the_store(tmp_path):
    """`flowlm-report log_to_mlflow=maybe` logged the report (`if cfg.log_to_mlflow:`); now refused first, in one
    line naming the option (the probe's missing store answered before it); `no` is false."""
    from runners.report import report

    common = [f"tracking_uri=sqlite:///{tmp_path}/none/mlflow.db", f"out={tmp_path}/out", f"paths.root={tmp_path}"]
    with pytest.raises(ValueError, match=r"^log_to_mlflow must be true or false .*got 'maybe'") as refused:
        report(compose_config("report", [*common, "log_to_mlflow=maybe"]))
    assert "\n" not in str(refused.value)
    cfg = compose_config("report", [*common, "log_to_mlflow=no"])
    with pytest.raises(FileNotFoundError, match="^tracking_uri: no MLflow store"):
        report(cfg)
    assert cfg.log_to_mlflow is False
    assert not (tmp_path / "none").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("checkpoint", "bad", "match"),
    [
        ("run", "mc_samples=nan", r"^flowlm: mc_samples must be an integer ≥ 1, got nan$"),
        ("run", "nfes=4", r"^flowlm: unknown model_args nfes "),
        ("run", "sampler.temperature=nan", r"temperature"),
        ("sudoku", "nfe=4", r"sudoku.ckpt records no tokenizer .* give model_args tokenizer=NAME_OR_DIR"),
    ],
)
def test_lm_eval_refuses_bad_model_args_before_any_mlflow_run(
    lm_checkpoints, local_tasks, tmp_path, checkpoint, bad, match
):
    """A bad model_args value was refused in one line, but only once lm-eval built the model, inside the MLflow run
    (a FAILED run left in the store); now the model's checks run first, and the store is never made."""
    store = tmp_path / "store" / "mlflow.db"
    with pytest.raises((ValueError, TypeError), match=match) as refused:
        lm_harness.evaluate(
            model="flowlm", model_args=f"checkpoint={lm_checkpoints[checkpoint]},{bad}", tasks=["flowlm_qa"],
            task_manager=local_tasks, device="cpu", tracking_uri=f"sqlite:///{store}",
        )  # fmt: skip
    assert "\n" not in str(refused.value)
    assert not (tmp_path / "store").exists()


def test_the_model_args_check_reads_no_weights(lm_checkpoints, monkeypatch):
    """``FlowLM.check_args`` (what ``tracked`` runs before the MLflow run) passes good model_args without reading the
    weights, which lm-eval's own build of the model reads next."""
    monkeypatch.setattr(lm_harness, "load_module", lambda *a, **k: pytest.fail("the weights were read"))
    FlowLM.check_args(checkpoint=str(lm_checkpoints["run"]), nfe="4", mc_samples=2, device="cpu")


# ------------------------------------------------------------------------------------------------ integers
@pytest.mark.parametrize("value", [1.5, "abc", "1.5", True, None])
def test_a_seed_that_is_not_an_integer_is_refused_naming_seed(value):
    with pytest.raises(ValueError, match=r"^seed must be an integer") as refused:
        as_int("seed", value)
    assert "\n" not in str(refused.value)


def test_integer_seeds_and_their_strings_pass():
    assert as_int("seed", 7) == 7 and as_int("seed", "7") == 7 and as_int("seed", "-3") == -3
    with pytest.raises(ValueError, match="≥ 0"):
        as_int("seed", -3, minimum=0)


# ------------------------------------------------------------------------------------------------ untracked
@pytest.mark.parametrize("none", ["none", "None"])
def test_lm_eval_mlflow_tracking_uri_none_evaluates_untracked(
    lm_checkpoints, local_tasks, runs_env, tmp_path, monkeypatch, none
):
    """`flowlm-lm-eval --mlflow_tracking_uri none` (documented: untracked) crashed with "'NoneType' object has no
    attribute 'get'"; it evaluates, writes lm-eval's results and makes no MLflow store."""
    out = tmp_path / "out"
    argv = ["flowlm-lm-eval", "--model", "flowlm", "--tasks", "flowlm_choice", "--include_path", str(TASKS)]
    argv += ["--model_args", f"checkpoint={lm_checkpoints['run']},mc_samples=2", "--limit", "2"]
    argv += ["--device", "cpu", "--batch_size", "16", "--output_path", str(out), "--mlflow_tracking_uri", none]
    monkeypatch.setattr(sys, "argv", argv)
    lm_harness.main()
    (written,) = out.rglob("results_*.json")
    assert "flowlm_choice" in json.loads(written.read_text())["results"]
    assert not list(runs_env.rglob("mlflow.db")) and not list(runs_env.rglob("mlruns"))


# ------------------------------------------------------------------------------------------------ results rows
def _eval_rows(path: Path) -> list[dict]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_an_evaluation_at_another_seed_adds_its_rows_and_names_their_seed(runs_env, monkeypatch):
    """`flowlm-eval seed=7` into the results folder of a seed-0 run replaced the seed-0 rows with seed 7's values,
    labelled seed 0; now its rows are added, ``seed`` the model's and ``eval_seed`` 7, and a rerun at seed 7 replaces
    only its own. A seed that is not an integer is refused naming ``seed`` before the weights are read."""
    import lightning_modules.checkpoints as checkpoints_module
    from runners.evaluate import evaluate
    from runners.train import train

    results = runs_env / "results"
    eval_args = ["eval.nfe=[1,4]", "eval.max_batches=1", f"results_csv={results}", "logger=none"]
    run = train(compose_config(overrides=["experiment=sudoku_mdm_easy", "scale=cpu", *FAST, "eval.max_batches=1"]))
    ckpt = f"ckpt_path={Path(run['run_dir']) / 'checkpoints' / 'last.ckpt'}"
    evaluate(compose_config("eval", [ckpt, *eval_args]))
    (path,) = results.rglob("sudoku_mdm_easy_seed0_eval.csv")
    first = _eval_rows(path)
    assert {(r["seed"], r["eval_seed"]) for r in first} == {("0", "0")}
    evaluate(compose_config("eval", [ckpt, *eval_args, "seed=7"]))
    both = _eval_rows(path)
    assert [r for r in both if r["eval_seed"] == "0"] == first  # the seed-0 rows untouched
    sevens = [r for r in both if r["eval_seed"] == "7"]
    assert len(sevens) == len(first) and {r["seed"] for r in sevens} == {"0"}
    # the ancestral sampler draws at temperature 1: seed 7's grids are not seed 0's
    assert [(r["auroc"], r["wrong_pct"]) for r in sevens] != [(r["auroc"], r["wrong_pct"]) for r in first]
    evaluate(compose_config("eval", [ckpt, *eval_args, "seed=7"]))
    again = _eval_rows(path)
    assert len(again) == len(both) and [r for r in again if r["eval_seed"] == "0"] == first
    before = path.read_text()
    monkeypatch.setattr(checkpoints_module, "load_module", lambda *a, **k: pytest.fail("the weights were read"))
    for bad in ("seed=1.5", "seed=abc", "eval.seed=2.5"):
        with pytest.raises(ValueError, match=r"^(eval\.)?seed must be an integer") as refused:
            evaluate(compose_config("eval", [ckpt, *eval_args, bad]))
        assert "\n" not in str(refused.value)
    assert path.read_text() == before


def test_a_row_written_before_rows_named_their_seed_is_replaced_by_the_default_seeds_row(tmp_path):
    """Rows of the committed results (no ``eval_seed`` column) were drawn with the model's seed: an evaluation at that
    seed replaces them, one at another seed keeps them."""
    from callbacks.results_csv import COLUMNS
    from runners.evaluate import earlier_rows

    committed = next(Path(__file__).parents[2].glob("results/sudoku/superseded/*/*_seed0_eval.csv"))
    old = _eval_rows(committed)
    assert old and "eval_seed" not in old[0]
    path = tmp_path / committed.name
    path.write_text(committed.read_text())
    row = {c: old[0].get(c, "") for c in COLUMNS}
    assert len(earlier_rows(path, [{**row, "eval_seed": 0}])) == len(old) - 1
    assert len(earlier_rows(path, [{**row, "eval_seed": 7}])) == len(old)


@pytest.mark.parametrize("bad", ["seed=1.5", "seed=abc"])
def test_flowlm_train_refuses_a_seed_that_is_not_an_integer_before_anything_is_written(runs_env, bad):
    from runners.train import train

    with pytest.raises(ValueError, match=r"^seed must be an integer") as refused:
        train(compose_config(overrides=["experiment=sudoku_mdm_easy", "scale=cpu", *FAST, bad]))
    assert "\n" not in str(refused.value) and not (runs_env / "runs" / "sudoku_mdm_easy").exists()


# ------------------------------------------------------------------------------------------------ secrets
SECRET = "S3CRETPW"
SECRET_URI = f"postgresql://flowlm:{SECRET}@db.example:5432/mlflow"


@pytest.fixture
def postgres_as_sqlite(runs_env, monkeypatch):
    """MLflow opens ``postgresql://`` URIs as a SQLite store under the test's folder, so the suite tracks into a
    store whose URI holds a password and records that URI as given."""
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore
    from mlflow.tracking._tracking_service import utils
    from mlflow.tracking._tracking_service.registry import TrackingStoreRegistry

    db, artifacts = runs_env / "tracked.db", runs_env / "artifacts"

    def store(store_uri, artifact_uri=None):
        return SqlAlchemyStore(f"sqlite:///{db}", artifact_uri or str(artifacts))

    caches = (TrackingStoreRegistry._get_store_with_resolved_uri, utils._get_tracking_scheme_with_resolved_uri)
    for cache in caches:
        cache.cache_clear()
    monkeypatch.setitem(utils._tracking_store_registry._registry, "postgresql", store)
    yield db
    for cache in caches:
        cache.cache_clear()


def _holding(folder: Path, secret: str) -> list[str]:
    return sorted(
        str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()
    )


def test_a_tracking_uris_password_is_in_no_written_file(postgres_as_sqlite, runs_env, monkeypatch, capsys):
    """A run tracked in a database whose URI holds a password (given on the command line: Hydra writes it into
    .hydra/ before the run starts), then evaluated and exported: the password is in no file under the test's folder
    (run folder, checkpoints, run_config.yaml, Hydra's files, MLflow's store and artifacts, the results CSVs, the
    export's config.json and card) and in nothing printed; the tracking still works."""
    from hydra.core.global_hydra import GlobalHydra
    from mlflow import MlflowClient

    from runners import train as train_module
    from runners.evaluate import evaluate
    from runners.export import export

    results = runs_env / "results"
    argv = ["flowlm-train", "experiment=sudoku_mdm_easy", "scale=cpu", *FAST, "eval.max_batches=1"]
    argv += [f"logger.tracking_uri={SECRET_URI}", f"callbacks.results_csv.dir={results}"]
    monkeypatch.setattr(sys, "argv", argv)
    try:
        train_module.main()
    finally:
        GlobalHydra.instance().clear()
    (ckpt,) = (runs_env / "runs").rglob("last.ckpt")
    run_dir = ckpt.parent.parent
    assert (run_dir / ".hydra" / "overrides.yaml").is_file()
    evaluate(
        compose_config(
            "eval",
            [f"ckpt_path={ckpt}", "eval.nfe=[1]", "eval.max_batches=1", f"results_csv={results}"]
            + [f"logger.tracking_uri={SECRET_URI}"],
        )
    )
    export(ckpt, runs_env / "export")
    printed = capsys.readouterr()
    assert SECRET not in printed.out + printed.err
    assert _holding(runs_env, SECRET) == []
    redacted = SECRET_URI.replace(SECRET, "***")
    assert redacted in (run_dir / "run_config.yaml").read_text()
    assert redacted in (runs_env / "export" / "config.json").read_text()
    client = MlflowClient(SECRET_URI)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) == 2 and all(r.data.params for r in runs)  # the training and the evaluation were tracked


def test_merge_mlfm_on_another_family_is_refused_before_anything_is_written(tmp_path):
    from runners.export import export
    from tests.pretrained.test_export import write_run_checkpoint

    path = tmp_path / "mdm.ckpt"
    write_run_checkpoint(path)
    with pytest.raises(ValueError, match="--merge-mlfm .* is a 'mdm' checkpoint: leave --merge-mlfm out") as refused:
        export(path, tmp_path / "out", merge_mlfm=True)
    assert "\n" not in str(refused.value) and not (tmp_path / "out").exists()


def test_an_export_of_a_checkpoint_that_recorded_a_password_leaves_it_out(tmp_path):
    """A checkpoint written before run configs were redacted holds the URI as given: config.json and the card of its
    export do not."""
    from runners.export import export
    from tests.pretrained.test_export import write_run_checkpoint

    path = tmp_path / "old.ckpt"
    write_run_checkpoint(path, config={"logger": {"tracking_uri": SECRET_URI}})
    assert SECRET.encode() in path.read_bytes()
    export(path, tmp_path / "out")
    assert _holding(tmp_path / "out", SECRET) == []
    assert SECRET_URI.replace(SECRET, "***") in (tmp_path / "out" / "config.json").read_text()


def test_a_sweeps_hydra_files_lose_the_password_too(tmp_path):
    """A multirun's trial: its own .hydra/ files and the sweep's multirun.yaml (the command line as given)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import open_dict

    from flowlm.project import CONF_DIR
    from runners.common import redact_hydra_output

    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose("train", [f"logger.tracking_uri={SECRET_URI}"], return_hydra_config=True)
    trial = tmp_path / "sweep" / "3"
    with open_dict(cfg):
        cfg.hydra.mode, cfg.hydra.sweep.dir = RunMode.MULTIRUN, str(tmp_path / "sweep")
        cfg.hydra.runtime.output_dir, cfg.hydra.output_subdir = str(trial), ".hydra"
    (trial / ".hydra").mkdir(parents=True)
    for path in (trial / ".hydra" / "overrides.yaml", tmp_path / "sweep" / "multirun.yaml"):
        path.write_text(f"- logger.tracking_uri={SECRET_URI}\n")
    HydraConfig.instance().set_config(cfg)
    try:
        redact_hydra_output()
    finally:
        HydraConfig.instance().cfg = None
    assert _holding(tmp_path, SECRET) == []
    assert SECRET_URI.replace(SECRET, "***") in (tmp_path / "sweep" / "multirun.yaml").read_text()


def test_the_reports_messages_name_the_store_without_its_password(postgres_as_sqlite):
    from analysis.load import NoRunsError, load_runs

    for experiments in (["nope"], None):
        with pytest.raises(NoRunsError) as refused:
            load_runs(SECRET_URI, experiments=experiments)
        assert SECRET not in str(refused.value) and SECRET_URI.replace(SECRET, "***") in str(refused.value)
