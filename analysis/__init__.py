"""MLflow → pandas → tables and figures: speed–quality curves, the papers' tables, sweep heat-maps, calibration."""

from analysis.load import NoRunsError, eval_table, load_runs, long_metrics, summarize
from analysis.report import Report, build_report, log_report

__all__ = [
    "NoRunsError",
    "Report",
    "build_report",
    "eval_table",
    "load_runs",
    "log_report",
    "long_metrics",
    "summarize",
]
