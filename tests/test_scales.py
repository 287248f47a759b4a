"""Configs by scale: every experiment composes at every scale into its own run folder, MLflow experiment and sweep;
an MDM-based experiment's checkpoint is its source MDM's of the same seed and scale; a method pulls its family's
samplers; debug=fast is the tests' former hand-written speed overrides."""

from pathlib import Path

import pytest
from conftest import FAST, compose_config
from omegaconf import OmegaConf

from runners.paths import CONF_DIR

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


@pytest.mark.slow
def test_every_experiment_composes_at_every_scale_apart():
    assert {"paper", "cpu"} <= set(SCALES) and len(EXPERIMENTS) >= 40
    for experiment in EXPERIMENTS:
        apart = []
        for scale in SCALES:
            cfg = compose_config(overrides=[f"experiment={experiment}", f"scale={scale}"])
            assert cfg.name == experiment and cfg.scale.name == scale
            assert OmegaConf.select(cfg, "reference", default="absent") != "absent", f"{experiment}: no reference"
            apart.append((cfg.paths.run_dir, cfg.task, cfg.sweep.name))
            if cfg.source is not None:  # the source MDM's checkpoint, same seed and scale
                mdm = compose_config(overrides=[f"experiment={cfg.source}", f"scale={scale}"])
                assert mdm.method._target_.endswith("MDMModule")
                assert cfg.source_ckpt == str(Path(mdm.paths.run_dir, "checkpoints", "last.ckpt"))
                assert cfg.source_ckpt in (cfg.method.get("init_from"), cfg.method.get("teacher"))
        for i, what in enumerate(("run folder", "MLflow experiment", "sweep")):  # scales never share one
            assert len({a[i] for a in apart}) == len(SCALES), f"{experiment}: scales share a {what}: {apart}"


@pytest.mark.parametrize(
    ("overrides", "samplers"),
    [
        (["experiment=sudoku_mdm_easy"], {"ancestral", "confidence"}),
        (["experiment=sudoku_mdm_easy", "method=fmlm_plus_init", "method.init_from=x"], {"pr", "a_priori"}),
        (["experiment=sudoku_fmlm_plus_distill_hard"], {"pr", "a_priori"}),
        (["experiment=sudoku_mlfm_easy", "scale=cpu"], {"mlfm", "mlfm_ccfg", "mlfm_ccfg_otp"}),
        (["experiment=sudoku_ar_medium"], {"ar"}),
        (["experiment=owt_fmlm_plus_scratch", "scale=cpu"], {"pr", "a_priori"}),
        (["experiment=owt_mdm", "method=ar"], {"ar"}),
        (["experiment=gsm8k_mlfm"], {"mlfm", "mlfm_ccfg", "mlfm_ccfg_otp", "mlfm_w4_otp", "mlfm_w6_otp"}),
        (["experiment=tinygsm_mdm", "scale=cpu"], {"confidence"}),
    ],
)
def test_a_method_pulls_its_familys_samplers(overrides, samplers):
    assert set(compose_config(overrides=overrides).eval.samplers) == samplers


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
    assert list(paper.eval.nfe) == [1, 3, 9, 27, 81] and list(cpu.eval.nfe) == [1, 2, 3, 6, 12, 36]
    assert paper.task == "sudoku_uncond_9x9" and cpu.task == "sudoku_uncond_6x6"
    assert paper.method._target_ == cpu.method._target_ and paper.method.shares == cpu.method.shares
    assert paper.paths.run_dir.endswith("sudoku_fmlm_plus_init_uncond/paper/seed0")
    assert cpu.method.init_from.endswith("sudoku_mdm_uncond/cpu/seed0/checkpoints/last.ckpt")
