"""The multirun around a sweep's trials (the trials themselves: runners/trial.py): Hydra's callback that prepares the
runs folder and the Optuna storage, continues a relaunched study, and ends a multirun with a failed trial with status 1.

The sweeps themselves are configs (``conf/hparams_search/``). The top floor: nothing of the suite imports this package.
"""
