"""``flowlm-lm-eval``: lm-eval's command line with the suite's model ``flowlm`` registered and each evaluation tracked
in MLflow (``runners.lm_harness.main``, docs/evaluation.md). This entry is light: it reads the command line first, and
imports lm-eval's evaluator, torch and the model only to run an evaluation, so ``--help`` answers in a fraction of a
second (lm-eval's model class, which ``flowlm`` subclasses, imports torch: runners/lm_harness.py loads it at import).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from runners.console import SUITE_PACKAGES, console_script

# The code whose raised errors are this command's own refusals: the suite's and lm-eval's (an unknown task, ...).
LM_EVAL_PACKAGES = (*SUITE_PACKAGES, "lm_eval")
OWN_HELP = """flowlm-lm-eval: lm-eval's command line (below) with the model `flowlm` (--model flowlm --model_args
checkpoint=PATH,...: docs/evaluation.md), each evaluation tracked in MLflow; two options of its own:
  --mlflow_tracking_uri URI  the MLflow store of the evaluation's run (default: the suite's, $MLFLOW_TRACKING_URI
                             else <runs>/mlflow.db; none: untracked)
  --mlflow_experiment NAME   its experiment (default: the checkpoint's run's task, else lm_eval)
"""


def own_arguments(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command's own options (``--mlflow_tracking_uri``, ``--mlflow_experiment``) and lm-eval's (the rest)."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--mlflow_tracking_uri", default=None)
    parser.add_argument("--mlflow_experiment", default=None)
    return parser.parse_known_args(list(argv))


@console_script(hydra=False, packages=LM_EVAL_PACKAGES)
def main() -> None:
    """Console entry point: ``--help`` from lm-eval's command line alone, anything else ``runners.lm_harness.main``."""
    _, rest = own_arguments(sys.argv[1:])
    if any(arg in ("-h", "--help") for arg in rest):
        from lm_eval.__main__ import cli_evaluate  # its parser only: no evaluator, no torch

        print(OWN_HELP)
        sys.argv[1:] = rest
        cli_evaluate()
        return
    from runners.lm_harness import main as evaluate_command

    evaluate_command()
