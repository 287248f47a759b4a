"""What every console script does around its job, and nothing heavy: importing this (or an entry module) loads
neither torch nor Lightning, so Hydra's ``--help``, ``--cfg`` and ``--info`` answer in about a second (the jobs
import them when they run: ``runners.train.train``, ``runners.evaluate.evaluate``, ...).

``console_script`` wraps a ``@hydra.main`` function: before Hydra starts (a sweeper warns before any trial runs) it
calls ``quiet_library_notices``, the one place that silences what the libraries print that is not the user's
concern. Each entry is matched by its message, category and module; every other warning is shown as before.
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
from collections.abc import Callable, Sequence

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


def console_script(hydra_main: Callable) -> Callable:
    """A console entry point: ``hydra_main`` (a ``@hydra.main`` function) with the libraries' notices quieted, and,
    when it only shows something (``shows_only``), without querying the machine while the config is composed
    (``runners.resolvers.query_machine``: the CPU's precision needs torch)."""

    @functools.wraps(hydra_main)
    def main(*args, **kwargs):
        quiet_library_notices()
        if shows_only(sys.argv[1:]):
            share_group_listing()
        previous = query_machine(not shows_only(sys.argv[1:]))
        try:
            return hydra_main(*args, **kwargs)
        finally:
            query_machine(previous)

    return main
