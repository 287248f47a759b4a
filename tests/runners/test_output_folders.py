"""Issue 49: every output folder is checked writable before any compute (runners/outputs.py ``check_writable``):
``flowlm-export``'s OUT_DIR, ``flowlm-eval results_csv=``, ``flowlm-train callbacks.results_csv.dir=``,
``flowlm-mt-bench out_dir=`` (answers and judgments) and ``flowlm-lm-eval --output_path``. A read-only folder was
found only once the results were written, after the model was loaded and every sample drawn; now it is refused in one
line naming the option and the folder, before the weights are read, and what the folder holds is untouched."""

# ruff: noqa: F811 - the fixtures imported from the modules that define them are test arguments here
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from runners import mt_bench
from runners.outputs import check_writable
from tests.conftest import FAST, compose_config
from tests.pretrained.test_export import write_run_checkpoint
from tests.process_helpers import subprocess_env
from tests.runners.test_mt_bench import (  # noqa: F401 - fixtures
    JUDGE,
    SMALL,
    JudgeServer,
    checkpoints,
    config,
    judged,
    questions,
    write_answers,
)
from tests.runners.test_user_errors import command

WRITE = r"cannot be written: .* is not writable \(read-only filesystem or permissions\)"


@pytest.fixture
def read_only(tmp_path):
    """``make(name, files={relative path: text})``: a folder under tmp_path holding ``files`` that this process
    cannot write: chmod 0o500 (its files 0o400) where permissions bind, else (root) a tmpfs remounted read-only; the
    test is skipped where neither can be had."""
    mounted: list[Path] = []
    chmodded: list[Path] = []

    def make(name: str, files: dict[str, str] | None = None) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        as_root = os.geteuid() == 0
        if as_root:
            if shutil.which("mount") is None:
                pytest.skip("root writes through permissions, and mount(8) is not here for a read-only tmpfs")
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(folder)], capture_output=True)
            if done.returncode != 0:
                pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
            mounted.append(folder)
        for relative, text in (files or {}).items():
            (folder / relative).parent.mkdir(parents=True, exist_ok=True)
            (folder / relative).write_text(text)
        if as_root:
            done = subprocess.run(["mount", "-o", "remount,ro", str(folder)], capture_output=True)
            if done.returncode != 0:
                pytest.skip(f"cannot remount the tmpfs read-only: {done.stderr.decode().strip()}")
        else:
            for path in sorted(folder.rglob("*"), reverse=True) + [folder]:
                path.chmod(0o500 if path.is_dir() else 0o400)
                chmodded.append(path)
        if os.access(folder, os.W_OK):
            pytest.skip("this process can write the folder whatever its mode")
        return folder

    yield make
    for folder in mounted:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)
    for path in chmodded:
        path.chmod(0o700 if path.is_dir() else 0o600)


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_check_writable_names_the_option_and_the_folder(tmp_path, read_only):
    folder = read_only("ro")
    with pytest.raises(PermissionError, match=f"^results_csv: {folder}/a/b {WRITE}") as refused:
        check_writable("results_csv", folder / "a" / "b")
    assert "\n" not in str(refused.value) and "give another results_csv" in str(refused.value)
    (tmp_path / "file").write_text("x")
    with pytest.raises(NotADirectoryError, match=f"^out_dir: {tmp_path}/file/sub cannot be made: .* is a file"):
        check_writable("out_dir", tmp_path / "file" / "sub")
    assert check_writable("out_dir", tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # nothing is made by the check


def test_export_into_a_read_only_folder_is_refused_before_the_checkpoint_is_read(tmp_path, read_only, monkeypatch):
    import lightning_modules.checkpoints as checkpoints_module
    from runners.export import export

    write_run_checkpoint(tmp_path / "last.ckpt")
    folder = read_only("ro")
    monkeypatch.setattr(checkpoints_module, "read_checkpoint", lambda *a, **k: pytest.fail("the checkpoint was read"))
    with pytest.raises(PermissionError, match=f"^out_dir: {folder}/export {WRITE}"):
        export(tmp_path / "last.ckpt", folder / "export")


def test_flowlm_eval_into_a_read_only_results_folder_is_refused_before_the_weights_are_read(
    tmp_path, runs_env, read_only, monkeypatch
):
    import lightning_modules.checkpoints as checkpoints_module
    from runners.evaluate import evaluate

    ckpt = tmp_path / "last.ckpt"
    write_run_checkpoint(ckpt, config={"task": "tiny"})
    held = {"tiny/tiny_mdm_seed0_eval.csv": "rows of an earlier evaluation\n"}
    folder = read_only("results", held)
    monkeypatch.setattr(checkpoints_module, "load_module", lambda *a, **k: pytest.fail("the weights were read"))
    cfg = compose_config("eval", [f"ckpt_path={ckpt}", f"results_csv={folder}", "logger=none", "eval.nfe=[1]"])
    with pytest.raises(PermissionError, match=f"^results_csv: {folder}/tiny {WRITE}") as refused:
        evaluate(cfg)
    assert "\n" not in str(refused.value) and _files(folder) == held
    # a checkpoint that records no task cannot join a results folder: said before the weights are read too
    write_run_checkpoint(ckpt, config={"name": ""})
    with pytest.raises(ValueError, match="records no run name and task: its rows cannot join a results folder"):
        evaluate(compose_config("eval", [f"ckpt_path={ckpt}", f"results_csv={tmp_path}", "logger=none"]))


def test_flowlm_train_with_a_read_only_results_folder_is_refused_before_anything_is_built(runs_env, read_only):
    from runners.train import train

    folder = read_only("results")
    overrides = ["experiment=sudoku_mdm_easy", "scale=cpu", *FAST, f"callbacks.results_csv.dir={folder}"]
    with pytest.raises(PermissionError, match=f"^callbacks.results_csv.dir: {folder}/sudoku_easy_6x6 {WRITE}"):
        train(compose_config(overrides=overrides))
    assert not (runs_env / "runs").exists()  # no run folder, no MLflow store


def test_mt_bench_into_a_read_only_out_dir_draws_no_answer_and_sends_no_judgment(
    checkpoints, questions, tmp_path, read_only, monkeypatch
):
    """step=generate into a read-only out_dir: refused before any answer is drawn (it was written after all were);
    step=judge with a read-only judgment file: refused before any request, the judgments kept."""
    monkeypatch.setattr(mt_bench, "generate_answers", lambda *a, **k: pytest.fail("answers were drawn"))
    folder = read_only("out")
    common = [f"questions={questions}", "logger=none", *SMALL]
    cfg = config(tmp_path, f"ckpt_path={checkpoints['mdm']}", "step=generate", *common, f"out_dir={folder}")
    with pytest.raises(PermissionError, match=f"^out_dir: {folder}/model_answer {WRITE}"):
        mt_bench.run(cfg)
    written = write_answers(tmp_path / "answers")  # <tmp>/answers/out/model_answer/m.jsonl
    judgments = {"model_judgment/m/" + f"{JUDGE}_single.jsonl": '{"question_id": 81}\n'}
    held = {"model_answer/m.jsonl": written.read_text(), **judgments}
    folder = read_only("judged", held)
    with JudgeServer(failures=0) as server:
        cfg = config(tmp_path, "step=judge", "model_id=m", *common, *judged(server), f"out_dir={folder}")
        with pytest.raises(PermissionError, match=f"^out_dir: {folder}/model_judgment/m {WRITE}"):
            mt_bench.run(cfg)
    assert server.completions() == [] and _files(folder) == held


def test_lm_eval_output_path_read_only_is_refused_before_the_model_is_built(tmp_path, read_only):
    from lm_eval.loggers import EvaluationTracker

    from runners import lm_harness

    ckpt = tmp_path / "last.ckpt"
    write_run_checkpoint(ckpt)
    folder = read_only("out")

    def never(model=None, model_args=None, evaluation_tracker=None):
        pytest.fail("the evaluation ran")

    for output, shown in ((folder, folder), (folder / "sub" / "results.json", folder / "sub")):
        tracker = EvaluationTracker(output_path=str(output))
        with pytest.raises(PermissionError, match=f"^--output_path: {shown} {WRITE}"):
            evaluate = lm_harness.tracked(never, "none")
            evaluate(model="flowlm", model_args=f"checkpoint={ckpt}", evaluation_tracker=tracker)


def test_each_command_refuses_a_read_only_output_folder_in_one_line(tmp_path, read_only):
    """As a user runs them (their pyproject.toml entry points, fresh processes): exit status 2, the option and the
    folder on stderr's last line, no traceback."""
    ckpt = tmp_path / "last.ckpt"
    write_run_checkpoint(ckpt, config={"task": "tiny"})
    folder = read_only("ro")
    cases = [
        (("flowlm-export", str(ckpt), f"{folder}/export"), f"out_dir: {folder}/export cannot be written"),
        (
            ("flowlm-eval", f"ckpt_path={ckpt}", f"results_csv={folder}", "logger=none"),
            f"results_csv: {folder}/tiny cannot be written",
        ),
        (
            ("flowlm-train", "experiment=sudoku_mdm_easy", "scale=cpu", f"callbacks.results_csv.dir={folder}"),
            f"callbacks.results_csv.dir: {folder}/sudoku_easy_6x6 cannot be written",
        ),
    ]
    _one_line_each(tmp_path, folder, cases)


def test_hydras_own_output_folder_read_only_is_refused_in_one_line(tmp_path, read_only):
    """Hydra makes its output folder before the task runs (``flowlm-report out=``, a run folder under ``paths.root``):
    its mkdir failed under a traceback; ``${flowlm.output_dir:...}`` checks it as Hydra resolves it."""
    folder = read_only("ro")
    cases = [
        (("flowlm-report", f"out={folder}/report"), f"out: {folder}/report cannot be written"),
        (
            ("flowlm-train", "experiment=sudoku_mdm_easy", "scale=cpu", "paths.root=" + str(folder / "runs")),
            f"paths.root: {folder}/runs/sudoku_mdm_easy/cpu/seed0 cannot be written",
        ),
    ]
    _one_line_each(tmp_path, folder, cases)


def _one_line_each(tmp_path: Path, folder: Path, cases: list) -> None:
    env = subprocess_env(tmp_path, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    for args, expected in cases:
        proc = subprocess.run(
            command(*args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300, check=False
        )
        where = f"{' '.join(args)}:\n{proc.stderr[-3000:]}"
        last = proc.stderr.rstrip("\n").splitlines()[-1] if proc.stderr.strip() else ""
        assert proc.returncode == 2 and last.startswith(f"{args[0]}: error: {expected}"), where
        assert "Traceback" not in proc.stderr + proc.stdout, where
    assert list(folder.iterdir()) == []
