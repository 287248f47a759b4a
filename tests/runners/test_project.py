"""flowlm/project.py: the checkout's folders and the commit a process runs."""

from __future__ import annotations

from pathlib import Path

import flowlm.project as project


def test_the_folders_are_the_checkouts():
    assert (project.PROJECT_DIR / "flowlm" / "project.py").is_file()
    assert Path(project.CONF_DIR, "train.yaml").is_file()


def test_the_commit_is_read_once_per_process(monkeypatch):
    """A checkout updated while a run trains (the campaign's clone pulling new commits) does not change the commit
    the run records: the first answer is kept."""
    answers = iter(["aaaa", "bbbb"])
    monkeypatch.setattr(project, "_COMMIT", None)
    monkeypatch.setattr(project, "_read_commit", lambda: next(answers))
    assert project.git_commit() == "aaaa"
    assert project.git_commit() == "aaaa"  # not bbbb: the clone moved on, the process did not


def test_the_commit_is_this_checkouts():
    got = project._read_commit()
    assert got == "unknown" or len(got.removesuffix("-dirty")) == 40
