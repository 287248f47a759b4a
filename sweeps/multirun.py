"""A multirun around the trials (runners/trial.py): Hydra's callback that prepares the runs folder and the Optuna
storage, continues a relaunched study, ends with one summary line, and exits with status 1 when a trial failed."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import uuid
from enum import Enum
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from runners.console import callback_errors
from runners.objectives import objective_keys
from runners.outputs import check_writable
from runners.trial import DONE_SUFFIX, NOTES_ENV

log = logging.getLogger(__name__)


class SweepCallback(Callback):
    """Hydra callback: a multirun's runs folder, and its SQLite Optuna schema, exist before the sweeper opens it; a
    relaunched Optuna sweep continues its study with new proposals; a multirun ends with one line naming its
    folder, its trials (done / failed) and the best objective value (``summary_line``), and exits with status 1
    once every trial has run if any failed."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:  # noqa: D102
        with callback_errors():  # an error here stops the sweep before any trial (Hydra would only warn)
            check_writable("paths.root", config.paths.root)
            Path(config.paths.root).mkdir(parents=True, exist_ok=True)
            storage = OmegaConf.select(config, "hydra.sweeper.storage", default=None)
            if isinstance(storage, str) and storage.startswith("sqlite:///"):
                init_sqlite_storage(storage)
            continue_study(config)
        notes = Path(config.hydra.sweep.dir) / f".trials-{uuid.uuid4().hex}"  # this launch's, not a relaunch's
        notes.mkdir(parents=True)
        os.environ[NOTES_ENV] = str(notes)

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:  # noqa: D102
        folder = os.environ.pop(NOTES_ENV, None)
        if not folder:
            return
        done, failed = {}, {}
        for path in sorted(Path(folder).iterdir()):
            if path.name.endswith(DONE_SUFFIX):
                done[path.name.removesuffix(DONE_SUFFIX)] = json.loads(path.read_text())
            else:
                failed[path.name] = path.read_text()
        shutil.rmtree(folder, ignore_errors=True)
        print(summary_line(config, done, failed), flush=True)
        if failed:
            lines = "\n".join(f"  {trial}: {error.splitlines()[0] if error else ''}" for trial, error in failed.items())
            raise SystemExit(
                f"sweep {config.sweep.name}: {len(failed)} trial(s) failed (the others ran; a tracked trial is FAILED "
                f"in MLflow with its error in the tag flowlm.error):\n{lines}"
            )


def summary_line(config: DictConfig, done: dict[str, dict], failed: dict[str, str]) -> str:
    """``sweep <name> (<folder>): <n> trials, <d> done, <f> failed`` and, when the sweep has an objective, the best
    value of each (in the sweeper's direction; the basic sweeper optimises nothing: the range of values, with the
    trials at its ends). ``done`` maps a trial's folder name to ``{"trial": <number>, "values": [...]}``, as the
    trials note them (runners/trial.py)."""
    folder = Path(str(config.hydra.sweep.dir)).resolve()
    total = len(done) + len(failed)
    trials = f"{total} trial{'' if total == 1 else 's'}"
    line = f"sweep {config.sweep.name} ({folder}): {trials}, {len(done)} done, {len(failed)} failed"
    keys = objective_keys(OmegaConf.select(config, "optimized_metric", default=None))
    if not keys:
        return line
    # in trial order: of equal values, the first trial is the best, as Optuna's best_trial has it
    scored = sorted(
        (note["trial"], name, note["values"]) for name, note in done.items() if len(note["values"]) == len(keys)
    )
    if not scored:
        return f"{line}; no trial finished"
    direction = OmegaConf.select(config, "hydra.sweeper.direction", default=None)
    directions = [direction] if isinstance(direction, str | Enum) else list(direction or [])
    directions = [d.name if isinstance(d, Enum) else str(d) for d in directions]
    parts = []
    for i, key in enumerate(keys):
        low = min(scored, key=lambda trial: trial[2][i])  # noqa: B023 - used within this iteration
        high = max(scored, key=lambda trial: trial[2][i])  # noqa: B023
        low_text, high_text = (f"{v[i]:.6g} (trial {number}, {name})" for number, name, v in (low, high))
        if len(directions) == len(keys):
            parts.append(f"best {key} = {high_text if directions[i] == 'maximize' else low_text}")
        else:  # the basic sweeper: nothing was optimised
            parts.append(f"{key} from {low_text} to {high_text}")
    return f"{line}; {'; '.join(parts)}"


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
    otherwise race to create its tables and all but one crash (measured: 4 of 5 tries with two workers). A folder or
    file that cannot be written is refused first, naming ``hydra.sweeper.storage``."""
    import optuna

    path = Path(url.removeprefix("sqlite:///"))
    # its folder holds the lock and SQLite's journal: a read-only one failed in the sweeper, in sqlalchemy's words
    check_writable("hydra.sweeper.storage", path.parent, files=[path])
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        optuna.storages.RDBStorage(url)  # creates the tables once; later workers find them
