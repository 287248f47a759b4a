"""The kind of the suite's MLflow experiments: the experiment tag ``mlflow.experimentKind`` set to
``custom_model_development`` (runs with metrics and artifacts: training, evaluation, sweeps, reports; no GenAI
traces). MLflow 3's UI chooses an experiment's view from this tag where its workflow-based navigation is off: the
runs table instead of the GenAI overview (traces, "no data"). The UI of MLflow 3.17 (the pinned version) chooses it
from the sidebar's "GenAI | Model training" switch instead, remembered per browser (a link can carry
``?workflowType=machine_learning``); there the tag records the kind without choosing the view. A leaf module: no
import of the suite's other modules."""

from __future__ import annotations

from typing import Any

EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING = "custom_model_development"


def mark_model_training(client: Any, experiment_id: str | None) -> None:
    """Tag the experiment as model training, unless it already has a kind (a user's choice is kept). ``client``:
    an MlflowClient, or a guarded one whose failed calls return None (then nothing is tagged)."""
    if experiment_id is None:
        return
    experiment = client.get_experiment(experiment_id)
    if experiment is not None and EXPERIMENT_KIND_TAG not in experiment.tags:
        client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING)
