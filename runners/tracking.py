"""MLflow logging that survives what long runs meet: resumes from another folder, and a tracking server that goes
away. Lightning's MLFlowLogger raises in both cases and takes the training run down with it."""

from __future__ import annotations

import errno
import functools
import glob
import os
import shutil
import socket
import sqlite3
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
from lightning.pytorch.loggers import MLFlowLogger
from lightning.pytorch.utilities import rank_zero_only, rank_zero_warn
from mlflow.exceptions import MlflowException

from flowlm.redaction import redact_uri

PARAM_LIMIT = 250  # Lightning's MLFlowLogger truncates parameter values to this many characters


class TrackingUnavailable(RuntimeError):
    """The tracking store could not be reached when the run started."""


MIN_FREE_BYTES = 1 << 20  # a new experiment and run in a SQLite store: a few pages and their journal
_FULL = ("database or disk is full", "no space left on device", "disk quota exceeded")


def local_folder(uri: str | None) -> Path | None:
    """The local folder a tracking URI or artifact location writes into (a SQLite store's folder, a file store or
    artifact folder); None for a server or a remote location."""
    if not uri:
        return None
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).parent
    if uri.startswith("file:"):
        return Path(uri.removeprefix("file:").removeprefix("//"))
    return None if "://" in uri else Path(uri)


def check_store_space(tracking_uri: str | None, artifact_location: str | None) -> None:
    """Refuse, before a run writes anything, a local MLflow store or artifact folder on a disk with less than
    ``MIN_FREE_BYTES`` free (it failed later as "tracking store not reachable", after run_config.yaml was written)."""
    for what, uri in (("store", tracking_uri), ("artifact folder", artifact_location)):
        folder = local_folder(uri)
        if folder is None:
            continue
        existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
        if existing is None:
            continue
        free = shutil.disk_usage(existing).free
        if free < MIN_FREE_BYTES:
            raise TrackingUnavailable(
                f"the MLflow {what} {uri} is on a full disk: {free} bytes free in {existing}. Free space there, or "
                "track elsewhere with logger.tracking_uri=sqlite:///<other path>/mlflow.db and "
                "logger.artifact_location=<other folder> (or logger=none)."
            )


def disk_full(err: BaseException) -> bool:
    """Whether ``err`` or an error it came from says the disk is full (ENOSPC, EDQUOT, SQLite's SQLITE_FULL)."""
    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(err).lower() for text in _FULL):
            return True
        err = err.__cause__ or err.__context__
    return False


def _full_disk_message(uri: str, err: BaseException) -> str:
    folder = local_folder(uri)
    free = ""
    if folder is not None and folder.exists():
        free = f" ({shutil.disk_usage(folder).free} bytes free in {folder})"
    return redact_uri(
        f"the MLflow store {uri!r} is on a full disk{free}: {type(err).__name__}: {str(err).splitlines()[0]}. Free "
        "space there, or track elsewhere with logger.tracking_uri=sqlite:///<other path>/mlflow.db (or logger=none)."
    )


def create_sqlite_store(path: str | os.PathLike) -> None:
    """Make a new SQLite tracking store at ``path`` with its whole schema, atomically.

    MLflow creates a store's tables and then applies its schema migrations one by one, not in one transaction: a
    launch killed in between leaves a store that every later launch fails to open ("table scorers already
    exists"). Here the schema is made in a hidden temporary file beside ``path``, which is then hard-linked into
    place: ``path`` is absent or complete. A store that exists, or that another process links first, is kept.
    Where the filesystem has no hard links MLflow creates the store itself, as before.
    """
    from mlflow import MlflowClient

    target = Path(path)
    _remove_dead_inits(target)
    if target.exists():
        return
    tmp = target.with_name(f".{target.name}.init-{socket.gethostname()}-{os.getpid()}")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.unlink(missing_ok=True)
        MlflowClient(f"sqlite:///{tmp}").search_experiments(max_results=1)  # creates and migrates the schema
        os.link(tmp, target)
    except FileExistsError:  # another launch made it meanwhile: theirs is complete too
        pass
    except Exception:  # noqa: BLE001 - no hard links, a read-only folder: MLflow opens (or refuses) it as before
        pass
    finally:
        for leftover in (tmp, *(tmp.with_name(tmp.name + end) for end in ("-journal", "-wal", "-shm"))):
            try:
                leftover.unlink(missing_ok=True)
            except OSError:
                pass


def _remove_dead_inits(target: Path) -> None:
    """Remove the temporary stores (and their SQLite journals) of killed creations of ``target`` by processes of this
    host that have ended."""
    prefix = f".{target.name}.init-{socket.gethostname()}-"
    try:
        found = [(p, p.name[len(prefix) :].split("-")[0]) for p in target.parent.glob(f"{glob.escape(prefix)}*")]
    except OSError:
        return
    for path, pid in found:  # the store and SQLite's -journal / -wal / -shm files beside it
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
        except OSError:  # alive (another user's) or unknowable: leave it
            continue


def _count_runs(path: str) -> str:
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as con:
            return f"{con.execute('SELECT count(*) FROM runs').fetchone()[0]} run(s)"
    except sqlite3.Error:
        return "no readable runs table"


class ResilientMLFlowLogger(MLFlowLogger):
    """MLFlowLogger whose tracking calls never end a training run.

    - A resumed run logs only parameters it does not have yet; a value that changed (e.g. a cache folder resolved
      from another working directory) is kept as it was, listed in the tag ``flowlm.resume_changed_params`` and
      warned about. MLflow refuses to overwrite parameters, which would otherwise crash the resume.
    - With ``resilient=True`` every client call that fails (server down, network, disk) is warned about and
      skipped; training goes on and the failures are counted (``failures``). The first contact with the store is
      checked by ``check_reachable`` (quickly, without MLflow's minutes of HTTP retries) so an unreachable server
      is reported before any compute.
    - A recorded run id that the store does not hold (its SQLite file deleted or replaced, another server) is
      dropped by ``check_reachable``: a new run starts and ``replaced_run_id`` names the old one.
    - ``finalize`` warns when the run's tracking is incomplete: calls that failed, or a SQLite store file deleted
      or replaced while the run wrote to it (SQLite then writes on into the deleted file: no call fails).
    """

    def __init__(self, *args: Any, resilient: bool = True, **kwargs: Any) -> None:
        uri = kwargs.get("tracking_uri") or os.environ.get("MLFLOW_TRACKING_URI") or ""
        store_file = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else None
        if store_file:
            create_sqlite_store(store_file)
        try:
            super().__init__(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - a local store that MLflow cannot open, whatever the reason
            if disk_full(err):
                raise TrackingUnavailable(_full_disk_message(uri, err)) from err
            if not store_file or not os.path.exists(store_file):
                raise
            reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            raise TrackingUnavailable(
                f"the MLflow store {store_file} cannot be opened ({reason}); it holds "
                f"{_count_runs(store_file)}. A launch killed while MLflow created or upgraded its tables leaves a "
                "store like this. If it holds nothing you need, move it away and relaunch (a new store is made); "
                f"otherwise back it up and run `mlflow db upgrade sqlite:///{store_file}`, or track elsewhere with "
                "logger.tracking_uri=sqlite:///<other path>/mlflow.db (or logger=none)."
            ) from err
        self.resilient = resilient
        self.failures = 0
        self.failed_calls: Counter[str] = Counter()
        self.replaced_run_id: str | None = None
        uri = self._tracking_uri
        self._store_file = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else None
        self._store_identity: tuple[int, int] | None = None  # (device, inode) of the store file at the start
        self._reported: set[str] = set()  # kinds of loss already warned about

    @property
    def experiment(self):  # noqa: D102 - the MLflow client, guarded when resilient
        client = self._client()
        return _GuardedClient(client, self) if self.resilient else client

    def _client(self):
        """Lightning's MLflow client (made on the first call), unguarded. That first call runs
        mlflow.set_tracking_uri, which also exports the URI as $MLFLOW_TRACKING_URI; conf/logger/mlflow.yaml reads
        that variable first, so a later run in this process (the next job of a Hydra multirun, a second train()
        call) would track into this run's store. The environment is kept as it was."""
        before = os.environ.get("MLFLOW_TRACKING_URI")
        try:
            return MLFlowLogger.experiment.fget(self)
        finally:
            if before is None:
                os.environ.pop("MLFLOW_TRACKING_URI", None)
            else:
                os.environ["MLFLOW_TRACKING_URI"] = before

    def check_reachable(self, timeout_s: float = 5.0) -> None:
        """Contact the store once with few retries; raise TrackingUnavailable with the URI if it cannot be reached."""
        saved = {k: os.environ.get(k) for k in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")}
        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
        os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] = str(int(max(1, timeout_s)))
        try:
            self._forget_missing_run()
            try:
                self._client()  # creates/looks up the experiment and the run
            except MlflowException as err:
                # Workers starting together on a new experiment all miss it and all create it: one wins, the
                # others' create fails with RESOURCE_ALREADY_EXISTS and their second look-up finds it.
                if err.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
                self._client()
            self._store_identity = self._store_file_identity()
        except Exception as err:  # noqa: BLE001 - any failure here means "cannot track"
            if disk_full(err):  # reached, but it cannot write
                raise TrackingUnavailable(_full_disk_message(self._tracking_uri, err)) from err
            raise TrackingUnavailable(
                redact_uri(
                    f"MLflow tracking store {self._tracking_uri!r} is not reachable ({type(err).__name__}: {err}). "
                    "Start the server, or track locally with logger.tracking_uri=sqlite:///<path>/mlflow.db, or run "
                    "without tracking with logger=none."
                )
            ) from err
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value

    def _forget_missing_run(self) -> None:
        """Drop a recorded run id that the store has no (active) run for, so that a new run starts."""
        if self._run_id is None:
            return
        try:
            run = self._mlflow_client.get_run(self._run_id)
        except MlflowException as err:
            if err.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            run = None
        if run is None or run.info.lifecycle_stage == "deleted":
            self.replaced_run_id, self._run_id = self._run_id, None

    def _store_file_identity(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self._store_file) if self._store_file else None
        except OSError:
            return None
        return (st.st_dev, st.st_ino) if st else None

    @rank_zero_only
    def finalize(self, status: str = "success") -> None:
        """End the run as Lightning does, then warn if its tracking is incomplete."""
        super().finalize(status)
        lost = {}
        if self._store_identity is not None and self._store_file_identity() != self._store_identity:
            lost["store"] = (
                f"its store file {self._store_file} was deleted or replaced while the run was tracked in it: what "
                "was logged since then went into the deleted file and is gone"
            )
        if self.failures:
            calls = ", ".join(f"{name} ×{n}" for name, n in self.failed_calls.most_common())
            lost["calls"] = (
                f"{self.failures} tracking call(s) failed ({calls}): the metrics, parameters, tags or artifacts they "
                "carried are missing"
            )
        if not lost.keys() <= self._reported:  # fit and a final validate both finalize: warn once per kind of loss
            self._reported |= lost.keys()
            warnings.warn(
                f"MLflow run {self._run_id} in {redact_uri(self._tracking_uri)} is incomplete: "
                f"{'; '.join(lost.values())}. The run folder (checkpoints, run_config.yaml) is complete.",
                RuntimeWarning,
                stacklevel=2,
            )

    @rank_zero_only  # as Lightning's own: other ranks have no run to read (their get_run calls failed)
    def log_hyperparams(self, params: Any) -> None:
        """Log parameters the run does not hold yet; keep (and report) the ones a resumed run would change."""
        flat = _flatten_dict(_convert_params(params))
        try:
            existing = MLFlowLogger.experiment.fget(self).get_run(self.run_id).data.params
        except Exception as err:  # noqa: BLE001
            if not self.resilient:
                raise
            self._failed("get_run", err)
            return
        changed = sorted(k for k, v in flat.items() if k in existing and existing[k] != str(v)[:PARAM_LIMIT])
        new = {k: v for k, v in flat.items() if k not in existing}
        if changed:
            rank_zero_warn(
                f"resumed MLflow run {self.run_id}: parameters differ from the first launch and keep their first "
                f"values: {changed[:8]}"
            )
            previous = existing.get("flowlm.resume_changed_params", "")
            tag = ",".join(sorted(set(filter(None, previous.split(","))) | set(changed)))
            self.experiment.set_tag(self.run_id, "flowlm.resume_changed_params", tag[:5000])
        if new:
            super().log_hyperparams(new)

    def _failed(self, what: str, err: Exception) -> None:
        self.failures += 1
        self.failed_calls[what] += 1
        if self.failures <= 3 or self.failures % 100 == 0:
            warnings.warn(
                redact_uri(
                    f"MLflow call {what} to {self._tracking_uri} failed ({type(err).__name__}: {err}); training goes "
                    f"on ({self.failures} tracking failure(s) so far)"
                ),
                RuntimeWarning,
                stacklevel=3,
            )


class _GuardedClient:
    """Proxy of an MlflowClient: a failing method call is reported to the logger and returns None."""

    def __init__(self, client: Any, owner: ResilientMLFlowLogger) -> None:
        self._client = client
        self._owner = owner

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        @functools.wraps(attr)
        def guarded(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except Exception as err:  # noqa: BLE001 - tracking must not end the run
                self._owner._failed(name, err)
                return None

        return guarded
