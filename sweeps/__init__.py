"""Sweep orchestration: one trial per Hydra job, its objective for the sweeper, its MLflow tags, its failure.

The sweeps themselves are configs (``conf/hparams_search/``); this package only connects a trial to them.
"""
