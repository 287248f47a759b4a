"""Periodic checkpoints whose ``last.ckpt`` always ends at the run's final step and is never half written."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint (``every_n_train_steps``, ``save_last``) with two guarantees more:

    - a save at the final optimizer step: Lightning skips it when ``max_steps`` is not a multiple of
      ``every_n_train_steps``, which would leave a finished run's ``last.ckpt`` up to ``every_n_train_steps − 1``
      steps behind its final weights;
    - atomic sharded saves: a file checkpoint is already written to a temporary file and renamed by Lightning, but a
      sharded one (trainer=fsdp2 / fsdp) is a folder that every rank writes into. Here it goes to a new folder
      ``<name>.step<N>`` and, once every rank is done, ``<name>`` (a relative symlink) is switched to it with one
      ``os.replace``; the previous folder is removed after the switch. A crash at any point leaves ``last.ckpt``
      naming a complete checkpoint.
    """

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # noqa: D102
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        final = 0 < trainer.max_steps <= trainer.global_step
        if (
            final
            and self.save_last
            and self._last_global_step_saved != trainer.global_step
            and not self._should_skip_saving_checkpoint(trainer)
        ):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_checkpoint(self, trainer, filepath: str) -> None:
        if not writes_folders(trainer.strategy):
            return super()._save_checkpoint(trainer, filepath)
        target = Path(filepath)
        version = target.with_name(f"{target.name}.step{trainer.global_step:07d}")
        super()._save_checkpoint(trainer, str(version))
        self._last_checkpoint_saved = filepath
        trainer.strategy.barrier()  # every rank's shard is on disk
        if trainer.is_global_zero:
            switch_link(target, version)
        trainer.strategy.barrier()


def writes_folders(strategy) -> bool:
    """Whether this strategy saves a checkpoint as a folder of per-rank shards."""
    if isinstance(strategy, ModelParallelStrategy):
        return bool(strategy._save_distributed_checkpoint)
    if isinstance(strategy, FSDPStrategy):
        return strategy._state_dict_type == "sharded"
    return False


def switch_link(link: Path, version: Path) -> None:
    """Point ``link`` at ``version`` (a sibling) atomically, then remove every other ``<link>.step*`` sibling (the
    previous checkpoint, or a newer one a crash left unlinked). A plain file or folder at ``link`` (a checkpoint
    written before this scheme) is moved aside first and removed after the switch."""
    old = None
    if link.exists() and not link.is_symlink():
        old = link.with_name(f".{link.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        link.rename(old)
    tmp = link.with_name(f".{link.name}.link")
    tmp.unlink(missing_ok=True)
    os.symlink(version.name, tmp)  # relative: the run folder can be moved or copied
    os.replace(tmp, link)
    for sibling in link.parent.glob(f"{link.name}.step*"):
        if sibling.name != version.name:
            shutil.rmtree(sibling, ignore_errors=True)
    if old is not None and old.is_dir():
        shutil.rmtree(old)
    elif old is not None:
        old.unlink()
