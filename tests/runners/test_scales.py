"""Configs by scale: every experiment composes at every scale into its own run folder, MLflow experiment and sweep;
an MDM-based experiment's checkpoint is its source MDM's of the same seed and scale; a method pulls its family's
samplers; debug=fast is the tests' former hand-written speed overrides."""

import functools
from pathlib import Path

import pytest
from conftest import FAST, compose_config
from omegaconf import OmegaConf

from analysis.tables import reference_numbers
from flowlm.project import CONF_DIR
from runners import resolvers  # noqa: F401  (registers the ${flowlm.*} resolvers the configs use)

EXPERIMENTS = sorted(p.stem for p in (Path(CONF_DIR) / "experiment").glob("*.yaml"))
SCALES = sorted(p.stem for p in (Path(CONF_DIR) / "scale").glob("*.yaml"))
# The overrides every end-to-end test spelled out before conf/debug/fast.yaml existed.
HAND_WRITTEN_FAST = [
    "data.num_train=24",
    "data.num_val=8",
    "data.batch_size=8",
    "data.gen_workers=1",
    "trainer.accelerator=cpu",
    "trainer.devices=1",
    "trainer.max_steps=2",
    "trainer.val_check_interval=2",
    "trainer.log_every_n_steps=1",
    "eval.nfe=[2]",
    "eval.max_batches=1",
    "method.optim.warmup_steps=1",
]


@functools.cache
def _composed(experiment: str, scale: str):
    """An experiment composed at a scale (cached: MDMs are the source of several experiments)."""
    return compose_config(overrides=[f"experiment={experiment}", f"scale={scale}"])


@pytest.mark.slow
def test_every_experiment_composes_at_every_scale_apart():
    assert {"paper", "cpu"} <= set(SCALES) and len(EXPERIMENTS) >= 40
    for experiment in EXPERIMENTS:
        apart = []
        for scale in SCALES:
            cfg = _composed(experiment, scale)
            assert cfg.name == experiment and cfg.scale.name == scale
            assert OmegaConf.select(cfg, "reference", default="absent") != "absent", f"{experiment}: no reference"
            if cfg.reference is not None:  # a row of analysis/reference.yaml, which alone holds the number
                table = reference_numbers()[cfg.reference.task]
                ref = (cfg.reference.model, cfg.reference.sampler)
                rows = [r for r in table["rows"] if (r["model"], r["sampler"]) == ref]
                assert rows or cfg.reference.nfe is None, f"{experiment}: {cfg.reference} not in reference.yaml"
                if rows:
                    assert cfg.reference.nfe in rows[0]["values"], (experiment, rows[0])
            apart.append((cfg.paths.run_dir, cfg.task, cfg.sweep.name))
            if cfg.source is not None:  # the source MDM's checkpoint, same seed and scale
                mdm = _composed(cfg.source, scale)
                assert mdm.method._target_.endswith("MDMModule") and mdm.task == cfg.task  # same task: same data
                assert OmegaConf.to_container(mdm.data, resolve=True) == OmegaConf.to_container(cfg.data, resolve=True)
                assert cfg.source_ckpt == str(Path(mdm.paths.run_dir, "checkpoints", "last.ckpt"))
                assert cfg.source_ckpt in (cfg.method.get("init_from"), cfg.method.get("teacher"))
        for i, what in enumerate(("run folder", "MLflow experiment", "sweep")):  # scales never share one
            assert len({a[i] for a in apart}) == len(SCALES), f"{experiment}: scales share a {what}: {apart}"


SUDOKU, TEXT, GSM8K = "SudokuMetric", "GenPPLMetric", "GSM8KAccuracy"


@pytest.mark.parametrize(
    ("overrides", "samplers", "metric"),
    [
        (["experiment=sudoku_mdm_easy"], {"ancestral", "confidence"}, SUDOKU),
        (["experiment=sudoku_mdm_easy", "method=fmlm_plus_init", "method.init_from=x"], {"pr", "a_priori"}, SUDOKU),
        (["experiment=sudoku_fmlm_plus_distill_hard"], {"pr", "a_priori"}, SUDOKU),
        (["experiment=sudoku_mlfm_easy", "scale=cpu"], {"mlfm", "mlfm_ccfg", "mlfm_ccfg_otp"}, SUDOKU),
        (["experiment=sudoku_ar_medium"], {"ar"}, SUDOKU),
        (["experiment=owt_fmlm_plus_scratch", "scale=cpu"], {"pr", "a_priori"}, TEXT),
        (["experiment=owt_mdm", "method=ar"], {"ar"}, TEXT),
        (["experiment=gsm8k_mlfm"], {"mlfm", "mlfm_ccfg", "mlfm_ccfg_otp", "mlfm_w4_otp", "mlfm_w6_otp"}, GSM8K),
        (["experiment=tinygsm_mdm", "scale=cpu"], {"confidence"}, GSM8K),
    ],
)
def test_a_method_pulls_its_familys_samplers(overrides, samplers, metric):
    """The eval group is <task>_<family>: the task's metric, the method family's samplers."""
    cfg = compose_config(overrides=overrides)
    assert set(cfg.eval.samplers) == samplers
    assert cfg.eval.metric._target_.endswith(metric)


@pytest.mark.parametrize("experiment", ["sudoku_mdm_uncond", "sudoku_fmlm_plus_init_easy"])
def test_debug_fast_is_the_former_hand_written_overrides(experiment):
    at = [f"experiment={experiment}", "scale=cpu"]
    by_group = OmegaConf.to_container(compose_config(overrides=[*at, *FAST]), resolve=True)
    by_hand = OmegaConf.to_container(compose_config(overrides=[*at, *HAND_WRITTEN_FAST]), resolve=True)
    assert by_group == by_hand
    assert by_group["trainer"]["max_steps"] == 2 and by_group["data"]["num_train"] == 24


def test_a_scale_changes_sizes_not_the_experiment():
    paper, cpu = (compose_config(overrides=["experiment=sudoku_fmlm_plus_init_uncond", f"scale={s}"]) for s in SCALES)
    paper, cpu = (paper, cpu) if paper.scale.name == "paper" else (cpu, paper)
    assert (paper.data.box_rows, cpu.data.box_rows) == (3, 2) and (
        paper.trainer.accelerator,
        cpu.trainer.accelerator,
    ) == (
        "gpu",
        "cpu",
    )
    assert (paper.backbone.d_model, cpu.backbone.d_model) == (512, 128)  # mini, tiny
    assert list(paper.eval.nfe) == [1, 3, 9, 27, 81] and list(cpu.eval.nfe) == [1, 2, 3, 6, 12, 36]
    assert paper.task == "sudoku_uncond_9x9" and cpu.task == "sudoku_uncond_6x6"
    assert paper.method._target_ == cpu.method._target_ and paper.method.shares == cpu.method.shares
    assert paper.paths.run_dir.endswith("sudoku_fmlm_plus_init_uncond/paper/seed0")
    assert cpu.method.init_from.endswith("sudoku_mdm_uncond/cpu/seed0/checkpoints/last.ckpt")
