"""Periodic checkpoints whose ``last.ckpt`` always ends at the run's final step and is never half written."""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import torch
from fsspec.core import url_to_fs
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from lightning.pytorch.utilities import rank_zero_warn

# A file save in progress: ``.<target name>.tmp-<host>-<pid>``, beside its target (the rename never crosses a
# filesystem). The leading dot and the suffix keep it out of Lightning's ``last*.ckpt`` and the suite's ``*.ckpt``.
_TEMP = re.compile(r"^\.(?P<target>.+)\.tmp-(?P<host>.*)-(?P<pid>\d+)$")
# A temporary file of another host whose process cannot be asked whether it lives counts as abandoned once it has
# not been written for this long (a save in progress writes continuously).
STALE_AFTER_S = 3600.0
# Errors that mean the folder cannot hold one more checkpoint beside the current one.
_NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


class CheckpointSaveError(OSError):
    """A checkpoint file could not be written; whatever was at its path before (the previous checkpoint) is intact."""


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint (``every_n_train_steps``, ``save_last``) with four guarantees more:

    - a save at the final optimizer step: Lightning skips it when ``max_steps`` is not a multiple of
      ``every_n_train_steps``, which would leave a finished run's ``last.ckpt`` up to ``every_n_train_steps − 1``
      steps behind its final weights;
    - atomic file saves on any filesystem layout: the trainer's checkpoint IO becomes ``AtomicCheckpointIO``, which
      writes the new file beside its target, fsyncs it and renames it over the target. Lightning's own IO writes its
      temporary file in the system temp folder; when that is another filesystem than the run folder (a local or tmpfs
      ``/tmp``, a shared ``runs/``) the rename fails and it truncates the target and copies over it, so a crash or a
      full disk during the copy destroyed the only ``last.ckpt``. A failed save raises ``CheckpointSaveError`` (the
      run stops: it does not go on without checkpoints) and leaves the previous file intact;
    - atomic sharded saves: a sharded checkpoint (trainer=fsdp2) is a folder that every rank writes into. Here
      it goes to a new folder ``<name>.step<N>`` and, once every rank is done, ``<name>`` (a relative symlink) is
      switched to it with one ``os.replace``; the previous folder is removed after the switch;
    - the checkpoint of a step that is validated is written after that validation, so it holds what the validation
      recorded (``Convergence``'s history: a relaunch otherwise lacked that point, and a run with ``stop=true``
      stopped later than the uninterrupted one). Lightning writes ``every_n_train_steps`` checkpoints at the batch's
      end, before the validation, and a relaunch from one skips that validation.

    A crash at any point leaves ``last.ckpt`` naming a complete checkpoint; temporary files that a killed process
    left behind are removed at the next save, or when a relaunch sets up this callback.
    """

    # The hook arguments of a batch whose saves wait for the validation that follows it.
    _after_validation: tuple | None = None

    @property
    def state_key(self) -> str:
        """Lightning's key with the file-name pattern in it: two of these in one trainer may share an interval (the
        Sudoku tables' ``curve`` checkpoints beside the resume checkpoint), which Lightning's key alone refuses."""
        return self._generate_state_key(
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=self._every_n_train_steps,
            every_n_epochs=self._every_n_epochs,
            train_time_interval=self._train_time_interval,
            filename=self.filename,
        )

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Resolve the folder (Lightning), route the trainer's file saves through ``AtomicCheckpointIO``, and remove
        temporary files of killed saves (rank 0)."""
        super().setup(trainer, pl_module, stage)
        use_atomic_io(trainer.strategy)
        if trainer.is_global_zero and self.dirpath and _is_local_file_protocol(self.dirpath):
            remove_stale_temps(Path(self.dirpath))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        """Lightning's periodic save and the final-step save; when a validation follows this batch, both wait for
        its end (``on_validation_end``)."""
        if validates_after_batch(trainer):
            self._after_validation = (outputs, batch, batch_idx)
            return
        self._save_at_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_end(self, trainer, pl_module) -> None:
        """The saves of the batch that this validation follows, then Lightning's own (none once this step is saved).

        Callbacks that record the validation (``Convergence``'s history, the EMA swapped back) have run by now:
        Lightning calls checkpoint callbacks last. A relaunch from this checkpoint resumes after the validation
        (Lightning's loop: ``RESTARTED_ON_LAST``, the step's validation is not run again) and trains the next step.
        """
        deferred, self._after_validation = self._after_validation, None
        if deferred is not None:
            self._save_at_batch_end(trainer, pl_module, *deferred)
        super().on_validation_end(trainer, pl_module)

    def _save_at_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
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
            return super()._save_checkpoint(trainer, filepath)  # a file: strategy.checkpoint_io (AtomicCheckpointIO)
        target = Path(filepath)
        version = target.with_name(f"{target.name}.step{trainer.global_step:07d}")
        super()._save_checkpoint(trainer, str(version))
        self._last_checkpoint_saved = filepath
        trainer.strategy.barrier()  # every rank's shard is on disk
        if trainer.is_global_zero:
            switch_link(target, version)
        trainer.strategy.barrier()


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's TorchCheckpointIO with local saves that are atomic whatever filesystem the system temp folder is
    on (``atomic_save``); remote paths (fsspec URLs) keep Lightning's transaction, loading and removal are
    Lightning's."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        """Write ``checkpoint`` to ``path``: the previous file there stays complete until the new one is."""
        if storage_options is not None or not _is_local_file_protocol(path):
            return super().save_checkpoint(checkpoint, path, storage_options)  # Lightning's errors and remote writes
        _, local = url_to_fs(str(path))  # a file:// URL as a plain path
        atomic_save(checkpoint, Path(local))


def validates_after_batch(trainer) -> bool:
    """Whether the training loop validates right after the batch that just ended, at its step (Lightning's own
    test, as ``_TrainingEpochLoop.on_advance_end`` makes it after the batch's hooks, and a validation set)."""
    loop = trainer.fit_loop.epoch_loop
    batches = trainer.num_val_batches
    batches = sum(batches) if isinstance(batches, list) else batches
    return bool(batches) and loop._should_check_val_fx(trainer.fit_loop._data_fetcher)


def use_atomic_io(strategy: Strategy) -> None:
    """Make ``strategy`` save files through ``AtomicCheckpointIO`` unless it was given another checkpoint IO."""
    current = strategy.checkpoint_io  # Lightning's default TorchCheckpointIO when none was configured
    if isinstance(current, AtomicCheckpointIO):
        return
    if type(current) is TorchCheckpointIO:
        strategy.checkpoint_io = AtomicCheckpointIO()
    elif not writes_folders(strategy):
        rank_zero_warn(
            f"the trainer's checkpoint IO is {type(current).__name__}: RunCheckpoint keeps it, so file checkpoints are "
            "not guaranteed to be written atomically (AtomicCheckpointIO)"
        )


def atomic_save(obj: object, target: Path) -> None:
    """``torch.save(obj)`` to ``target`` so that at every moment ``target`` is either its previous complete content
    or the new complete file: written to a temporary file beside it, flushed and fsynced, then ``os.replace``d onto
    it, then the folder fsynced. On failure the temporary file is removed and ``CheckpointSaveError`` raised."""
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(folder)
    tmp = temp_path(target)
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, target)  # same folder, so same filesystem: one atomic rename, never a copy
    except BaseException as err:  # an interrupt too: leave no half-written file behind
        written = tmp.stat().st_size if tmp.exists() else 0
        tmp.unlink(missing_ok=True)
        cause = _os_error(err) if isinstance(err, Exception) else None  # an interrupt stays an interrupt
        if cause is None:
            raise
        message = _save_error(target, cause, written)
        args = (message,) if cause.errno is None else (cause.errno, message)  # no "[Errno None]" in the message
        raise CheckpointSaveError(*args) from err
    fsync_dir(folder)  # the rename itself survives a power loss (the new file is in place either way)


def check_folder(folder: Path, need_bytes: int) -> None:
    """Refuse, before training, a checkpoint folder that cannot be written, or whose filesystem has less free space
    than one checkpoint of about ``need_bytes`` (a save writes the new file beside the previous one)."""
    existing = folder
    while not existing.exists():  # the folder, or the nearest parent that exists (the first save makes the rest)
        existing = existing.parent
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):  # False on a read-only mount, too
        raise CheckpointSaveError(
            errno.EACCES,
            f"cannot write checkpoints to {folder}: {existing} is not a writable folder (read-only filesystem or "
            "permissions); make it writable, or set paths.root (or callbacks.checkpoint.dirpath) to one that is",
        )
    free = shutil.disk_usage(existing).free
    if free < need_bytes:
        raise CheckpointSaveError(
            errno.ENOSPC,
            f"cannot write checkpoints to {folder}: its filesystem has {free / 2**20:.1f} MiB free, less than one "
            f"checkpoint of this model (≈ {need_bytes / 2**20:.1f} MiB); free some space, or set paths.root (or "
            "callbacks.checkpoint.dirpath) to a filesystem with room",
        )


def temp_path(target: Path) -> Path:
    """The temporary file this process writes ``target``'s next content to (same folder, hidden)."""
    return target.with_name(f".{target.name}.tmp-{socket.gethostname()}-{os.getpid()}")


def remove_stale_temps(folder: Path) -> list[Path]:
    """Remove the temporary files of saves that cannot finish any more (``is_stale_temp``); returns them."""
    removed = []
    for path in folder.glob(".*.tmp-*"):
        if _TEMP.match(path.name) and path.is_file() and is_stale_temp(path):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def is_stale_temp(path: Path) -> bool:
    """Whether a temporary checkpoint file belongs to no save in progress: its process (on this host) is gone or is
    this one (which saves one file at a time, and a relaunch in a container often gets the killed process's pid),
    or, from another host, it has not been written for ``STALE_AFTER_S``."""
    match = _TEMP.match(path.name)
    if match is None:
        return False
    pid = int(match["pid"])
    if match["host"] == socket.gethostname():
        return pid == os.getpid() or not _alive(pid)
    try:
        return time.time() - path.stat().st_mtime > STALE_AFTER_S
    except FileNotFoundError:
        return False


def fsync_dir(folder: Path) -> None:
    """fsync a folder (its entries: a rename into it), where the filesystem supports it."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a platform without directory handles (Windows): nothing to sync
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):  # some filesystems do not sync folders
            raise
    finally:
        os.close(fd)


def _os_error(err: BaseException) -> OSError | None:
    # torch's archive writer turns a failed write (ENOSPC) into a RuntimeError whose context is the OSError.
    seen = 0
    while err is not None and seen < 8:
        if isinstance(err, OSError):
            return err
        err, seen = err.__cause__ or err.__context__, seen + 1
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _save_error(target: Path, err: OSError, written: int) -> str:
    if target.is_file():
        previous = f"the previous {target.name} ({target.stat().st_size} bytes) is intact"
    else:
        previous = f"there was no previous {target.name}"
    message = f"could not save checkpoint {target}: {err.strerror or err} (after writing {written} bytes); {previous}"
    if err.errno in _NO_SPACE:
        free = shutil.disk_usage(target.parent).free
        size = f" (about {target.stat().st_size} bytes, as the previous one)" if target.is_file() else ""
        message += (
            f". {free} bytes are free in {target.parent}: a save writes the whole new checkpoint beside the previous "
            f"one before replacing it, so the folder needs room for one more checkpoint{size}. Free some space, then "
            "relaunch the same command: the run resumes from its last complete checkpoint"
        )
    return message


def writes_folders(strategy) -> bool:
    """Whether this strategy saves a checkpoint as a folder of per-rank shards."""
    if isinstance(strategy, ModelParallelStrategy):
        return bool(strategy._save_distributed_checkpoint)
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
