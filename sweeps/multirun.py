"""A multirun around the trials (runners/trial.py): Hydra's callback that prepares the runs folder and the Optuna
storage, continues a relaunched study, and exits with status 1 when a trial failed."""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import uuid
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from runners.trial import FAILURES_ENV

log = logging.getLogger(__name__)


class SweepCallback(Callback):
    """Hydra callback: a multirun's runs folder, and its SQLite Optuna schema, exist before the sweeper opens it; a
    relaunched Optuna sweep continues its study with new proposals; a multirun in which any trial failed exits
    with status 1 once every trial has run."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:  # noqa: D102
        Path(config.paths.root).mkdir(parents=True, exist_ok=True)
        storage = OmegaConf.select(config, "hydra.sweeper.storage", default=None)
        if isinstance(storage, str) and storage.startswith("sqlite:///"):
            init_sqlite_storage(storage)
        continue_study(config)
        failures = Path(config.hydra.sweep.dir) / f".failed-{uuid.uuid4().hex}"  # this launch's, not a relaunch's
        failures.mkdir(parents=True)
        os.environ[FAILURES_ENV] = str(failures)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:  # noqa: D102
        folder = os.environ.pop(FAILURES_ENV, None)
        if not folder:
            return
        failed = {p.name: p.read_text() for p in sorted(Path(folder).iterdir())}
        shutil.rmtree(folder, ignore_errors=True)
        if failed:
            lines = "\n".join(f"  {trial}: {error.splitlines()[0] if error else ''}" for trial, error in failed.items())
            raise SystemExit(
                f"sweep {config.sweep.name}: {len(failed)} trial(s) failed (the others ran; a tracked trial is FAILED "
                f"in MLflow with its error in the tag flowlm.error):\n{lines}"
            )


def continue_study(config: DictConfig) -> None:
    """Seed the sampler of a relaunched Optuna sweep from (its seed, the trials its study holds) before the sweeper
    is built: with the first launch's seed it would propose the same points again, whose trials would reuse the
    earlier trials' folders and MLflow runs. A new study keeps the configured seed."""
    storage = OmegaConf.select(config, "hydra.sweeper.storage", default=None)
    study = OmegaConf.select(config, "hydra.sweeper.study_name", default=None)
    seed = OmegaConf.select(config, "hydra.sweeper.sampler.seed", default=None)
    if not isinstance(storage, str) or study is None or seed is None:
        return
    import numpy as np
    import optuna

    try:
        done = len(optuna.load_study(study_name=study, storage=storage).trials)
    except KeyError:  # no such study yet
        return
    if done:
        config.hydra.sweeper.sampler.seed = int(np.random.SeedSequence([int(seed), done]).generate_state(1)[0])
        log.info(
            "study %s holds %d trials: sampler seed %d, drawn from seed %s",
            study,
            done,
            config.hydra.sweeper.sampler.seed,
            seed,
        )


def init_sqlite_storage(url: str) -> None:
    """Create an Optuna SQLite file's schema under a file lock: workers launched together on a fresh file would
    otherwise race to create its tables and all but one crash (measured: 4 of 5 tries with two workers)."""
    import optuna

    path = Path(url.removeprefix("sqlite:///"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        optuna.storages.RDBStorage(url)  # creates the tables once; later workers find them
