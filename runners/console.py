"""What every console script does around its job, and nothing heavy: importing this (or an entry module) loads
neither torch nor Lightning, so Hydra's ``--help``, ``--cfg`` and ``--info`` answer in about a second (the jobs
import them when they run: ``runners.train.train``, ``runners.evaluate.evaluate``, ...).

``console_script`` wraps every command's entry, a ``@hydra.main`` function or an argparse ``main``: before Hydra
starts (a sweeper warns before any trial runs) it calls ``quiet_library_notices``, the one place that silences what
the libraries print that is not the user's concern. Each entry is matched by its message, category and module; every
other warning is shown as before. A user error (``is_user_error``) ends the command with one line and exit status 2.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import logging
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from runners.resolvers import query_machine

# (message, category, module): regular expressions matched from the start, as `warnings.filterwarnings` does.
_OPTUNA_OR_SWEEPER = r"(optuna|hydra_plugins\.hydra_optuna_sweeper)\."
LIBRARY_WARNINGS: tuple[tuple[str, type[Warning], str], ...] = (
    # torch ≥ 2.10 deprecates LeafSpec; Lightning's own _pytree still builds one whenever it moves a batch.
    (r"`isinstance\(treespec, LeafSpec\)` is deprecated", FutureWarning, r"lightning\."),
    # hydra-optuna-sweeper 1.2 builds optuna's pre-3.0 distributions (UniformDistribution, IntUniformDistribution,
    # ...): optuna warns when the sweeper makes them and again when it reads a trial's back from the study (the two
    # warnings of every trial), or converts them when a trial draws one.
    (r"\w+Distribution has been deprecated in v3\.0\.0", FutureWarning, _OPTUNA_OR_SWEEPER),
    (r"\w+Distribution\(.*\) is deprecated and internally converted to", FutureWarning, _OPTUNA_OR_SWEEPER),
    # ... and passes every TPESampler argument of optuna 3, set or not: five warnings at the start of each sweep.
    (
        r"`(consider_prior|prior_weight|consider_magic_clip|consider_endpoints|warn_independent_sampling)` has "
        r"been deprecated",
        FutureWarning,
        r"optuna\.samplers\.",
    ),
)
# Lightning's advertisements for its cloud products ("💡 Tip: For seamless cloud uploads and versioning, try
# installing [litmodels]..." and the LitLogger one), logged at INFO through its rank-zero helpers' loggers.
PRODUCT_TIP = "💡 Tip:"
TIP_LOGGERS = (
    "lightning.pytorch.utilities.rank_zero",
    "lightning.fabric.utilities.rank_zero",
    "lightning_utilities.core.rank_zero",
)


# Hydra's flags that show the config or the app and run nothing (`--cfg job --resolve` resolves: it is left out).
SHOW_ONLY_FLAGS = ("--help", "-h", "--hydra-help", "--info", "-i", "--cfg", "-c", "--shell-completion", "-sc")


def shows_only(argv: Sequence[str]) -> bool:
    """Whether a console script's arguments only show something (``--help``, ``--cfg job``, ``--info``, ...)."""
    return "--resolve" not in argv and any(arg.split("=", 1)[0] in SHOW_ONLY_FLAGS for arg in argv)


class _DropProductTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        return not str(record.msg).startswith(PRODUCT_TIP)


def quiet_library_notices() -> None:
    """Silence LIBRARY_WARNINGS and Lightning's product tips in this process (idempotent). The console scripts call
    it before Hydra starts; ``runners.trial.run_trial`` calls it again where a trial runs in a process of its own
    (joblib, submitit)."""
    for message, category, module in LIBRARY_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name in TIP_LOGGERS:  # a filter on the logger that emits: the record never reaches any handler
        logger = logging.getLogger(name)  # the same object Lightning gets when it is imported later
        if not any(isinstance(f, _DropProductTips) for f in logger.filters):
            logger.addFilter(_DropProductTips())


def log_lightning_once() -> None:
    """Print each of Lightning's log lines once. The `lightning` logger has a console handler of its own, and
    `lightning.pytorch` passes its lines up to it and to the root logger when the root had handlers at import: as
    it has once the job imports Lightning (Hydra's job logging is configured by then; the entry modules no longer
    import it first), every line came twice. With handlers on the root, Lightning's own goes: its lines take the
    job's format and reach the job's log file. The jobs call this right after importing Lightning."""
    import lightning

    own = getattr(lightning, "_console", None)
    if own is not None and logging.getLogger().handlers:
        logging.getLogger("lightning").removeHandler(own)


def share_group_listing() -> None:
    """Make Hydra's ``--help`` list the config groups from one copy of the config repository (idempotent).

    The help lists every group's options (about 225 groups here), and Hydra 1.3 deep-copies the whole repository
    (every config source, its plugins' schemas included) for each listing: most of ``--help``'s time. The listing
    reads the same repository each time, so one copy serves all of them, with the same options listed. A Hydra
    without these internals is left as it is."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.object_type import ObjectType

    original = ConfigLoaderImpl.get_group_options
    if getattr(original, "shares_listing", False) or not hasattr(
        ConfigLoaderImpl, "_parse_overrides_and_create_caching_repo"
    ):
        return

    @functools.wraps(original)
    def get_group_options(self, group_name, results_filter=ObjectType.CONFIG, config_name=None, overrides=None):
        if config_name is not None or overrides:  # a listing for a composition: Hydra's own way
            return original(self, group_name, results_filter, config_name, overrides)
        repo = self.__dict__.get("_listing_repository")
        if repo is None:
            _, repo = self._parse_overrides_and_create_caching_repo(None, [])
            self._listing_repository = repo
        return repo.get_group_options(group_name, results_filter)

    get_group_options.shares_listing = True
    ConfigLoaderImpl.get_group_options = get_group_options


# A user error: what the suite refuses of the user's input or setup, its message saying what was wrong and the fix
# (docs/reliability.md, "One line for a user error"). It ends a command with that one line on stderr and
# USER_ERROR_STATUS, no traceback; any other exception is a bug (the suite's or a library's) and keeps its traceback.
# One is
# - an exception of a kind in USER_ERROR_KINDS, or of a class the suite defines (RunExistsError, JudgeError, ...),
#   raised by a `raise` statement of the suite's own code: the message is the suite's. A KeyError of a dict lookup or
#   a TypeError of a bad call in the suite's code, or a ValueError inside torch, are bugs and keep their traceback;
# - Hydra's config errors (CompactHydraException: an unknown override, a missing config, an unparsable value) and
#   OmegaConf's missing mandatory value (`ckpt_path: ???` left unset); Hydra's error raised from a user error (its
#   instantiate's) counts as that user error.
# DEBUG_ENV=1 (or Hydra's own HYDRA_FULL_ERROR=1) shows a user error's traceback too.
SUITE_PACKAGES = ("flowlm", "lightning_modules", "datamodules", "callbacks", "runners", "sweeps", "analysis")
USER_ERROR_KINDS: tuple[type[BaseException], ...] = (ValueError, TypeError, LookupError, OSError)
USER_ERROR_STATUS = 2  # as argparse exits on a bad option; a failed job exits 1
DEBUG_ENV = "FLOWLM_TRACEBACK"


def _package(frame) -> str:
    spec = frame.f_globals.get("__spec__")  # `python -m runners.train`: the module is __main__, its spec is not
    return (getattr(spec, "name", None) or frame.f_globals.get("__name__") or "").partition(".")[0]


def _raised_by(err: BaseException, packages: Sequence[str]) -> bool:
    """Whether ``err`` was raised by a ``raise`` statement of ``packages``' code (its traceback's innermost frame)."""
    tb = err.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    if _package(tb.tb_frame) not in packages:
        return False
    return linecache.getline(tb.tb_frame.f_code.co_filename, tb.tb_lineno).lstrip().startswith("raise")


def _library_error(err: BaseException, module: str, name: str) -> bool:
    # a library's class, only if the process has loaded it: an error of a library not loaded cannot be one of its own
    cls = getattr(sys.modules.get(module), name, None)
    return cls is not None and isinstance(err, cls)


def is_user_error(err: BaseException, packages: Sequence[str] = SUITE_PACKAGES) -> bool:
    """Whether ``err`` is a user error (the rule above), for a command whose own code is ``packages``."""
    if _library_error(err, "hydra.errors", "CompactHydraException"):
        cause = err.__cause__
        omegaconf = _library_error(cause, "omegaconf.errors", "OmegaConfBaseException")  # an override's
        return cause is None or omegaconf or is_user_error(cause, packages)  # instantiate's: the constructor's error
    if _library_error(err, "omegaconf.errors", "MissingMandatoryValue"):
        return True
    if isinstance(err, USER_ERROR_KINDS) or _class_package(type(err)) in packages:
        return _raised_by(err, packages)
    return False


def _class_package(cls: type) -> str:
    module = sys.modules.get(cls.__module__)  # `python -m runners.mt_bench`: its classes' module is __main__
    return (getattr(getattr(module, "__spec__", None), "name", None) or cls.__module__).partition(".")[0]


def user_error_line(err: BaseException) -> str:
    """A user error's message on one line (a Hydra error with its cause's first line, OmegaConf's without its key
    details)."""
    if _library_error(err, "hydra.errors", "CompactHydraException") and err.__cause__ is not None:
        cause = err.__cause__
        if not _library_error(cause, "omegaconf.errors", "OmegaConfBaseException"):
            return user_error_line(cause)  # instantiate's "Error in call to target ...": the suite's own message
        return f"{_one_line(str(err))} ({str(cause).strip().splitlines()[0]})"
    if _library_error(err, "omegaconf.errors", "OmegaConfBaseException"):  # its first line: the rest is key details
        first = re.sub(r"^\w+ raised while resolving interpolation: ", "", str(err).strip().splitlines()[0])
        key = getattr(err, "full_key", None)
        missing = _library_error(err, "omegaconf.errors", "MissingMandatoryValue")
        return f"{first}: give it on the command line ({key}=...)" if missing and key else first
    if isinstance(err, KeyError) and len(err.args) == 1:  # str(KeyError) is the repr of its message
        return _one_line(str(err.args[0]))
    if _library_error(err, "hydra.errors", "MissingConfigException"):  # the options, without Hydra's search path
        return _one_line(str(err).split("\nConfig search path")[0])
    return _one_line(str(err)) or type(err).__name__


def _one_line(text: str) -> str:
    return " ".join(line.strip() for line in text.splitlines() if line.strip())


def debugging() -> bool:
    """Whether the user asked for a user error's traceback (DEBUG_ENV=1 or HYDRA_FULL_ERROR=1)."""
    return any(os.environ.get(name, "") not in ("", "0") for name in (DEBUG_ENV, "HYDRA_FULL_ERROR"))


def command_name() -> str:
    """How the user called this command: its console script's name, or ``python -m <module>``."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and sys.argv[0].endswith(".py"):
        return f"python -m {spec.name}"
    return Path(sys.argv[0]).name


class CallbackError(BaseException):
    """An error raised in a Hydra callback (``callback_errors``), carried past Hydra to ``user_errors``, which treats
    it as the error itself. Hydra turns a callback's ``Exception`` into a UserWarning and goes on: a sweep over a
    read-only Optuna storage warned, then failed in the sweeper with sqlalchemy's traceback."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


@contextlib.contextmanager
def callback_errors() -> Iterator[None]:
    """Within the block (a Hydra callback's hook), an exception stops the command as ``CallbackError``."""
    try:
        yield
    except Exception as err:
        raise CallbackError(err) from err


@contextlib.contextmanager
def user_errors(packages: Sequence[str] = SUITE_PACKAGES) -> Iterator[None]:
    """Within the block, a user error ends the process: ``<command>: error: <message>`` on stderr, exit status
    USER_ERROR_STATUS; any other exception passes (``debugging``: every one). An error a Hydra callback raised
    (``CallbackError``) counts as itself."""
    try:
        yield
    except CallbackError as carried:
        if debugging() or not is_user_error(carried.error, packages):
            raise carried.error from None  # its own traceback, from the callback
        _end(carried.error)
    except Exception as err:
        if debugging() or not is_user_error(err, packages):
            raise
        _end(err)


def _end(err: BaseException) -> None:
    sys.stderr.flush()
    print(f"{command_name()}: error: {user_error_line(err)}", file=sys.stderr, flush=True)
    raise SystemExit(USER_ERROR_STATUS) from None


@contextlib.contextmanager
def hydra_errors_raised() -> Iterator[None]:
    """Within the block, Hydra lets every error reach its caller (``user_errors``) instead of printing it itself (a
    trimmed traceback, or a config error's lines and a hint) and exiting 1; a job that failed by a user error is not
    announced ("Error executing job with overrides"). A Hydra without these internals prints its own, as before."""
    try:
        from hydra._internal import hydra as hydra_app
        from hydra._internal import utils as hydra_utils
        from hydra.core.utils import JobReturn, JobStatus
    except ImportError:
        yield
        return
    report = getattr(hydra_utils, "run_and_report", None)
    value = JobReturn.__dict__.get("return_value")
    if report is None or getattr(hydra_app, "run_and_report", None) is not report or not isinstance(value, property):
        yield
        return

    def through(func: Callable):
        return func()

    def return_value(job):
        if job.status == JobStatus.FAILED and is_user_error(job._return_value):
            raise job._return_value
        return value.fget(job)

    hydra_utils.run_and_report = hydra_app.run_and_report = through
    JobReturn.return_value = property(return_value, value.fset)
    try:
        yield
    finally:
        hydra_utils.run_and_report = hydra_app.run_and_report = report
        JobReturn.return_value = value


def console_script(main: Callable | None = None, *, hydra: bool = True, packages: Sequence[str] = SUITE_PACKAGES):
    """A console entry point: ``main`` (a ``@hydra.main`` function, or with ``hydra=False`` an argparse one) with the
    libraries' notices quieted and a user error ending it in one line (``user_errors``; ``packages``: the code whose
    raised errors are the command's own); for Hydra, when it only shows something (``shows_only``), without querying
    the machine while the config is composed (``runners.resolvers.query_machine``: the CPU's precision needs torch).
    A call with arguments (``main(["ckpt", "out"])`` from Python: a script, a test) gets the exception itself."""
    if main is None:
        return functools.partial(console_script, hydra=hydra, packages=packages)

    @functools.wraps(main)
    def entry(*args, **kwargs):
        quiet_library_notices()
        console = user_errors(packages) if not (args or kwargs) else contextlib.nullcontext()
        if not hydra:
            with console:
                return main(*args, **kwargs)
        if shows_only(sys.argv[1:]):
            share_group_listing()
        previous = query_machine(not shows_only(sys.argv[1:]))
        try:
            with console, hydra_errors_raised():
                return main(*args, **kwargs)
        finally:
            query_machine(previous)

    return entry
