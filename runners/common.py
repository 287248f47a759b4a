"""Helpers shared by the console scripts: run folders (lock, identity, resume checks), config checks, building
components. The project and config folders are in flowlm/project.py, a run's MLflow record in runners/mlflow_run.py."""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf, open_dict

from flowlm.options import as_bool, as_int
from flowlm.redaction import redact, redact_uri
from runners.resolvers import check_run_parts

log = logging.getLogger(__name__)
# `flowlm-eval`'s default data (conf/eval.yaml): the checkpoint's recorded data config. An open (non-struct) node, so
# that `data.<key>=...` sets single keys of that config, which runners/evaluate.py merges onto it.
ConfigStore.instance().store(group="data", name="from_checkpoint", node=OmegaConf.create({}, flags={"struct": False}))
RUN_CONFIG = "run_config.yaml"
IF_EXISTS = ("resume", "error")  # what a launch does with a run folder that holds a checkpoint (conf/train.yaml)
# Sections that define what a run trains; a resumed run must agree on them (data knobs that do not change the
# model or the data, such as worker counts or an evaluation file, may differ).
IDENTITY_SECTIONS = ("method", "backbone", "data")
VOLATILE_DATA_KEYS = (
    "num_workers",
    "gen_workers",
    "num_proc",
    "cache_dir",
    "hf_cache_dir",
    "eval_file",
    "val_batch_size",
)


def is_rank_zero() -> bool:
    """True in the process that owns the run folder and the tracking run (rank 0 of a DDP job)."""
    from lightning.pytorch.utilities import rank_zero_only  # here: the console scripts' `--help` needs no Lightning

    return rank_zero_only.rank == 0


def check_run_name(cfg: DictConfig) -> None:
    """Refuse, before the run writes anything, a ``name`` that is not one folder name, or a ``run_name`` with a part
    that is not (``runs/<name>/<run_name>``: ``name=../escape`` put the run outside the runs folder, ``name=a/b``
    nested it, ``name=.hidden`` hid it). ``run_name`` may hold several parts (``cpu/seed0``, a sweep's trials). The
    same rule guards ``paths.run_dir`` as it is composed (``${flowlm.run_dir:...}``), before Hydra makes the folder."""
    check_run_parts(str(cfg.name), str(cfg.run_name))


def check_budgets(eval_cfg: DictConfig) -> None:
    """Refuse, before anything is built, an ``eval.nfe`` that is not a list of integers ≥ 1 (``eval.nfe=[1.5]`` ran
    as 1, ``eval.nfe=abc`` failed as "invalid literal for int()"). Each sampler's ``check_budget`` refuses a budget
    above its cap once the data's length is known (flowlm/samplers/base.py, ``BUDGET_PER_POSITION``)."""
    nfe = eval_cfg.get("nfe")
    budgets = OmegaConf.to_container(nfe, resolve=True) if OmegaConf.is_config(nfe) else nfe
    if not isinstance(budgets, list) or not budgets:
        raise ValueError(f"eval.nfe must be a list of NFE budgets, such as eval.nfe=[4,16]; got {budgets!r}")
    for budget in budgets:
        if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
            raise ValueError(
                f"eval.nfe holds {budget!r}, which is not an NFE budget: each must be an integer ≥ 1 (network "
                "evaluations per sample)"
            )


_ABSENT = object()
# The switches of flowlm-train's and flowlm-eval's configs (conf/train.yaml, conf/eval.yaml, conf/logger), each read
# as `if cfg.x:`: `final_eval=no` skipped nothing, `sweep.continue_on_error=no` went on after a failing trial.
RUN_SWITCHES = (
    *("compile", "activation_checkpointing", "final_eval", "tf32", "sweep.continue_on_error"),
    *("logger.resilient", "logger.log_model"),
)


def check_switches(cfg: DictConfig, keys: tuple[str, ...]) -> None:
    """Set each switch ``keys`` names (dotted) to a real boolean, before anything is read or written: Hydra keeps
    ``trust_pickle=no`` or ``overwrite=no`` a string, which is truthy; an unclear value (``maybe``) is a ValueError
    naming the option (``flowlm.options.as_bool``). A key the config does not hold is left alone (``logger=null``);
    ``logger.log_model`` may also be MLflow's ``all``."""
    for key in keys:
        given = OmegaConf.select(cfg, key, default=_ABSENT)
        if given is _ABSENT or (key == "logger.log_model" and given == "all"):
            continue
        value = as_bool(key, given)
        with open_dict(cfg):
            OmegaConf.update(cfg, key, value, merge=False)


def check_seeds(cfg: DictConfig) -> None:
    """Refuse, before anything is built, a ``seed`` or ``eval.seed`` that is not an integer (``seed=1.5`` failed
    inside sampling with torch's message, ``seed=abc`` without naming ``seed``); a string of one becomes the int."""
    for key in ("seed", "eval.seed"):
        node, _, leaf = key.rpartition(".")
        parent = OmegaConf.select(cfg, node) if node else cfg
        if parent is None or parent.get(leaf) is None or OmegaConf.is_interpolation(parent, leaf):
            continue  # unset (flowlm-eval: the checkpoint's), or ${seed}: checked as seed
        value = as_int(key, parent[leaf])
        with open_dict(cfg):
            OmegaConf.update(cfg, key, value, merge=False)


def redact_hydra_output() -> None:
    """Take URI passwords (``logger.tracking_uri=postgresql://user:secret@host/db``) out of the files Hydra wrote into
    its output folder before the task ran (``.hydra/config.yaml``, ``overrides.yaml``, ``hydra.yaml``: the command
    line's overrides as given; a multirun's ``multirun.yaml``); none when the task runs outside Hydra."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    if not HydraConfig.initialized():
        return
    hydra_cfg = HydraConfig.get()
    files = []
    if hydra_cfg.output_subdir:
        files += (Path(hydra_cfg.runtime.output_dir) / hydra_cfg.output_subdir).glob("*.yaml")
    if hydra_cfg.mode == RunMode.MULTIRUN:
        files.append(Path(hydra_cfg.sweep.dir) / "multirun.yaml")
    for path in files:
        if not path.is_file():
            continue
        text = path.read_text()
        if redact_uri(text) != text:
            tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
            tmp.write_text(redact_uri(text))
            os.replace(tmp, path)


SIGTERM_STATUS = 128 + signal.SIGTERM  # the shell's status of a process ended by SIGTERM (143)


def exit_on_sigterm(err: BaseException, stopped: str) -> None:
    """Raise ``SystemExit(143)`` for Lightning's ``SIGTERMException`` (what a run stopped by SIGTERM raises: a bare
    ``SystemExit``, so the process exited 0 and ``flowlm-train ... && next`` went on after a preempted run); log
    ``stopped``, what was stopped and how to go on. Any other error is left to the caller to re-raise."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    if isinstance(err, SIGTERMException):
        log.error("stopped by SIGTERM: %s; exit status %d", stopped, SIGTERM_STATUS)
        raise SystemExit(SIGTERM_STATUS) from err


@contextmanager
def sampling_stops_on_sigterm(trainer) -> Iterator[None]:
    """Within the block, a sampler stops before its next network call once ``trainer`` has received SIGTERM (raising
    Lightning's ``SIGTERMException``, which ``exit_on_sigterm`` maps to status 143): Lightning itself only looks
    between batches, and one batch of a large budget samples for minutes (flowlm/samplers/interrupt.py)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from flowlm.samplers.interrupt import stop_check  # here: importing flowlm.samplers imports torch

    def check() -> None:
        if trainer.received_sigterm:
            raise SIGTERMException

    with stop_check(check):
        yield


def resolve_paths(cfg: DictConfig) -> None:
    """Make the runs and data folders absolute (the MLflow SQLite URI and cache keys depend on them)."""
    for key in ("root", "data_dir"):
        cfg.paths[key] = str(Path(cfg.paths[key]).expanduser().resolve())
    OmegaConf.resolve(cfg)


def _identity(cfg: DictConfig | dict) -> dict:
    data = redact(OmegaConf.to_container(OmegaConf.create(cfg), resolve=True))  # as run_config.yaml holds it
    out = {k: data.get(k) for k in IDENTITY_SECTIONS}
    if isinstance(out.get("data"), dict):
        out["data"] = {k: v for k, v in out["data"].items() if k not in VOLATILE_DATA_KEYS}
    return out


class RunExistsError(RuntimeError):
    """The run folder holds a run that this command must not resume or overwrite."""


class RunLockedError(RunExistsError):
    """Another live process trains this run folder (it holds the folder's lock)."""


# One process per run folder: an exclusive flock on this file, taken before the folder is read or written. On NFS,
# Linux clients (kernel ≥ 2.6.12) send flock to the server as a whole-file POSIX lock (NFSv4, or NFSv3 with lockd),
# so launches on different hosts exclude each other, unless the share is mounted with local_lock=flock or all
# (then flock is local to each host); Lustre needs its `flock` mount option.
LOCK_FILE = "run.lock"
_STARTED = time.strftime("%Y-%m-%dT%H:%M:%S%z")  # this module loads at the start of a console script
# Run folder → open descriptor of its lock file. The descriptor stays open for the life of the process: the kernel
# drops the lock when the process ends in any way (SIGKILL and OOM kills included), so a lock cannot go stale.
_held: dict[Path, int] = {}


def _holder_info() -> dict:
    command = redact_uri(" ".join(sys.argv))[:2000]  # run.lock is a file: no URI's password
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": _STARTED, "command": command}


def _describe_holder(text: str) -> str:
    try:
        info = json.loads(text)
    except ValueError:
        return "a process that did not record itself (it may be starting)"
    out = f"pid {info.get('pid')} on {info.get('host')}, started {info.get('started')}, command: {info.get('command')}"
    if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int):
        try:
            os.kill(info["pid"], 0)
        except ProcessLookupError:  # the lock outlives its writer only while a child still holds the descriptor
            out += f" (pid {info['pid']} has exited; a process it started still holds the lock)"
        except PermissionError:
            pass
    return out


def lock_run_dir(run_dir: Path | str) -> bool:
    """Flock ``<run_dir>/run.lock`` for this process without waiting (True: taken now, False: held already), or
    raise RunLockedError naming the holder."""
    # Re-entrant per process (an in-process resume, the demo's runs); forked children drop their copy (at-fork hook).
    run_dir = Path(run_dir).resolve()
    path = run_dir / LOCK_FILE
    fd = _held.get(run_dir)
    if fd is not None:
        try:
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                return False
        except FileNotFoundError:  # the lock file (or its folder) was deleted under us: take a new one
            pass
        release_run_dir(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        holder = os.pread(fd, 1 << 16, 0).decode(errors="replace")
        os.close(fd)
        if err.errno not in (errno.EWOULDBLOCK, errno.EACCES):
            raise
        raise RunLockedError(
            f"{run_dir} is being trained by another process: {_describe_holder(holder)}. Refusing a second launch "
            f"of the same run; wait for that one to end or stop it (its lock, {path}, goes with its process)."
        ) from None
    info = json.dumps(_holder_info()).encode()
    if os.pread(fd, 1 << 16, 0) != info:  # unchanged when this process takes the lock again (no write, same mtime)
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
    _held[run_dir] = fd
    return True


def release_run_dir(run_dir: Path | str) -> None:
    """Drop this process's lock on a run folder, if it holds one (a sweep trial that ended, a test)."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is not None:
        os.close(fd)  # closing the only descriptor releases the flock


def held_run_dirs() -> list[Path]:
    """The run folders this process holds locked."""
    return list(_held)


def _forget_locks_in_child() -> None:
    # A forked child (data-loader worker, data-generation pool) shares the parent's lock; closing its copy keeps
    # the lock the parent's alone, so it ends with the parent even while a child lingers.
    for fd in _held.values():
        os.close(fd)
    _held.clear()


os.register_at_fork(after_in_child=_forget_locks_in_child)


def has_checkpoint(run_dir: Path | str) -> bool:
    """Whether a run folder holds a checkpoint (a file or folder in ``checkpoints/``; temporary files of killed saves,
    named ``.<name>.tmp-…``, aside). A folder without one holds nothing to resume."""
    folder = Path(run_dir) / "checkpoints"
    return folder.is_dir() and any(not p.name.startswith(".") for p in folder.iterdir())


def check_run_dir(cfg: DictConfig) -> Path | None:
    """Decide, before any compute, whether this launch starts fresh or resumes; returns the checkpoint to resume.

    An existing folder is locked first (RunLockedError while another process trains it); a new one is locked by
    ``write_run_config`` when it is made. Raises if the folder holds a different run (another method, backbone or
    data), or any run when ``if_exists=error``. A folder without a checkpoint (a launch that failed or was killed
    before its first save) holds no run: this launch starts afresh in it, whatever its settings (``write_run_config``
    replaces its config). Nothing in the folder but its lock file is modified here.
    """
    if cfg.if_exists not in IF_EXISTS:  # on every launch, not only when the folder exists
        raise ValueError(
            f"if_exists must be one of {IF_EXISTS}, got {cfg.if_exists!r}; nothing overwrites a run that holds a "
            "checkpoint: to start it again, move or delete its folder, or choose another name= or run_name="
        )
    run_dir = Path(cfg.paths.run_dir)
    if run_dir.exists():  # before reading it: a live holder may be writing it
        lock_run_dir(run_dir)
    saved = run_dir / RUN_CONFIG
    last = run_dir / "checkpoints" / "last.ckpt"
    if not saved.exists() or not has_checkpoint(run_dir):
        return None
    if cfg.if_exists == "error":
        raise RunExistsError(f"{run_dir} already holds a run (if_exists=error); choose another name or run_name")
    old, new = _identity(OmegaConf.load(saved)), _identity(cfg)
    diff = [
        f"{section}.{key}: {old[section].get(key)!r} → {new[section].get(key)!r}"
        for section in IDENTITY_SECTIONS
        if isinstance(old.get(section), dict) and isinstance(new.get(section), dict)
        for key in sorted(set(old[section]) | set(new[section]))
        if old[section].get(key) != new[section].get(key)
    ]
    if diff:
        raise RunExistsError(
            f"{run_dir} holds a different run; refusing to resume or overwrite it. Differences: "
            + "; ".join(diff[:8])
            + ". Use another name= or run_name=."
        )
    if last.is_symlink() and not last.exists():
        raise RunExistsError(
            f"cannot resume {run_dir}: {last} links to {last.readlink()}, which is gone. Restore that folder, or "
            "delete the link to restart the run."
        )
    if last.exists():  # a file, or a folder of shards (trainer=fsdp2 / fsdp; last.ckpt links to last.ckpt.step<N>)
        from lightning_modules.checkpoints import verify_checkpoint

        try:  # indexes only (archive index, shard index and shard sizes), not the tensors
            verify_checkpoint(last)
        except ValueError as err:
            raise RunExistsError(
                f"cannot resume {run_dir}: {err}. Move it aside to resume from a periodic checkpoint in "
                f"{last.parent} (rename it to last.ckpt), or delete it to restart the run."
            ) from err
        strategy = str(OmegaConf.select(cfg, "trainer.strategy._target_", default=""))
        if last.is_dir() and not strategy.endswith("ModelParallelStrategy"):
            raise RunExistsError(
                f"cannot resume {run_dir} with this trainer: its {last.name} is a folder of shards written by a "
                "sharded trainer; resume with that trainer (trainer=fsdp2), or evaluate the "
                "checkpoint in one process with flowlm-eval"
            )
        return last
    return None


SUPERSEDED = "mlflow_run_id.superseded"  # the MLflow run of a launch that never saved a checkpoint, replaced


def write_run_config(cfg: DictConfig) -> None:
    """Lock the run folder (made here for a new run) and save the resolved config beside the checkpoints: once for
    a run, again when the folder holds no checkpoint and other settings (a launch that never saved one)."""
    run_dir = Path(cfg.paths.run_dir)
    locked_now = lock_run_dir(run_dir)
    saved = run_dir / RUN_CONFIG
    if saved.exists():
        if has_checkpoint(run_dir):
            if locked_now:  # check_run_dir found no folder, so another launch made this run in the meantime
                raise RunExistsError(
                    f"{run_dir} was started by another launch while this one was checking it; relaunch to resume it"
                )
            return
        if _identity(OmegaConf.load(saved)) == _identity(cfg):
            return  # the same run again: its MLflow run goes on
        log.warning("%s holds no checkpoint of its earlier launch: a new run with these settings starts there", run_dir)
        recorded = run_dir / "mlflow_run_id"  # the new settings get an MLflow run of their own; the old one, if a
        if recorded.exists():  # kill left it RUNNING, is ended by make_logger (SUPERSEDED names it)
            os.replace(recorded, run_dir / SUPERSEDED)
    tmp = saved.with_name(f".{saved.name}.tmp{os.getpid()}")
    OmegaConf.save(OmegaConf.create(redact(OmegaConf.to_container(cfg, resolve=True))), tmp)  # no password
    os.replace(tmp, saved)


def pivot_table(rows: list[dict], value: str) -> str:
    """Markdown table: one line per (run, sampler), one column per NFE budget; cells 'value (NFE spent)'."""
    budgets = sorted({r["nfe_budget"] for r in rows})
    keys = list(dict.fromkeys((r.get("run", ""), r["sampler"]) for r in rows))
    head = "| run | sampler | " + " | ".join(f"NFE {b}" for b in budgets) + " |"
    lines = [head, "|---|---|" + "---|" * len(budgets)]
    for run, sampler in keys:
        cells = []
        for b in budgets:
            hit = [r for r in rows if (r.get("run", ""), r["sampler"], r["nfe_budget"]) == (run, sampler, b)]
            cells.append(f"{hit[0][value]:.1f} ({hit[0]['nfe']:.1f})" if hit else "")
        lines.append(f"| {run} | {sampler} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build(node: DictConfig, **kwargs):
    """``hydra.utils.instantiate`` that surfaces a component's own error (ValueError, FileNotFoundError, ...)
    with the config key it came from, instead of Hydra's wrapper."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        return instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ValueError | TypeError | FileNotFoundError | KeyError):
            key = node.get("_target_", "?") if isinstance(node, DictConfig) else "?"
            try:
                surfaced = type(cause)(f"{cause} [while building {key}]")
            except Exception:  # a type not built from one message (UnicodeDecodeError takes five): raise it as it is
                surfaced = None
            if surfaced is None:
                cause.add_note(f"[while building {key}]")
                raise cause from cause.__cause__  # its own chain, not Hydra's wrapper
            raise surfaced from err
        raise


def check_arguments(node: DictConfig, where: str) -> None:
    """Refuse, before anything is built or written, a ``<where>.<key>`` value of a type that the signature of the
    node's ``_target_`` rules out (``trainer.max_steps=abc`` failed deep inside Lightning with "'<' not supported
    between instances of 'str' and 'int'"). Nested components (``_target_`` nodes) are left to their own build."""
    import typing

    import pydantic
    from hydra.utils import get_object

    target = get_object(node._target_)
    try:
        hints = typing.get_type_hints(target.__init__ if isinstance(target, type) else target)
    except Exception:  # noqa: BLE001 - annotations that do not resolve: nothing to check against
        return
    config = pydantic.ConfigDict(arbitrary_types_allowed=True)
    for key in node:
        value = OmegaConf.to_container(node[key], resolve=True) if OmegaConf.is_config(node[key]) else node[key]
        if key not in hints or _holds_component(value):
            continue
        try:
            pydantic.TypeAdapter(hints[key], config=config).validate_python(value, strict=True)
        except pydantic.ValidationError as err:
            hint = hints[key]
            expected = hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")
            problems = err.errors()
            why = f": {problems[0]['msg']}" if len(problems) == 1 else ""  # a union's first branch would mislead
            raise TypeError(
                f"{where}.{key} = {value!r} does not fit {target.__name__}'s {key}: "
                f"{expected.replace('NoneType', 'None')}{why}"
            ) from err
        except pydantic.PydanticUserError:  # an annotation pydantic cannot check
            continue


def _holds_component(value: object) -> bool:
    if isinstance(value, dict):
        return "_target_" in value or any(_holds_component(v) for v in value.values())
    return isinstance(value, list) and any(_holds_component(v) for v in value)


def trainer_device_type(trainer_cfg: DictConfig) -> str:
    """The device type a trainer config runs on: ``cuda`` for ``accelerator`` gpu / cuda, and for auto where CUDA is
    available (Lightning's choice); ``cpu`` for cpu and for auto without CUDA; any other accelerator by its name."""
    from runners.resolvers import cuda_available

    accelerator = str(trainer_cfg.get("accelerator", "cpu")).lower()
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and cuda_available()):
        return "cuda"
    return "cpu" if accelerator == "auto" else accelerator


def use_tf32(device_type: str, enabled: bool | None = None) -> bool:
    """On CUDA, float32 matrix products and cuDNN convolutions on TF32 tensor cores (what bf16 autocast leaves in
    float32: FMLM+'s δ·E lift, norms, a float32 evaluation); elsewhere nothing changes. ``enabled``: the runners'
    ``tf32`` option; None (lm-eval, MT-Bench) reads ``FLOWLM_TF32`` (0 turns it off). Returns whether it was set."""
    if enabled is None:
        enabled = os.environ.get("FLOWLM_TF32", "1").strip().lower() not in ("0", "false", "no", "off")
    if device_type != "cuda" or not enabled:
        return False
    import torch

    torch.set_float32_matmul_precision("high")  # TF32 for float32 matmuls (torch.backends.cuda.matmul.allow_tf32)
    torch.backends.cudnn.allow_tf32 = True
    log.info("TF32 on for float32 matrix products and convolutions (tf32=false turns it off)")
    return True


def cpu_choices(cfg: DictConfig) -> bool:
    """What a run on the CPU sets once, before any compute: under ``bf16-mixed`` on a CPU without bf16 kernels (AVX2
    only), CPU autocast's bf16 matrix products by float32 BLAS (flowlm/ops/bf16_products.py: the numbers of a bf16
    kernel at float32's speed, where torch's own bf16 loop runs 10–100× slower). Returns whether they are on."""
    precision = str(OmegaConf.select(cfg, "trainer.precision", default="") or "")
    if trainer_device_type(cfg.trainer) != "cpu" or not precision.startswith("bf16-mixed"):
        return False
    from flowlm.ops.bf16_products import install_bf16_products, native_bf16_kernels

    if native_bf16_kernels():
        return False
    if install_bf16_products():
        log.info("bf16 autocast's matrix products by float32 BLAS: this CPU has no bf16 kernels (the same numbers)")
    return True


def gpu_choices(cfg: DictConfig) -> bool:
    """What a run on its trainer's device sets once, before any compute: TF32 where ``cfg.tf32`` and the trainer
    runs on CUDA (docs/performance.md#gpu-choices). Returns whether TF32 was turned on."""
    return use_tf32(trainer_device_type(cfg.trainer), bool(cfg.get("tf32", True)))
