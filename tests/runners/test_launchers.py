"""Launcher configs: local, joblib (parallel local trials) and SLURM (submitit) compose into Hydra's launchers."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from flowlm.project import CONF_DIR


def hydra_cfg(overrides: list[str]):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=True)


def test_slurm_launcher_asks_one_task_per_gpu():
    cfg = hydra_cfg(
        [
            "experiment=sudoku_mdm_medium",
            "launcher=slurm",
            "trainer=ddp",
            "trainer.devices=8",
            "+trainer.num_nodes=2",
            "hydra.launcher.partition=gpu",
        ]
    )
    launcher = cfg.hydra.launcher
    assert launcher._target_ == "hydra_plugins.hydra_submitit_launcher.submitit_launcher.SlurmLauncher"
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 8, 8)
    assert launcher.partition == "gpu" and launcher.max_num_timeout == 3


def test_joblib_and_local_launchers():
    assert hydra_cfg(["launcher=joblib"]).hydra.launcher._target_.endswith("JoblibLauncher")
    assert hydra_cfg([]).hydra.launcher._target_.endswith("BasicLauncher")
    assert hydra_cfg(["launcher=joblib", "hydra.launcher.n_jobs=4"]).hydra.launcher.n_jobs == 4


def test_joblib_runs_trials_in_parallel_processes(tmp_path):
    import subprocess
    import sys

    from tests.conftest import FAST

    cmd = [
        sys.executable,
        "-m",
        "runners.train",
        "-m",
        "launcher=joblib",
        "hydra.launcher.n_jobs=2",
        "experiment=sudoku_mdm_uncond",
        "scale=cpu",
        *FAST,
        "logger=none",
        "seed=0,1",
        f"paths.root={tmp_path / 'runs'}",
        f"paths.data_dir={tmp_path / 'data'}",
    ]
    env = {**__import__("os").environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=CONF_DIR + "/..")
    assert out.returncode == 0, out.stderr[-3000:]
    trials = sorted(tmp_path.glob("runs/sweeps/*/trial-*/checkpoints/last.ckpt"))
    assert len(trials) == 2, out.stdout[-2000:]
