"""The GSM8K execution sandbox is an operating-system boundary (issue 15), not only Python's AST whitelist.

A program that gets past the Python-level guard (the issue's ``functools.update_wrapper`` escape hands it ``os``)
still runs no command, writes nothing outside its empty scratch folder, connects nowhere (127.0.0.1 included), sees
neither the parent's environment nor its processes nor root's files, and cannot fork. The operating-system layer
is tested on its own by running programs with the Python-level guard off (``_spawn(..., python_guard=False)``).
Tests that need namespaces skip, naming why, where the machine cannot set them up; as root (this machine, CI) they
run. Where no isolation exists, ``scorer=execute`` is refused before anything is sampled unless ``python_only``.
"""

import functools
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from callbacks.sampling_eval import SamplingEvaluation
from flowlm.metrics import gsm8k
from flowlm.metrics.gsm8k import Isolation, SandboxUnavailableError, execute_responses, isolation, run_program
from flowlm.metrics.text_metrics import GSM8KAccuracy
from flowlm.samplers import ConfidenceSampler

# The issue's escape: update_wrapper copies statistics.mean.__globals__ onto an object whose __setattr__ keeps it.
ESCAPE = """
import functools
import statistics

store = {}


class W:
    def __setattr__(self, name, value):
        store[name] = value


def simple_math_problem():
    functools.update_wrapper(W(), statistics.mean, assigned=("__globals__",), updated=())
    os = store["__globals__"]["sys"].modules["os"]
    return ACTION
"""
FORMAT_LEAK = """
import random


def simple_math_problem():
    raise ValueError("{0.__func__.__globals__[_os].environ}".format(random.seed))
"""
# the same leak, aimed at one variable (a whole environment would be cut at the message's 300 characters)
FORMAT_LEAK_ONE = FORMAT_LEAK.replace(".environ}", ".environ[FLOWLM_SANDBOX_SECRET]}")
SECRET = "flowlm-test-secret-4711"
SLOW_OK = 30.0  # these programs finish at once; the limit only matters on a machine starved by other jobs


def os_isolation() -> Isolation:
    """This machine's OS isolation, or a skip that says why there is none."""
    try:
        return isolation("os")
    except SandboxUnavailableError as err:
        pytest.skip(f"no OS sandbox can be set up here: {err}")


def observe(code: str) -> str:
    """Run ``code`` under the OS isolation alone (Python-level guard off); what it reports is its error message."""
    result = gsm8k._spawn(
        code, os_isolation(), timeout_s=SLOW_OK, memory_mb=512, entry="simple_math_problem", python_guard=False
    )
    assert result.status == "error", result  # every program below reports by raising
    return result.message


def reporting(expression: str, imports: str = "import os") -> str:
    """A program that raises ValueError(repr(expression))."""
    return f"{imports}\n\n\ndef simple_math_problem():\n    raise ValueError(repr(({expression})))\n"


@pytest.fixture
def fresh_detection():
    """Forget the detected isolation before and after the test (it is cached per process)."""
    gsm8k._os_isolation.cache_clear()
    yield
    gsm8k._os_isolation.cache_clear()


def test_the_issue_escape_runs_no_command_and_is_not_root():
    os_isolation()
    ran = run_program(ESCAPE.replace("ACTION", "os.system('exit 7') >> 8"), timeout_s=SLOW_OK)  # 7 only if a shell ran
    assert ran.status == "forbidden" or (ran.status == "ok" and ran.value != 7.0), ran
    uid = run_program(ESCAPE.replace("ACTION", "os.getuid()"), timeout_s=SLOW_OK)
    assert uid.status == "forbidden" or (uid.status == "ok" and uid.value != 0.0), uid


def test_the_format_string_leak_shows_no_secret(monkeypatch):
    os_isolation()
    monkeypatch.setenv("FLOWLM_SANDBOX_SECRET", SECRET)
    for leak in (FORMAT_LEAK, FORMAT_LEAK_ONE):
        result = run_program(leak, timeout_s=SLOW_OK)
        assert result.status in ("error", "forbidden") and SECRET not in result.message, result


def test_scratch_is_empty_and_writable_everything_else_read_only():
    assert observe(reporting("os.listdir('.')")) == "ValueError: []"
    assert observe(reporting("[open('made', 'w').close(), os.listdir('.')]")) == "ValueError: [None, ['made']]"
    assert "No space left on device" in observe(reporting("[open(str(i), 'w').close() for i in range(1000)]"))
    targets = [Path("/tmp") / f"flowlm-escape-{os.getpid()}"]  # world-writable folders: only the mount stops it
    targets += [Path("/dev/shm") / f"flowlm-escape-{os.getpid()}"] if Path("/dev/shm").is_dir() else []
    try:
        for target in targets:
            message = observe(reporting(f"open({str(target)!r}, 'w')"))
            assert "Read-only file system" in message and not target.exists(), message
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


def test_no_network_not_even_to_a_server_of_the_parent_on_loopback():
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    # by libc: the interpreter's socket module may be unreadable after the switch to uid 65534 (/root/.pyenv)
    message = observe(
        f"""import ctypes
import os
import struct


def simple_math_problem():
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.socket(2, 1, 0)  # AF_INET, SOCK_STREAM
    address = struct.pack("=H", 2) + struct.pack("!H", {port}) + bytes([127, 0, 0, 1]) + bytes(8)
    raise ValueError(repr((fd >= 0, libc.connect(fd, address, 16), os.strerror(ctypes.get_errno()))))
"""
    )
    assert message.startswith("ValueError: (True, -1, "), message  # a socket, but no connection
    server.setblocking(False)
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()


def test_parent_environment_and_processes_are_out_of_sight(monkeypatch):
    monkeypatch.setenv("FLOWLM_SANDBOX_SECRET", SECRET)
    seen = "os.environ.get('FLOWLM_SANDBOX_SECRET'), sorted(set(os.environ) - {'LC_CTYPE'})"  # Python's own
    assert observe(reporting(seen)) == "ValueError: (None, [])"
    parent = os.getpid()
    assert SECRET not in observe(reporting(f"open('/proc/{parent}/environ').read()"))
    # its own pid namespace: only itself (and bubblewrap's init) in /proc, no signal reaches the parent
    assert int(observe(reporting("len([p for p in os.listdir('/proc') if p.isdigit()])"))[12:]) <= 2
    assert "Error" in observe(reporting(f"os.kill({parent}, 0)"))


def test_as_root_the_program_runs_as_nobody_and_cannot_read_root_files(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("run by another user, the program runs as that user and reads what it reads (documented)")
    secret = tmp_path / "root_only"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    tmp_path.chmod(0o755)
    message = observe(reporting(f"open({str(secret)!r}).read()"))
    assert "Permission denied" in message and SECRET not in message, message
    assert observe(reporting("os.getuid(), os.getgid(), os.getgroups()")) == "ValueError: (65534, 65534, [])"
    assert "Operation not permitted" in observe(reporting("os.setuid(0)"))
    # no capability left to undo the read-only remount (MS_REMOUNT | MS_BIND, without MS_RDONLY)
    remount = "ctypes.CDLL(None, use_errno=True).mount(None, b'/', None, 0x1020, None), ctypes.get_errno()"
    assert observe(reporting(remount, "import ctypes")) == "ValueError: (-1, 1)"  # EPERM


def test_no_fork_and_no_command():
    assert "BlockingIOError" in observe(reporting("os.fork()"))
    assert observe(reporting("os.system('exit 7') >> 8")) != "ValueError: 7"


def readable_python_for_nobody() -> str | None:
    """An interpreter uid 65534 can start and that can import the checkout's gsm8k module by path, else None."""
    module = str(Path(gsm8k.__file__))
    script = f"import os, sys; sys.exit(not (os.access(sys.executable, os.X_OK) and os.access({module!r}, os.R_OK)))"
    for python in dict.fromkeys([os.path.realpath(sys.executable), shutil.which("python3", path="/usr/bin:/bin")]):
        if python and as_nobody([python, "-I", "-S", "-c", script]).returncode == 0:
            return python
    return None


def as_nobody(command: list[str], path: str = "/usr/bin:/bin") -> subprocess.CompletedProcess:
    setpriv = [shutil.which("setpriv"), "--reuid=65534", "--regid=65534", "--clear-groups", "--"]
    return subprocess.run(setpriv + command, capture_output=True, text=True, env={"PATH": path}, cwd="/", timeout=60)


NOBODY_SCRIPT = """
import importlib.util, json, os, sys
spec = importlib.util.spec_from_file_location("gsm8k_as_user", sys.argv[1])
gsm8k = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gsm8k)
candidates = gsm8k._os_candidates  # only the backend under test
gsm8k._os_candidates = lambda: [c for c in candidates() if c.name == sys.argv[3]]
how = gsm8k.isolation("os")
def observe(expression, imports="import os"):
    code = f"{imports}\\ndef simple_math_problem():\\n    raise ValueError(repr(({expression})))\\n"
    kwargs = dict(timeout_s=30.0, memory_mb=512, entry="simple_math_problem", python_guard=False)
    return gsm8k._spawn(code, how, **kwargs).message
print(json.dumps({
    "name": how.name,
    "ok": gsm8k.run_program("def simple_math_problem():\\n    return 6 * 7\\n", timeout_s=30.0).value,
    "write": observe(f"open({sys.argv[4]!r}, 'w')"),
    "scratch": observe("[open('made', 'w').close(), os.listdir('.')]"),
    "fork": observe("os.fork()"),
    "connect": observe(  # to the test's server on 127.0.0.1, port argv[2]
        "(lambda libc: libc.connect(libc.socket(2, 1, 0), struct.pack('=H', 2) + struct.pack('!H', PORT)"
        " + bytes([127, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]), 16))(ctypes.CDLL(None))".replace("PORT", sys.argv[2]),
        "import ctypes, struct"),
    "remount": observe(
        "ctypes.CDLL(None, use_errno=True).mount(None, b'/', None, 0x1020, None)", "import ctypes"),
}))
"""


@pytest.mark.parametrize("backend", ["unshare, user namespace", "bwrap"])
def test_a_user_other_than_root_gets_an_os_sandbox_too(backend):
    """The non-root paths, as uid 65534: unshare in a user namespace, and bwrap where installed (one at a time)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to switch to uid 65534")
    if as_nobody(["unshare", "--user", "--map-root-user", "--net", "--mount", "true"]).returncode != 0:
        pytest.skip("unprivileged user namespaces are disabled on this machine")
    python = readable_python_for_nobody()
    if python is None:
        pytest.skip("no interpreter and checkout readable by uid 65534")
    tool = shutil.which(backend.split(",")[0])
    if tool is None:
        pytest.skip(f"{backend.split(',')[0]} is not installed")
    server = socket.create_server(("127.0.0.1", 0))
    port = str(server.getsockname()[1])
    target = Path("/tmp") / f"flowlm-escape-{os.getpid()}-{backend.split(',')[0]}"  # /tmp: world-writable
    command = [python, "-I", "-S", "-c", NOBODY_SCRIPT, gsm8k.__file__, port, backend, str(target)]
    try:
        run = as_nobody(command, path=f"{os.path.dirname(tool)}:/usr/bin:/bin")
        written = target.exists()
    finally:
        target.unlink(missing_ok=True)
    assert run.returncode == 0, run.stderr[-2000:]
    server.setblocking(False)
    with pytest.raises(BlockingIOError):
        server.accept()
    server.close()
    seen = json.loads(run.stdout)
    assert seen["name"] == backend and seen["ok"] == 42.0
    assert "Read-only file system" in seen["write"] and not written
    assert seen["scratch"] == "ValueError: [None, ['made']]"
    assert "BlockingIOError" in seen["fork"]
    assert seen["connect"] == "ValueError: -1" and seen["remount"] == "ValueError: -1"


THROWAWAY_SCRIPT = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("gsm8k_inner", sys.argv[1])
gsm8k = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gsm8k)
unwrapped = gsm8k.Isolation("no mount namespace", (), "uid")
result = gsm8k._spawn("def simple_math_problem():\\n    return 1\\n", unwrapped, timeout_s=30.0, memory_mb=512,
                      entry="simple_math_problem")
try:
    open(sys.argv[2], "w").close()
    writable = True
except OSError:
    writable = False
print(json.dumps([result.status, result.message, writable]))
"""


def test_the_runner_never_remounts_the_mount_namespace_of_its_parent(tmp_path):
    """A wrapper that makes no mount namespace is refused before any remount (else the host's would be read-only).

    The parent runs in a throwaway mount namespace, so a broken check could only make that one read-only.
    """
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("needs root and unshare for the throwaway mount namespace")
    inner = [sys.executable, "-I", "-S", "-c", THROWAWAY_SCRIPT, gsm8k.__file__, str(tmp_path / "still_writable")]
    run = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--", *inner], capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    status, message, writable = json.loads(run.stdout)
    assert status == "error" and "not in a mount namespace of its own" in message and writable, message


def test_detection_runs_once_and_falls_back_past_a_broken_candidate(monkeypatch, fresh_detection):
    broken = Isolation("broken", ("/bin/false",))
    plain = Isolation("plain")
    monkeypatch.setattr(gsm8k, "_os_candidates", lambda: [broken, plain])
    assert isolation("os") is plain and isolation("os") is plain
    assert gsm8k._os_isolation.cache_info().misses == 1
    gsm8k._os_isolation.cache_clear()
    monkeypatch.setattr(gsm8k, "_os_candidates", lambda: [broken])
    with pytest.raises(SandboxUnavailableError, match=r"broken: sandbox exited with code 1.*sandbox='python_only'"):
        isolation("os")


def gsm_metric_data() -> SimpleNamespace:
    return SimpleNamespace(tokenizer=None, pad_id=0, mask_id=1)


def test_without_any_isolation_execute_is_refused_unless_python_only(monkeypatch, fresh_detection):
    monkeypatch.setattr(gsm8k, "_os_candidates", lambda: [])
    program = "def simple_math_problem():\n    return 3\n"
    with pytest.raises(SandboxUnavailableError, match="neither bwrap nor util-linux unshare"):
        run_program(program)
    with pytest.raises(SandboxUnavailableError):
        execute_responses([program])
    with pytest.raises(ValueError, match="sandbox must be one of"):
        run_program(program, sandbox="none")
    assert run_program(program, sandbox="python_only", timeout_s=SLOW_OK).value == 3.0
    # the metric refuses before anything is sampled: when the evaluation checks its data, ahead of any compute
    with pytest.raises(SandboxUnavailableError, match="eval.metric.sandbox=python_only"):
        GSM8KAccuracy(datamodule=gsm_metric_data(), scorer="execute")
    evaluation = SamplingEvaluation(
        samplers={"confidence": ConfidenceSampler()},
        nfe=[4],
        metric=functools.partial(GSM8KAccuracy, scorer="execute"),
    )
    with pytest.raises(SandboxUnavailableError):
        evaluation.check_data(gsm_metric_data())
    assert GSM8KAccuracy(datamodule=gsm_metric_data(), scorer="extract").isolation is None
    with pytest.warns(UserWarning, match="Python-level guard only"):
        metric = GSM8KAccuracy(datamodule=gsm_metric_data(), scorer="execute", sandbox="python_only")
    assert metric.isolation.name == "python_only"
    with pytest.raises(ValueError, match="GSM8K sandbox must be one of"):
        GSM8KAccuracy(datamodule=gsm_metric_data(), scorer="extract", sandbox="container")
