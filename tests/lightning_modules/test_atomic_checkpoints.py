"""Issue 15, item 1: a crash or a full disk during a checkpoint save never destroys the previous checkpoint, even when
the run folder is on another filesystem than the system temp folder (a local or tmpfs ``/tmp``, a shared ``runs/``).

The second filesystem is either simulated (``os.rename`` / ``os.replace`` raise EXDEV across the runs folder, as
they do at a mount point: runs on any machine) or real (a tmpfs mounted on the runs folder: root only). Faults hit
the bytes written into the checkpoints folder, whichever code writes them: Lightning's copy fallback or our
temporary file. ``SaveFaults`` brings them into a `flowlm-train` subprocess (``+callbacks.faults._target_=...``).
"""

from __future__ import annotations

import builtins
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from tests.conftest import FAST, compose_config
from tests.process_helpers import subprocess_env

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[2]
RUN_DIR = Path("sudoku_mdm_uncond", "cpu", "seed0")
# A checkpoint after every step, no evaluation before the last one: a few steps, a few saves, little else.
RUN = [
    "experiment=sudoku_mdm_uncond",
    "scale=cpu",
    *FAST,
    "logger=none",
    "callbacks.checkpoint.every_n_train_steps=1",
    "trainer.val_check_interval=3",
    "trainer.enable_progress_bar=false",
    "final_eval=false",
]
KILLED_AFTER = 1_000_000  # bytes of the second save (≈ 20 MB) written when the kill comes


# ------------------------------------------------------------------------------------------------ fault injection
def inject_cross_device(setattr_: Callable, boundary: Path) -> None:
    """Make ``boundary`` behave as a mount point: a rename between inside and outside fails with EXDEV."""
    boundary = Path(os.path.abspath(boundary))

    def inside(path) -> bool:
        return Path(os.path.abspath(os.fsdecode(path))).is_relative_to(boundary)

    def guarded(real: Callable) -> Callable:
        def rename(src, dst, *args, **kwargs):
            if inside(src) != inside(dst):
                raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), os.fsdecode(src), None, os.fsdecode(dst))
            return real(src, dst, *args, **kwargs)

        return rename

    setattr_(os, "rename", guarded(os.rename))  # shutil.move (fsspec's commit) calls os.rename
    setattr_(os, "replace", guarded(os.replace))


class _FaultyFile:
    """A file opened for writing that runs ``fault`` once ``limit`` bytes have reached it (those bytes flushed)."""

    def __init__(self, f, limit: int, fault: Callable[[], None]) -> None:
        self._f, self._limit, self._fault, self.written = f, limit, fault, 0

    def write(self, data) -> int:  # noqa: D102
        view = memoryview(data).cast("B")
        room = self._limit - self.written
        if len(view) >= room:
            self._f.write(view[:room])
            self._f.flush()
            self.written += room
            self._fault()
        n = self._f.write(view)
        self.written += n
        return n

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()

    def __getattr__(self, name: str):
        return getattr(self._f, name)


def inject_write_fault(setattr_: Callable, folder: Path, *, nth: int, after_bytes: int, action: str) -> dict:
    """The ``nth`` file opened for writing in ``folder`` gets ``action`` (``kill``: SIGKILL this process; ``enospc``:
    OSError ENOSPC) after ``after_bytes`` bytes; returns the counters (``opened``: paths in order)."""
    folder = Path(os.path.abspath(folder))
    state: dict = {"opened": []}
    real_open = builtins.open

    def fault() -> None:
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def open_(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and set(mode) & set("wax+"):
            path = Path(os.path.abspath(os.fsdecode(file)))
            if path.parent == folder:
                state["opened"].append(path)
                if len(state["opened"]) == nth:
                    return _FaultyFile(f, after_bytes, fault)
        return f

    setattr_(builtins, "open", open_)
    # Linux's shutil.copyfile copies with sendfile, past any Python write: make the copy fallback go through write().
    setattr_(shutil, "_USE_CP_SENDFILE", False)
    return state


class SaveFaults(Callback):
    """For a `flowlm-train` subprocess: a simulated mount point at ``boundary`` (when given) and a fault in the
    ``nth`` file written into ``folder`` (when given), installed as the callback is built, before any save."""

    def __init__(
        self,
        boundary: str | None = None,
        folder: str | None = None,
        nth: int = 1,
        after_bytes: int = KILLED_AFTER,
        action: str = "kill",
    ) -> None:
        if boundary:
            inject_cross_device(setattr, Path(boundary))
        if folder:
            inject_write_fault(setattr, Path(folder), nth=nth, after_bytes=after_bytes, action=action)


# ------------------------------------------------------------------------------------------------ helpers
def _env(root: Path) -> dict:
    # TMPDIR: where Lightning's own temporary file would go, outside the runs folder
    return subprocess_env(root, TMPDIR=str(_systmp(root)))


def _run(cmd: list[str], root: Path) -> subprocess.CompletedProcess:
    """Run ``cmd`` in its own session; whatever it leaves running (a DDP rank whose peer was killed) is killed."""
    proc = subprocess.Popen(
        cmd, env=_env(root), cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _systmp(root: Path) -> Path:
    path = root / "systmp"
    path.mkdir(exist_ok=True)
    return path


def _temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob(".*.tmp-*"))


def _step(path: Path) -> int:
    return torch.load(path, map_location="cpu", weights_only=False, mmap=True)["global_step"]


def _train(*overrides: str) -> dict:
    from runners.train import train

    return train(compose_config(overrides=[*RUN, *overrides]))


@pytest.fixture
def tmpfs_runs(tmp_path):
    """A 64 MB tmpfs mounted on ``tmp_path/runs`` (room for two ≈ 20 MB checkpoints): a real second filesystem."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root and mount(8)")
    runs = tmp_path / "runs"
    runs.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(runs)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield runs
    finally:
        if subprocess.run(["umount", str(runs)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(runs)], capture_output=True)  # busy: detach it now, free it later


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.parametrize("second_fs", ["injected_exdev", "tmpfs"])
def test_sigkill_during_a_cross_filesystem_save_keeps_the_previous_checkpoint(second_fs, runs_env, request):
    """SIGKILL while the step-2 checkpoint is written: last.ckpt still holds step 1 and the relaunch resumes from it
    (Lightning's fallback truncated last.ckpt, then copied: 1 000 000 bytes were left, the relaunch refused)."""
    root = runs_env
    ckpts = root / "runs" / RUN_DIR / "checkpoints"
    faults = [
        "+callbacks.faults._target_=tests.lightning_modules.test_atomic_checkpoints.SaveFaults",
        f"+callbacks.faults.folder={ckpts}",
    ]
    if second_fs == "tmpfs":
        request.getfixturevalue("tmpfs_runs")
        assert os.stat(root / "runs").st_dev != os.stat(_systmp(root)).st_dev
    else:
        faults.append(f"+callbacks.faults.boundary={root / 'runs'}")
    cmd = [str(BIN / "flowlm-train"), *RUN, "trainer.max_steps=3", *faults, "+callbacks.faults.nth=2"]
    killed = _run(cmd, root)
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-2000:] + killed.stderr[-3000:]

    from lightning_modules.checkpoints import verify_checkpoint

    last = ckpts / "last.ckpt"
    verify_checkpoint(last)  # complete: the kill came while the next one was written elsewhere
    assert _step(last) == 1
    (temp,) = _temps(ckpts)  # the killed save's partial file, beside its target
    assert (ckpts / temp).stat().st_size == KILLED_AFTER

    result = _train("trainer.max_steps=3")  # the relaunch: resumes from step 1 and removes the dead save's file
    assert result["global_step"] == 3 and _step(last) == 3
    verify_checkpoint(last)
    assert _temps(ckpts) == []
    assert not list(_systmp(root).iterdir())  # nothing went through the system temp folder


def test_saves_never_copy_across_filesystems_and_all_go_through_the_atomic_writer(runs_env, monkeypatch):
    """Every checkpoint (periodic files, last.ckpt, the final-step save RunCheckpoint adds) is written beside its
    target and renamed there; nothing is copied over a checkpoint when /tmp is another filesystem."""
    import callbacks.checkpoint as ckpt_module
    from lightning_modules.checkpoints import verify_checkpoint

    inject_cross_device(monkeypatch.setattr, runs_env / "runs")
    monkeypatch.setattr("tempfile.tempdir", str(_systmp(runs_env)))
    copies, saves = [], []
    real_copyfile, real_atomic_save = shutil.copyfile, getattr(ckpt_module, "atomic_save", None)

    def copyfile(src, dst, **kwargs):
        copies.append(Path(dst).name)
        return real_copyfile(src, dst, **kwargs)

    def atomic_save(obj, target: Path) -> None:
        saves.append((target.name, obj["global_step"]))
        real_atomic_save(obj, target)

    monkeypatch.setattr(shutil, "copyfile", copyfile)  # what shutil.move falls back to when a rename fails
    monkeypatch.setattr(ckpt_module, "atomic_save", atomic_save, raising=False)
    every_2 = ["callbacks.checkpoint.every_n_train_steps=2", "callbacks.checkpoint.save_top_k=-1"]
    result = _train("trainer.max_steps=3", *every_2)
    ckpts = Path(result["run_dir"], "checkpoints")
    assert copies == []
    # step 2: the periodic file and last.ckpt; step 3 (max_steps, not a multiple of 2): the final save of last.ckpt.
    assert saves == [("step0000002.ckpt", 2), ("last.ckpt", 2), ("last.ckpt", 3)]
    assert sorted(p.name for p in ckpts.iterdir()) == ["last.ckpt", "step0000002.ckpt"]
    for path in ckpts.iterdir():
        verify_checkpoint(path)


def test_disk_full_during_a_save_keeps_the_previous_checkpoint_and_stops_the_run(runs_env):
    """ENOSPC after 1 MB of the new checkpoint: the run stops with CheckpointSaveError naming the folder and the room a
    save needs; the previous last.ckpt is byte for byte intact, no partial file is left; once there is room again the
    relaunch resumes from it (Lightning's fallback had truncated last.ckpt to the 1 MB written)."""
    first = _train("trainer.max_steps=1")
    ckpts = Path(first["run_dir"], "checkpoints")
    before = (ckpts / "last.ckpt").read_bytes()

    with pytest.MonkeyPatch.context() as faults, pytest.raises(OSError) as failed:  # runs_env's patches stay
        inject_cross_device(faults.setattr, runs_env / "runs")
        faults.setattr("tempfile.tempdir", str(_systmp(runs_env)))
        inject_write_fault(faults.setattr, ckpts, nth=1, after_bytes=1_000_000, action="enospc")
        _train("trainer.max_steps=3")
    assert (ckpts / "last.ckpt").read_bytes() == before
    assert _temps(ckpts) == []

    from callbacks.checkpoint import CheckpointSaveError

    assert isinstance(failed.value, CheckpointSaveError) and failed.value.errno == errno.ENOSPC
    message = str(failed.value)
    for part in (
        f"could not save checkpoint {ckpts / 'last.ckpt'}: No space left on device (after writing 1000000 bytes)",
        f"the previous last.ckpt ({len(before)} bytes) is intact",
        f"bytes are free in {ckpts}",
        f"room for one more checkpoint (about {len(before)} bytes",
        "relaunch the same command",
    ):
        assert part in message, message

    result = _train("trainer.max_steps=3")  # the disk has room again
    assert result["global_step"] == 3 and _step(ckpts / "last.ckpt") == 3


@pytest.mark.skipif(sys.platform != "linux", reason="names open files through /proc/self/fd")
def test_atomic_save_syncs_the_file_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    """The order that makes a save durable: write, fsync the file, os.replace beside it, fsync the folder."""
    from callbacks.checkpoint import atomic_save, temp_path

    target = tmp_path / "last.ckpt"
    target.write_bytes(b"previous")
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.path.realpath(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst) -> None:
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    atomic_save({"w": torch.arange(4)}, target)
    tmp = temp_path(target)
    assert tmp.parent == target.parent and tmp.name == f".last.ckpt.tmp-{socket.gethostname()}-{os.getpid()}"
    tmp, target_, folder = (os.path.realpath(p) for p in (tmp, target, tmp_path))
    assert events == [("fsync", tmp), ("replace", tmp, target_), ("fsync", folder)]
    assert torch.equal(torch.load(target)["w"], torch.arange(4)) and not os.path.exists(tmp)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), OSError("device went away")])
def test_an_interrupted_save_removes_its_file_and_keeps_the_error(error, tmp_path, monkeypatch):
    """Ctrl-C mid-save stays a KeyboardInterrupt; any OSError becomes CheckpointSaveError; no partial file is left."""
    from callbacks.checkpoint import CheckpointSaveError, atomic_save

    target = tmp_path / "last.ckpt"
    target.write_bytes(b"previous")

    def dying_save(obj, f) -> None:
        f.write(b"x" * 1000)
        try:
            raise OSError(errno.EIO, "a retried write")
        except OSError:
            raise error from None  # its context stays: an interrupt must not pass for the OSError it interrupted

    monkeypatch.setattr(torch, "save", dying_save)
    with pytest.raises(CheckpointSaveError if isinstance(error, OSError) else KeyboardInterrupt) as raised:
        atomic_save({}, target)
    assert target.read_bytes() == b"previous" and sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    if isinstance(error, OSError):
        assert str(raised.value) == (
            f"could not save checkpoint {target}: device went away (after writing 1000 bytes); the previous "
            "last.ckpt (8 bytes) is intact"
        )


def test_stale_temporary_files_of_dead_saves_are_removed_and_live_ones_kept(tmp_path):
    """A killed save's file goes at the next save (its process is gone, or is this one: a relaunch in a container may
    get the same pid); a file another live process is writing stays, as does another host's fresh one."""
    from callbacks.checkpoint import STALE_AFTER_S, atomic_save

    host = socket.gethostname()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = {
            "dead": f".last.ckpt.tmp-{host}-{dead.pid}",
            "own": f".step0000002.ckpt.tmp-{host}-{os.getpid()}",
            "alive": f".last.ckpt.tmp-{host}-{alive.pid}",
            "other host, fresh": ".last.ckpt.tmp-elsewhere.example-12",
            "other host, abandoned": ".last.ckpt.tmp-elsewhere.example-13",
            "not ours": ".last.ckpt.tmp-notes",
        }
        for name in names.values():
            (tmp_path / name).write_bytes(b"partial")
        old = time.time() - STALE_AFTER_S - 60
        os.utime(tmp_path / names["other host, abandoned"], (old, old))
        atomic_save({"step": 1}, tmp_path / "last.ckpt")
        kept = {p.name for p in tmp_path.iterdir()}
    finally:
        alive.kill()
        alive.wait()
    assert kept == {"last.ckpt", names["alive"], names["other host, fresh"], names["not ours"]}


def test_the_trainer_saves_through_the_atomic_io_on_every_file_strategy():
    """RunCheckpoint puts AtomicCheckpointIO in place of Lightning's default on one process, DDP (rank 0 writes:
    Strategy.save_checkpoint) and an FSDP2 run with full-state files; another configured IO is kept, with a warning."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy, SingleDeviceStrategy

    from callbacks.checkpoint import AtomicCheckpointIO, use_atomic_io

    for strategy in (
        SingleDeviceStrategy(device=torch.device("cpu")),
        DDPStrategy(),
        ModelParallelStrategy(save_distributed_checkpoint=False),
    ):
        use_atomic_io(strategy)
        assert type(strategy.checkpoint_io) is AtomicCheckpointIO, strategy

    class Custom(TorchCheckpointIO):
        pass

    strategy = DDPStrategy(checkpoint_io=Custom())
    with pytest.warns(UserWarning, match="checkpoint IO is Custom: RunCheckpoint keeps it"):
        use_atomic_io(strategy)
    assert type(strategy.checkpoint_io) is Custom


@pytest.mark.slow
def test_ddp_rank_zero_saves_atomically_across_filesystems(tmp_path):
    """2-process CPU DDP with /tmp on another (simulated) filesystem: rank 0's saves are renamed beside their target;
    a save at step 2 killed by SIGKILL leaves step 1's last.ckpt, which a DDP relaunch resumes."""
    from lightning_modules.checkpoints import verify_checkpoint

    ckpts = tmp_path / "runs" / RUN_DIR / "checkpoints"
    ddp = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"]
    faults = [
        "+callbacks.faults._target_=tests.lightning_modules.test_atomic_checkpoints.SaveFaults",
        f"+callbacks.faults.boundary={tmp_path / 'runs'}",
        f"+callbacks.faults.folder={ckpts}",
        "+callbacks.faults.nth=2",
    ]
    cmd = [str(BIN / "flowlm-train"), *RUN, *ddp, "trainer.max_steps=3"]
    killed = _run([*cmd, *faults], tmp_path)
    assert killed.returncode != 0, killed.stdout[-2000:] + killed.stderr[-3000:]
    verify_checkpoint(ckpts / "last.ckpt")
    assert _step(ckpts / "last.ckpt") == 1
    resumed = _run(cmd, tmp_path)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-3000:]
    assert "Restored all states from the checkpoint" in resumed.stdout + resumed.stderr
    assert _step(ckpts / "last.ckpt") == 3 and _temps(ckpts) == []
