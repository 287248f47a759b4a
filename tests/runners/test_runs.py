"""End to end: every experiment config trains, evaluation and tracking land in MLflow, bad input fails early."""

from pathlib import Path

import mlflow
import pytest
import torch
from conftest import FAST, SHORT, compose_config, cpu_run, module_runs
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from flowlm.pretrained.hub import parse_hub_name
from flowlm.project import CONF_DIR
from runners.common import RunExistsError
from runners.evaluate import evaluate
from runners.resolvers import cpu_precision
from runners.train import train

EXPERIMENTS = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))
SCALES = sorted(p.stem for p in (Path(CONF_DIR) / "scale").glob("*.yaml"))


@pytest.fixture(scope="module")
def shared_runs(tmp_path_factory):
    """One runs/data folder for all experiment configs, so FMLM+ init/distill configs find their MDM."""
    with module_runs(tmp_path_factory, "experiments") as root:
        yield root


def fast_text(cfg) -> list[str]:
    """FAST for text/GSM8K experiments: their fixtures and tiny models (a paper-scale config keeps its HF dataset
    name, which is unreachable offline, so it runs on the fixture files and tokenizer of its tiny counterpart)."""
    over = [*SHORT] + [
        "data.batch_size=4",
        "data.num_workers=0",
        "data.num_proc=null",
    ]
    over += ["backbone=tiny", "eval.metric.evaluator=data/cpu/tiny_evaluator", "eval.max_batches=1"]
    if "gsm8k" in cfg.data._target_:
        files = "tinygsm" if cfg.data.response_field == "code" else "gsm8k"
        over += [
            f"data.train_files=data/cpu/{files}_sample.jsonl",
            "data.eval_files=data/cpu/gsm8k_sample.jsonl",
            "data.seq_len=256",
            "data.min_response_tokens=16",
        ]
        over = [o for o in over if not o.startswith("eval.metric.evaluator")]
    else:  # text flow samplers run PR with the released R = 4 rounds: a budget of at least 4
        over += ["eval.nfe=[4]"]
        over += [
            "data.name=null",
            "data.files=data/cpu/tinystories_sample.jsonl",
            "data.val_split=null",
            "data.val_last_n=40",
            "data.seq_len=64",
        ]
    loader = str(cfg.backbone.get("_target_", "")).rsplit(".", 1)[-1]
    tokenizer = "data/cpu/tiny_tokenizer"
    if loader == "load_smdm":  # a pretrained SMDM: its tiny CPU-scale file
        over += [f"backbone.{k}={v}" for k, v in TINY_SMDM.items()] + ["method.adapter.cond_dim=32"]
    elif loader in TINY_FOLDERS:  # LLaDA / Dream by hub name: their CPU scale's tiny folder, weights and tokenizer
        tiny = TINY_FOLDERS[loader]
        over += [f"backbone.{k}={'null' if v is None else v}" for k, v in tiny["backbone"].items()]
        over += [f"method.adapter.cond_dim={tiny['method']['adapter']['cond_dim']}"]
        tokenizer = tiny["data"]["tokenizer"]
    if loader in ("load_smdm", *TINY_FOLDERS) and "strategy" in cfg.trainer:
        # the paper scale's FSDP2: not in one pytest process (tests/lightning_modules/test_fsdp.py)
        over += ["trainer.strategy=auto"]
    init_from = OmegaConf.select(cfg, "method.init_from", default=None, throw_on_missing=False)
    if isinstance(init_from, str) and parse_hub_name(init_from) and not Path(init_from).exists():
        # a pretrained DiT by hub name (MDLM-OWT at paper scale), unreachable offline: its tiny CPU-scale folder
        over += [f"backbone.{k}={v}" for k, v in TINY_MDLM["backbone"].items()]
        over += [f"method.init_from={TINY_MDLM['method']['init_from']}"]
    return over + [f"data.tokenizer={tokenizer}"]


# conf/scale/gsm8k_mlfm_smdm/cpu.yaml's backbone (the shipped data/cpu/tiny_smdm file)
TINY_SMDM = {
    "source": "data/cpu/tiny_smdm/mdm-tiny.safetensors",
    "filename": "null",
    "dtype": "null",
    "config": "{n_layer:2,n_head:4,n_embd:32,intermediate_size:64,n_query_groups:2,vocab_size:512,"
    "padding_multiple:64,block_size:1024}",
}
# conf/scale/owt_mdlm/cpu.yaml's backbone sizes and init_from (the shipped data/cpu/tiny_mdlm folder)
TINY_MDLM = OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "scale" / "owt_mdlm" / "cpu.yaml"))
# conf/scale/tinygsm_{llada,dream}/cpu.yaml's backbone and tokenizer (the shipped data/cpu/tiny_{llada,dream})
TINY_FOLDERS = {
    f"load_{name}": OmegaConf.to_container(OmegaConf.load(Path(CONF_DIR) / "scale" / f"tinygsm_{name}" / "cpu.yaml"))
    for name in ("llada", "dream")
}


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_runs_fast_dev_run(experiment, scale, shared_runs):
    at = [f"experiment={experiment}", f"scale={scale}"]
    base = compose_config(overrides=at)
    # Sudoku on the tiny DiT at every scale, as text (fast_text): the paper scale's mini DiT is the same code at
    # another width (built in tests/runners/test_scales.py's compose and the backbone tests); its 2 steps cost
    # 13 s a run
    fast = [*FAST, "backbone=tiny"] if base.data._target_.startswith("datamodules.sudoku") else fast_text(base)
    if base.method._target_.endswith("ARModule"):  # AR spends one NFE per token: keep its budget
        nfe = list(base.eval.nfe)  # resolved at this experiment's scale (the family's budgets)
        fast = [o for o in fast if not o.startswith("eval.nfe")]
        fast.append(f"eval.nfe=[{','.join(map(str, nfe))}]")
    # the CPU's own precision at every scale: the paper scale's bf16-mixed is emulated, ≈ 10× slower, on a CPU
    # without bf16 kernels (docs/performance.md#cpu-precision); the same as before where the CPU has them
    fast = [*fast, f"trainer.precision={cpu_precision()}"]
    cfg = compose_config(overrides=[*at, *fast, "+trainer.fast_dev_run=true", "logger=none"])
    if cfg.source is not None:  # an MDM-based variant: train that MDM (2 steps, with a checkpoint) first
        if not Path(cfg.source_ckpt).exists():
            train(compose_config(overrides=[f"experiment={cfg.source}", f"scale={scale}", *fast, "logger=none"]))
        assert Path(cfg.source_ckpt).exists()
    result = train(cfg)
    assert result["rows"], "the final evaluation produced no rows"
    for row in result["rows"]:
        value = row[result["metric"]]
        assert (value > 1) if result["metric"] == "gen_ppl" else (0 <= value <= 100)  # perplexity, or a percentage
        assert 1 <= row["nfe"] <= row["nfe_budget"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short tracked run of the tiny unconditional experiment, shared by the tracking/eval tests."""
    with module_runs(tmp_path_factory, "tracked") as root:
        cfg = compose_config(
            overrides=[
                "experiment=sudoku_mdm_uncond",
                "scale=cpu",
                *FAST,
                "trainer.max_steps=4",
                "trainer.val_check_interval=4",
            ]
        )
        result = train(cfg)
        yield cfg, result, root


def test_mlflow_run_holds_params_metrics_artifacts(trained):
    cfg, result, root = trained
    uri = f"sqlite:///{root / 'runs' / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    runs = mlflow.search_runs(experiment_names=[cfg.task])
    assert len(runs) == 1
    run = runs.iloc[0]
    assert run["run_id"] == result["mlflow_run_id"]
    assert run["params.method/_target_"] == "lightning_modules.mdm.MDMModule"
    assert run["params.data/box_rows"] == "2"
    assert run["tags.mlflow.source.git.commit"]
    for sampler in ("ancestral", "confidence"):
        assert 0 <= run[f"metrics.eval/{sampler}/nfe2/valid_pct"] <= 100
        assert run[f"metrics.eval/{sampler}/nfe2/nfe"] <= 2
    assert run["metrics.train/loss"] > 0
    client = mlflow.MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(cfg.task)  # a model-training experiment for MLflow's UI
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    files = {f.path for f in client.list_artifacts(result["mlflow_run_id"])}
    assert {"config", "eval"} <= files
    table = client.download_artifacts(result["mlflow_run_id"], "eval/final_table.md", str(root))
    assert "NFE 2" in Path(table).read_text()
    assert Path(result["run_dir"], "checkpoints", "last.ckpt").exists()


def test_eval_entry_point_scores_a_checkpoint(trained):
    _, result, root = trained
    ckpt = Path(result["run_dir"], "checkpoints", "last.ckpt")
    cfg = compose_config("eval", overrides=[f"ckpt_path={ckpt}", "eval.nfe=[1,3]", "eval.max_batches=1", "logger=none"])
    out = evaluate(cfg)
    assert {(r["sampler"], r["nfe_budget"]) for r in out["rows"]} == {
        (s, n) for s in ("ancestral", "confidence") for n in (1, 3)
    }
    assert out["metric"] == "valid_pct"


def test_checkpoint_holds_ema_weights(trained):
    _, result, _ = trained
    ckpt = torch.load(Path(result["run_dir"], "checkpoints", "last.ckpt"), weights_only=False)
    assert ckpt["flowlm"]["family"] == "mdm"
    live, ema = ckpt["current_model_state"], ckpt["state_dict"]
    name = "net.blocks.0.qkv.weight"
    assert not torch.equal(live[name], ema[name])  # evaluation loads the average, not the live weights


def test_eval_rejects_wrong_checkpoints(trained, tmp_path):
    _, result, _ = trained
    bogus = tmp_path / "bogus.ckpt"
    torch.save({"state_dict": {}}, bogus)
    with pytest.raises(ValueError, match="not a flowlm checkpoint"):
        evaluate(compose_config("eval", overrides=[f"ckpt_path={bogus}", "logger=none"]))
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        evaluate(compose_config("eval", overrides=[f"ckpt_path={tmp_path / 'missing.ckpt'}", "logger=none"]))
    ckpt = Path(result["run_dir"], "checkpoints", "last.ckpt")
    mismatch = [
        f"ckpt_path={ckpt}",
        "data=sudoku",
        "data.box_rows=2",
        "data.box_cols=2",
        "data.conditional=false",
        "data.difficulty=null",
        "data.num_train=8",
        "data.num_val=4",
        "logger=none",
    ]
    with pytest.raises(ValueError, match="vocab_size=4.*trained with 6"):
        evaluate(compose_config("eval", overrides=mismatch))


def test_eval_overrides_single_keys_of_the_recorded_data_config(trained):
    from lightning_modules.checkpoints import read_checkpoint_meta
    from runners.evaluate import eval_data_config

    _, result, root = trained
    ckpt = Path(result["run_dir"], "checkpoints", "last.ckpt")
    base = [f"ckpt_path={ckpt}", "eval.nfe=[1]", "eval.max_batches=1"]
    # The checkpoint's data config is the base and the command line's keys override it; the run records the merge.
    out = evaluate(compose_config("eval", overrides=[*base, "data.num_val=4"]))
    params = mlflow.MlflowClient(f"sqlite:///{root / 'runs' / 'mlflow.db'}").get_run(out["mlflow_run_id"]).data.params
    assert params["data/num_val"] == "4" and params["data/box_rows"] == "2" and out["rows"]
    # Hydra's own hint (`+data.<key>=...`) works the same way.
    merged = eval_data_config(compose_config("eval", overrides=[*base, "+data.num_val=4"]), read_checkpoint_meta(ckpt))
    assert merged.num_val == 4 and merged.box_cols == 3 and merged._target_.endswith("SudokuDataModule")
    # A layout that does not fit the checkpoint still gets the clear error, before compute.
    with pytest.raises(ValueError, match="vocab_size=9, the checkpoint was trained with 6"):
        evaluate(compose_config("eval", overrides=[*base, "data.box_rows=3", "data.box_cols=3", "logger=none"]))
    with pytest.raises(ValueError, match="data.box_row is not a key of the data config recorded in .*box_rows, box_"):
        evaluate(compose_config("eval", overrides=[*base, "data.box_row=3", "logger=none"]))


def test_existing_run_is_never_overwritten(trained):
    cfg, result, _ = trained
    run_dir = Path(result["run_dir"])
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    other = compose_config(overrides=["experiment=sudoku_mdm_uncond", "scale=cpu", *FAST, "backbone.n_layers=2"])
    OmegaConf.update(other, "paths.root", cfg.paths.root)
    with pytest.raises(RunExistsError, match="backbone.n_layers"):
        train(other)
    strict = compose_config(overrides=["experiment=sudoku_mdm_uncond", "scale=cpu", *FAST, "if_exists=error"])
    OmegaConf.update(strict, "paths.root", cfg.paths.root)
    with pytest.raises(RunExistsError, match="if_exists=error"):
        train(strict)
    after = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    assert after == before


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("method=fmlm_nope", "method"),
        ("+sampler@eval.samplers.x=nope", "sampler"),
    ],
)
def test_unknown_components_fail_at_composition(override, match, runs_env):
    with pytest.raises(ConfigCompositionException, match=match):
        compose_config(overrides=[override])


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        (["data.difficulty=extreme"], ValueError, "difficulty"),
        (["data.box_rows=0"], ValueError, "box"),
        (["eval.nfe=[0]"], ValueError, "NFE budget"),
        (["data.eval_file=/nonexistent/puzzles.csv"], FileNotFoundError, "puzzles.csv"),
        (
            ["method=fmlm_plus", "eval=sudoku_flow", "+sampler@eval.samplers.block=block", "eval.nfe=[2]"],
            ValueError,
            "4 blocks × 1 steps need 4 NFE, above the budget of 2",
        ),
    ],
)
def test_bad_input_fails_before_compute(overrides, error, match, runs_env):
    cfg = compose_config(overrides=["experiment=sudoku_mdm_medium", "scale=cpu", *FAST, *overrides])
    with pytest.raises(error, match=match):
        train(cfg)
    assert not (runs_env / "runs" / cfg.name).exists() or not any((runs_env / "runs" / cfg.name).rglob("*.ckpt"))


def test_eval_on_a_user_puzzle_file(runs_env):
    from flowlm.tasks.sudoku import SudokuSpec, generate, grid_to_string

    box = ["data.box_rows=2", "data.box_cols=2"]
    cfg = compose_config(overrides=["experiment=sudoku_mdm_easy", "scale=cpu", *FAST, *box, "logger=none"])
    ckpt = Path(train(cfg)["run_dir"], "checkpoints", "last.ckpt")
    puzzles, solutions = generate(SudokuSpec(2, 2), conditional=True, difficulty="hard", num=5, seed=123)
    good = runs_env / "mine.csv"
    good.write_text(
        "puzzle,solution\n"
        + "".join(f"{grid_to_string(p)},{grid_to_string(s)}\n" for p, s in zip(puzzles, solutions, strict=False))
    )
    file_cfg = [f"ckpt_path={ckpt}", "data=sudoku_file", *box, "eval.nfe=[1,4]", "logger=none"]
    out = evaluate(compose_config("eval", overrides=[*file_cfg, f"data.eval_file={good}"]))
    assert len(out["rows"]) == 4 and out["metric"] == "accuracy"
    bad = runs_env / "bad.csv"
    bad.write_text("puzzle,solution\n1234,123\n")
    with pytest.raises(ValueError, match="bad.csv"):
        evaluate(compose_config("eval", overrides=[*file_cfg, f"data.eval_file={bad}"]))


def test_fmlm_plus_refuses_wrong_mdm_sources(trained, runs_env):
    _, result, _ = trained
    mdm_ckpt = Path(result["run_dir"], "checkpoints", "last.ckpt")
    base = cpu_run("sudoku_fmlm_plus_init_uncond", f"method.init_from={mdm_ckpt}")
    with pytest.raises(ValueError, match="another backbone size"):
        train(compose_config(overrides=[*base, "backbone.d_model=64"]))
    advice = r"another backbone size, a DiT of n_layers=4 \(here n_layers=1\).*backbone=tiny"  # the size first
    with pytest.raises(ValueError, match=advice):
        train(compose_config(overrides=[*base, "backbone.n_layers=1"]))
    with pytest.raises(ValueError, match="vocabulary of 6 data tokens, this run has 4"):
        train(compose_config(overrides=[*base, "data.box_rows=2", "data.box_cols=2", "data.num_train=64"]))
    flow = train(compose_config(overrides=cpu_run("sudoku_fmlm_plus_scratch_uncond")))
    flow_ckpt = Path(flow["run_dir"], "checkpoints", "last.ckpt")
    distill = cpu_run("sudoku_fmlm_plus_distill_uncond", f"method.teacher={flow_ckpt}")
    with pytest.raises(ValueError, match="teacher .* is a 'flow' checkpoint, expected a 'mdm' one"):
        train(compose_config(overrides=distill))
    assert not list((runs_env / "runs").glob("sudoku_fmlm_plus_init_uncond/**/checkpoints/*.ckpt"))


def test_block_sampler_runs_in_the_evaluation(runs_env):
    over = [
        "experiment=sudoku_fmlm_plus_scratch_medium",
        "scale=cpu",
        *FAST,
        "logger=none",
        "+sampler@eval.samplers.block=block",
        "eval.nfe=[4,8]",
    ]
    rows = train(compose_config(overrides=over))["rows"]
    assert {(r["sampler"], r["nfe_budget"], r["nfe"]) for r in rows if r["sampler"] == "block"} == {
        ("block", 4, 4.0),
        ("block", 8, 8.0),
    }


def test_fmlm_starts_from_an_flm_checkpoint(runs_env):
    flm = train(
        compose_config(
            overrides=[
                "experiment=sudoku_fmlm_plus_scratch_uncond",
                "scale=cpu",
                "method=flm",
                *FAST,
                "logger=none",
                "name=flm",
                "eval=sudoku_flow",
            ]
        )
    )
    ckpt = Path(flm["run_dir"], "checkpoints", "last.ckpt")
    over = [
        "experiment=sudoku_fmlm_plus_scratch_uncond",
        "scale=cpu",
        "method=fmlm",
        *FAST,
        "logger=none",
        "name=fmlm",
        f"method.init_from={ckpt}",
    ]
    cfg = compose_config(overrides=over)
    from hydra.utils import instantiate

    module = instantiate(cfg.method, data_vocab_size=6, seq_len=36)
    report = module.initialise_from(torch.load(ckpt, weights_only=False)["state_dict"])
    assert not report["fresh"] and not report["sliced"]  # an FLM has the same two-time DiT: everything copies
    assert train(cfg)["rows"]
