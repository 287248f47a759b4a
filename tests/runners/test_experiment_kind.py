"""The suite's MLflow experiments carry the experiment kind MLflow 3's UI reads (``mlflow.experimentKind`` =
``custom_model_development``, see flowlm/experiment_kind.py), wherever the suite creates one; a kind a user set is
kept."""

from __future__ import annotations

from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from flowlm.experiment_kind import EXPERIMENT_KIND_TAG, MODEL_TRAINING, mark_model_training
from runners.common import resolve_paths
from runners.mlflow_run import make_logger
from runners.trial import record_failure
from tests.conftest import compose_config

EXPERIMENT = ["experiment=sudoku_mdm_uncond", "scale=cpu"]


def _config(*overrides: str):
    cfg = compose_config(overrides=[*EXPERIMENT, *overrides])
    resolve_paths(cfg)
    return cfg


def _kind(cfg) -> str | None:
    client = MlflowClient(tracking_uri=cfg.logger.tracking_uri)
    return client.get_experiment_by_name(cfg.logger.experiment_name).tags.get(EXPERIMENT_KIND_TAG)


def test_the_training_logger_marks_its_experiment_and_keeps_a_users_kind(runs_env):
    # the tag and value MLflow's UI reads (its bundle's ExperimentKind.CUSTOM_MODEL_DEVELOPMENT)
    assert (EXPERIMENT_KIND_TAG, MODEL_TRAINING) == ("mlflow.experimentKind", "custom_model_development")
    cfg = _config()
    make_logger(cfg, runs_env / "run")  # the experiment is created by the logger
    assert _kind(cfg) == MODEL_TRAINING
    user = _config("task=chosen")
    client = MlflowClient(tracking_uri=user.logger.tracking_uri)
    client.create_experiment(
        "chosen", artifact_location=str(runs_env / "art"), tags={EXPERIMENT_KIND_TAG: "genai_development"}
    )
    make_logger(user, runs_env / "other")
    assert _kind(user) == "genai_development"


def test_a_trial_that_failed_before_its_run_existed_creates_a_marked_experiment(runs_env):
    cfg = _config()
    trial = {"trial": 0, "trial_id": "t0", "dir": str(runs_env), "sweeper": "basic", "overrides": [], "attempt": "a0"}
    OmegaConf.update(cfg, "sweep", {**OmegaConf.to_container(cfg.sweep), **trial}, force_add=True)
    record_failure(cfg, ValueError("crashed before its MLflow run"))
    client = MlflowClient(tracking_uri=cfg.logger.tracking_uri)
    experiment = client.get_experiment_by_name(cfg.logger.experiment_name)
    assert experiment.tags.get(EXPERIMENT_KIND_TAG) == MODEL_TRAINING
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FAILED"  # the record itself was made


def test_marking_is_skipped_when_a_guarded_client_could_not_read_the_experiment():
    class Unreachable:  # a resilient logger's client: a failed call returns None
        def get_experiment(self, experiment_id):
            return None

        def set_experiment_tag(self, *args):
            raise AssertionError("tagged an experiment it could not read")

    mark_model_training(Unreachable(), "1")
    mark_model_training(Unreachable(), None)
