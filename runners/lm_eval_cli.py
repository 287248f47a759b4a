"""``flowlm-lm-eval``: lm-eval's command line with the suite's model ``flowlm`` registered and each evaluation tracked
in MLflow (``runners.lm_harness.main``, docs/evaluation.md). This entry is light: it reads the command line first, and
imports lm-eval's evaluator, torch and the model only to run an evaluation, so ``--help`` answers in a fraction of a
second (lm-eval's model class, which ``flowlm`` subclasses, imports torch: runners/lm_harness.py loads it at import).
"""

from __future__ import annotations

import argparse
import sys

from runners.console import SUITE_PACKAGES, command_name, console_script

OWN_HELP = """flowlm-lm-eval: lm-eval's command line (below) with the model `flowlm` (--model flowlm --model_args
checkpoint=PATH,...: docs/evaluation.md), each evaluation tracked in MLflow; two options of its own:
  --mlflow_tracking_uri URI  the MLflow store of the evaluation's run (default: the suite's, $MLFLOW_TRACKING_URI
                             else <runs>/mlflow.db; none: untracked)
  --mlflow_experiment NAME   its experiment (default: the checkpoint's run's task, else lm_eval)
"""


def lm_eval_parser(prog: str | None = None):
    """lm-eval's command-line parser alone (``lm_eval._cli.HarnessCLI``; None for an lm-eval without it), its errors
    under ``prog`` (the command the user ran) where given. Not lm-eval's ``cli_evaluate``: it first sets up logging
    from ``lm_eval.utils``, which imports numpy, requests and jinja2 (1.4 s of a 3.3 s ``--help`` at a load of 8)."""
    try:
        from lm_eval._cli import HarnessCLI
    except ImportError:
        return None
    cli = HarnessCLI()
    subparsers = getattr(cli, "_subparsers", None)
    for parser in (getattr(cli, "_parser", None), *getattr(subparsers, "choices", {}).values()):
        if prog and isinstance(parser, argparse.ArgumentParser):
            for attr in ("prog", "usage"):  # `run`'s usage is a text of its own
                text = getattr(parser, attr)
                if isinstance(text, str) and text.startswith("lm-eval"):
                    setattr(parser, attr, prog + text[len("lm-eval") :])
    return cli


@console_script(hydra=False, packages=(*SUITE_PACKAGES, "lm_eval"))  # lm-eval's refusals (a task not found) too
def main() -> None:
    """Console entry point: ``--help`` from lm-eval's command line alone, the arguments checked by its parser, then
    ``runners.lm_harness.main`` (which reads the command's own options, OWN_HELP, itself)."""
    own = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # lm-eval's parser would refuse them
    for option in ("--mlflow_tracking_uri", "--mlflow_experiment"):
        own.add_argument(option)
    _, rest = own.parse_known_args(sys.argv[1:])
    argv = list(sys.argv)
    if any(arg in ("-h", "--help") for arg in rest):
        print(OWN_HELP)
        sys.argv[1:] = rest
        cli = lm_eval_parser()
        if cli is None:  # an lm-eval of another layout: its whole entry, the same help, slower
            from lm_eval.__main__ import cli_evaluate

            cli_evaluate()
            return
        cli.parse_args()  # prints the help and exits, as in cli_evaluate
        return
    # an unknown option or a bad value refused by lm-eval's parser before torch and the model are imported (it took
    # 87 s at a load of 9), under this command's name (argparse's error named `lm-eval`)
    cli = lm_eval_parser(command_name())
    if cli is not None:
        sys.argv[1:] = rest
        try:
            cli.parse_args()  # inserts lm-eval's `run` into sys.argv where no command is given
        finally:
            sys.argv[:] = argv
    from runners.lm_harness import main as evaluate_command

    evaluate_command()
