"""The PR-vs-MDM benchmark's table and NFE-ratio logic on synthetic rows."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from pr_vs_mdm import report  # noqa: E402


def _rows(model, sampler, values, seeds=(0, 1)):
    return [
        {"model": model, "sampler": sampler, "nfe_budget": b, "valid_pct": v + seed, "seed": seed}
        for b, v in values.items()
        for seed in seeds
    ]


def test_report_finds_the_nfe_at_which_pr_matches_the_best_mdm():
    rows = (
        _rows("MDM", "ancestral", {3: 0, 12: 5, 36: 20})
        + _rows("MDM", "confidence", {3: 0, 12: 10, 36: 80})
        + _rows("FMLM+ scratch", "pr", {3: 1, 12: 30, 36: 60})
        + _rows("FMLM+ MDM-init", "pr", {3: 40, 12: 85, 36: 95})
    )
    text = report(rows, [3, 12, 36], {"MDM": [1.0]})
    assert "| MDM | confidence | 0.5 ± 0.7 | 10.5 ± 0.7 | 80.5 ± 0.7 |" in text
    assert "Best MDM sampler at full NFE 36: confidence with 80.5 % valid." in text
    assert "FMLM+ MDM-init PR reaches it at NFE 12: 12/36 = 1/3" in text
    assert "FMLM+ scratch PR does not reach it within the budgets (best 60.5 % at NFE 36)." in text
