"""Every console command ends a user error with one line, `<command>: error: <message>`, and exit status 2, no
traceback (issue 49: Hydra printed its own traceback under the suite's message, `flowlm-export` and `flowlm-lm-eval`
had no wrapper); a bug keeps its traceback, and FLOWLM_TRACEBACK=1 or HYDRA_FULL_ERROR=1 shows a user error's
(runners/console.py, docs/reliability.md). `flowlm-lm-eval --help` imports neither lm-eval's evaluator nor torch."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException, InstantiationException
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue

from runners.common import RunExistsError, check_budgets
from runners.console import USER_ERROR_STATUS, is_user_error, user_error_line, user_errors
from tests.process_helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
# A console script as pip writes it: its entry point from pyproject.toml, run under its own name.
ENTRY = "import sys\nfrom {module} import {name} as main\nsys.argv[0] = {command!r}\nsys.exit(main())"


def command(name: str, *args: str) -> list[str]:
    module, _, function = SCRIPTS[name].partition(":")
    return [sys.executable, "-c", ENTRY.format(module=module, name=function, command=name), *args]


def _raise_in(tmp_path: Path, module: str, body: str) -> BaseException:
    """The exception that ``body`` raises as code of ``module`` (a file under ``tmp_path``, as a traceback reads it)."""
    path = tmp_path / f"{module.replace('.', '_')}{len(list(tmp_path.glob('*.py')))}.py"  # one file each: linecache
    path.write_text(f"def go():\n    {body}\n")
    scope = {"__name__": module, "RunExistsError": RunExistsError}
    exec(compile(path.read_text(), str(path), "exec"), scope)
    with pytest.raises(BaseException) as caught:
        scope["go"]()
    return caught.value


def test_what_counts_as_a_user_error(tmp_path):
    """The suite's own `raise` of a user-error kind or of its own class; Hydra's config errors; not a lookup or a call
    that failed in the suite's code, nor a library's ValueError, nor the suite's assertion."""
    with pytest.raises(ValueError) as refused:
        check_budgets(OmegaConf.create({"nfe": [1.5]}))  # a check of the suite, raised over several lines
    assert is_user_error(refused.value)
    assert is_user_error(_raise_in(tmp_path, "runners.probe", "raise FileNotFoundError('no such checkpoint: x')"))
    assert is_user_error(_raise_in(tmp_path, "runners.probe", "raise RunExistsError('the run exists')"))
    assert not is_user_error(_raise_in(tmp_path, "runners.probe", "return {}['key']"))  # a bug: a lookup
    assert not is_user_error(_raise_in(tmp_path, "runners.probe", "return len(1, 2)"))  # a bug: a bad call
    assert not is_user_error(_raise_in(tmp_path, "runners.probe", "raise AssertionError('invariant')"))
    assert not is_user_error(_raise_in(tmp_path, "torch.probe", "raise ValueError('inside a library')"))
    assert is_user_error(_raise_in(tmp_path, "lm_eval.probe", "raise ValueError('Tasks not found: x')"), ("lm_eval",))

    assert is_user_error(ConfigCompositionException("Could not override 'x'."))
    try:  # Hydra's instantiate wraps the constructor's error: the cause decides
        raise InstantiationException("Error in call to target 'x':\nValueError(...)") from refused.value
    except InstantiationException as wrapped:
        assert is_user_error(wrapped) and user_error_line(wrapped) == user_error_line(refused.value)
    bug = _raise_in(tmp_path, "runners.probe", "return {}['key']")
    try:
        raise InstantiationException("Error in call to target 'x'") from bug
    except InstantiationException as wrapped:
        assert not is_user_error(wrapped)
    assert user_error_line(KeyError("a key's message")) == "a key's message"  # not its repr


def test_a_config_error_is_the_suites_message_on_one_line(tmp_path):
    """A suite resolver's refusal reaches the user through OmegaConf's error: its message, without OmegaConf's
    prefix and key details; an unset mandatory value names the option to give."""
    path = tmp_path / "runners_probe_resolver.py"
    path.write_text("def refuse(value):\n    raise ValueError(f'name={value!r} is refused')\n")
    scope = {"__name__": "runners.probe"}
    exec(compile(path.read_text(), str(path), "exec"), scope)
    OmegaConf.register_new_resolver("probe_refuse", scope["refuse"])
    try:
        with pytest.raises(InterpolationResolutionError) as refused:
            OmegaConf.to_container(OmegaConf.create({"name": "${probe_refuse:../x}"}), resolve=True)
    finally:
        OmegaConf.clear_resolver("probe_refuse")
    assert is_user_error(refused.value) and user_error_line(refused.value) == "name='../x' is refused"
    with pytest.raises(MissingMandatoryValue) as missing:
        OmegaConf.to_container(OmegaConf.create({"ckpt_path": "???"}), throw_on_missing=True)
    assert is_user_error(missing.value)
    assert user_error_line(missing.value) == (
        "Missing mandatory value: ckpt_path: give it on the command line (ckpt_path=...)"
    )


def test_user_errors_prints_one_line_and_a_debug_switch_shows_the_traceback(tmp_path, monkeypatch, capsys):
    error = _raise_in(tmp_path, "runners.probe", "raise ValueError('eval.nfe holds 1.5:\\n  each must be an int')")
    monkeypatch.setattr(sys, "argv", ["flowlm-eval"])
    monkeypatch.delenv("FLOWLM_TRACEBACK", raising=False)
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    with pytest.raises(SystemExit) as stop, user_errors():
        raise error
    assert stop.value.code == USER_ERROR_STATUS == 2
    assert capsys.readouterr().err == "flowlm-eval: error: eval.nfe holds 1.5: each must be an int\n"
    main = type(sys)("__main__")
    main.__spec__ = type("Spec", (), {"name": "runners.evaluate"})()
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "runners" / "evaluate.py")])
    with pytest.raises(SystemExit), user_errors():
        raise error
    assert capsys.readouterr().err.startswith("python -m runners.evaluate: error: eval.nfe holds 1.5:")
    bug = _raise_in(tmp_path, "runners.probe", "return {}['key']")
    with pytest.raises(KeyError), user_errors():  # a bug passes, with its traceback
        raise bug
    for switch in ("FLOWLM_TRACEBACK", "HYDRA_FULL_ERROR"):
        with monkeypatch.context() as env:
            env.setenv(switch, "1")
            with pytest.raises(ValueError), user_errors():
                raise error


def test_every_command_is_wrapped():
    """Each console script of pyproject.toml is ``console_script``'s entry (a new command without it fails here)."""
    import importlib

    for name, target in SCRIPTS.items():
        module, _, function = target.partition(":")
        entry = getattr(importlib.import_module(module), function)
        assert entry.__code__.co_qualname == "console_script.<locals>.entry", name


# Each command's most common mistakes: (command and arguments, the last line of stderr). The missing checkpoints load
# torch first (seconds each): one per command that takes one.
MISTAKES = [
    (
        ("flowlm-train", "nosuch=1"),
        "flowlm-train: error: Could not override 'nosuch'. To append to your config use +nosuch=1 (Key 'nosuch' is "
        "not in struct)",
    ),
    (("flowlm-train", "experiment=nope"), "flowlm-train: error: In 'train': Could not find 'experiment/nope' "),
    (("flowlm-eval", "ckpt_path={tmp}/missing.ckpt"), "flowlm-eval: error: checkpoint not found: {tmp}/missing.ckpt "),
    (("flowlm-eval", "ckpt_path=x", "eval=nope"), "flowlm-eval: error: In 'eval': Could not find 'eval/nope' "),
    (("flowlm-report", "nosuch=1"), "flowlm-report: error: Could not override 'nosuch'."),
    (("flowlm-demo", "nosuch=1"), "flowlm-demo: error: Could not override 'nosuch'."),
    (("flowlm-mt-bench", "nosuch=1"), "flowlm-mt-bench: error: Could not override 'nosuch'."),
    (("flowlm-export", "{tmp}/missing", "{tmp}/out"), "flowlm-export: error: checkpoint not found: {tmp}/missing "),
    (
        ("flowlm-lm-eval", "--model", "flowlm", "--model_args", "checkpoint={tmp}/missing.ckpt", "--tasks", "flowlm_qa")
        + ("--include_path", str(ROOT / "tests" / "fixtures" / "lm_eval")),
        "flowlm-lm-eval: error: checkpoint not found: {tmp}/missing.ckpt ",
    ),
]


def test_each_commands_common_mistakes_end_in_one_line(tmp_path):
    """Run as a user runs them (their pyproject.toml entry points, in fresh processes, three at a time): exit status 2,
    the message as stderr's last line, no traceback; with HYDRA_FULL_ERROR=1 the traceback is back."""
    env = subprocess_env(tmp_path, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")

    def run(args: tuple[str, ...], extra: dict | None = None) -> subprocess.CompletedProcess:
        cmd = command(args[0], *(arg.format(tmp=tmp_path) for arg in args[1:]))
        return subprocess.run(
            cmd, cwd=tmp_path, env={**env, **(extra or {})}, capture_output=True, text=True, timeout=300
        )

    with ThreadPoolExecutor(3) as pool:
        done = list(pool.map(run, [args for args, _ in MISTAKES]))
        debug = pool.submit(run, ("flowlm-train", "nosuch=1"), {"HYDRA_FULL_ERROR": "1"})
    for (args, expected), proc in zip(MISTAKES, done, strict=True):
        last = proc.stderr.rstrip("\n").splitlines()[-1] if proc.stderr.strip() else ""
        where = f"{' '.join(args)}:\n{proc.stderr[-3000:]}"
        assert proc.returncode == 2, where
        assert last.startswith(expected.format(tmp=tmp_path)), where
        assert "Traceback" not in proc.stderr + proc.stdout and "HYDRA_FULL_ERROR" not in proc.stderr, where
        assert "Error executing job" not in proc.stderr, where
    assert debug.result().returncode == 1 and "Traceback" in debug.result().stderr


# lm-eval's helpers (lm_eval.utils: numpy, requests, jinja2), which its cli_evaluate imports for its logging alone:
# 1.4 s of a 3.3 s --help at a load of 8 on 2 cores
HEAVY = ("lm_eval.utils", "numpy", "requests", "jinja2")
HELP = """
import json, sys
HEAVY = {heavy!r}
from {module} import {name} as main
sys.argv = ["flowlm-lm-eval", "--help"]
try:
    main()
except SystemExit as stop:
    assert not stop.code, stop.code
print(json.dumps(sorted({{"torch", "lm_eval.evaluator", "runners.lm_harness", *HEAVY}} & set(sys.modules))))
"""


def test_lm_eval_help_imports_neither_the_evaluator_nor_torch(tmp_path):
    """`flowlm-lm-eval --help` reads its arguments before importing lm-eval's evaluator and torch (8 s → 0.3 s), and
    builds lm-eval's parser alone, without lm-eval's helpers (HEAVY): the help of lm-eval's command line, with the
    command's own options first."""
    module, _, function = SCRIPTS["flowlm-lm-eval"].partition(":")
    code = HELP.format(module=module, name=function, heavy=HEAVY)
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=subprocess_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[-1]) == []
    assert "--mlflow_tracking_uri" in proc.stdout and "usage: lm-eval" in proc.stdout


UNKNOWN_OPTION = """
import json, sys
from {module} import {name} as main
sys.argv = ["flowlm-lm-eval", "--model", "flowlm", "--nosuch", "1"]
try:
    main()
except SystemExit as stop:
    print(json.dumps([stop.code, sorted({{"torch", "runners.lm_harness"}} & set(sys.modules))]))
"""


def test_lm_eval_refuses_an_unknown_option_under_its_own_name_before_importing_torch(tmp_path):
    """lm-eval's parser reads the arguments before torch and the model are imported (87 s at a load of 9 before the
    refusal), and its error names the command the user ran, not `lm-eval`."""
    module, _, function = SCRIPTS["flowlm-lm-eval"].partition(":")
    proc = subprocess.run(
        [sys.executable, "-c", UNKNOWN_OPTION.format(module=module, name=function)],
        cwd=tmp_path,
        env=subprocess_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert json.loads(proc.stdout.splitlines()[-1]) == [2, []], proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == "flowlm-lm-eval: error: unrecognized arguments: --nosuch 1", proc.stderr


def test_the_report_refuses_a_store_that_does_not_exist_and_makes_nothing(tmp_path):
    """A mistyped SQLite store: MLflow made its folder and an empty database, and the report said "no runs in
    experiments ['Default']"; now one line names the missing store, and nothing is made."""
    from runners.report import report
    from tests.conftest import compose_config

    uri = f"sqlite:///{tmp_path}/typo/mlflow.db"
    cfg = compose_config("report", [f"tracking_uri={uri}", f"out={tmp_path}/out", f"paths.root={tmp_path}"])
    with pytest.raises(FileNotFoundError, match=rf"^tracking_uri: no MLflow store at {tmp_path}/typo/mlflow.db "):
        report(cfg)
    assert not (tmp_path / "typo").exists()
