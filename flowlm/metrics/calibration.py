"""Confidence calibration of per-token predictions: the ROC curve and its area (AUROC) of "confidence ≥ τ predicts a
right token". NumPy only: training callbacks score their samples with it, the report pools seeds with it."""

from __future__ import annotations

import numpy as np


def roc_curve(confidence: np.ndarray, correct: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(false-positive rate, true-positive rate) of 'confidence ≥ τ predicts a right token', over every τ.

    Starts at (0, 0) and ends at (1, 1); tied confidences form one step. Needs both right and wrong tokens.
    """
    confidence, correct = np.asarray(confidence, np.float64), np.asarray(correct, bool)
    positives, negatives = correct.sum(), (~correct).sum()
    if positives == 0 or negatives == 0:
        raise ValueError("a ROC curve needs both right and wrong tokens")
    order = np.argsort(-confidence, kind="stable")
    conf, hit = confidence[order], correct[order]
    last_of_tie = np.r_[np.diff(conf) != 0, True]  # thresholds between distinct confidence values
    tp, fp = np.cumsum(hit)[last_of_tie], np.cumsum(~hit)[last_of_tie]
    return np.r_[0.0, fp / negatives], np.r_[0.0, tp / positives]


def auroc(confidence: np.ndarray, correct: np.ndarray) -> float:
    """P(a random right token is more confident than a random wrong one), ties counted ½; NaN if one class is
    missing. Mann–Whitney U with average ranks, equal to the area under ``roc_curve``."""
    confidence, correct = np.asarray(confidence, np.float64), np.asarray(correct, bool)
    positives, negatives = int(correct.sum()), int((~correct).sum())
    if positives == 0 or negatives == 0:
        return float("nan")
    ranks = _average_ranks(confidence)
    # U = (sum of the right tokens' ranks) − P(P+1)/2 counts (right, wrong) pairs ordered correctly.
    return float((ranks[correct].sum() - positives * (positives + 1) / 2) / (positives * negatives))


def _average_ranks(values: np.ndarray) -> np.ndarray:
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    starts = np.r_[True, np.diff(sorted_values) != 0]
    group = np.cumsum(starts) - 1
    first = np.flatnonzero(starts)
    counts = np.diff(np.r_[first, len(values)])
    average = first + (counts + 1) / 2  # 1-based mean rank of each tie group
    ranks = np.empty(len(values))
    ranks[order] = average[group]
    return ranks
