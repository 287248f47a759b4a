"""Periodic checkpoints whose ``last.ckpt`` always ends at the run's final step."""

from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint (atomic writes, ``every_n_train_steps``, ``save_last``), plus a save at the final
    optimizer step: Lightning skips it when ``max_steps`` is not a multiple of ``every_n_train_steps``, which would
    leave a finished run's ``last.ckpt`` up to ``every_n_train_steps − 1`` steps behind its final weights."""

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
