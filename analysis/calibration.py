"""Confidence calibration in the report: tokens pooled over seeds and scored (flowlm/metrics/calibration.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from flowlm.metrics.calibration import auroc


def pool_and_score(calibration: pd.DataFrame) -> pd.DataFrame:
    """Pool tokens over the runs (seeds) of each experiment × name × sampler × budget; add AUROC, token count and
    the share of wrong tokens. Keeps the pooled arrays for plotting ROC curves."""
    keys = ["experiment", "name", "sampler", "nfe_budget", "kind"]
    lines = []
    for key, part in calibration.groupby(keys, sort=False):
        conf = np.concatenate(list(part["confidence"]))
        ok = np.concatenate(list(part["correct"]))
        lines.append(
            {
                **dict(zip(keys, key, strict=True)),
                "runs": len(part),
                "tokens": len(conf),
                "wrong": float((~ok).mean()) if len(ok) else float("nan"),
                "auroc": auroc(conf, ok),
                "confidence": conf,
                "correct": ok,
            }
        )
    columns = [*keys, "runs", "tokens", "wrong", "auroc", "confidence", "correct"]
    return pd.DataFrame(lines, columns=columns).sort_values(keys[:4], ignore_index=True)
