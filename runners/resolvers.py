"""Every OmegaConf resolver the configs use (``${flowlm.<name>:...}``), registered once, when any runner module is
imported (runners/__init__.py): an entry point, a test or a script that composes a config never depends on which
other module happened to be imported first."""

from __future__ import annotations

import hashlib
import logging
import math
import re

from omegaconf import OmegaConf

# Composing any train config evaluates `${flowlm.cpu_precision:}` (OmegaConf dereferences it when trainer=gpu's
# `precision` is merged over trainer=cpu's), and the answer needs torch: seconds to import. A console script that
# only shows its config (`--help`, `--cfg` without `--resolve`, `--info`: runners/console.py) turns the query off;
# the stand-in below is then what the merge sees, never a value a run gets.
_query_machine = True
CPU_PRECISION_UNQUERIED = "bf16-mixed or 32-true (the CPU's, decided at launch)"
PRECISION_UNQUERIED = "bf16-mixed on a GPU, else the CPU's (decided at launch)"
ACCELERATOR_UNQUERIED = "gpu where CUDA is, else cpu (decided at launch)"
DTYPE_UNQUERIED = "bfloat16 on a GPU, else float32 (decided at launch)"

log = logging.getLogger(__name__)
_said: set[str] = set()  # fallback lines already logged: a resolver is read several times per run


def _say_once(line: str) -> None:
    if line not in _said:
        _said.add(line)
        log.warning(line)


def query_machine(enabled: bool) -> bool:
    """Whether machine-dependent resolvers (``cpu_precision``) query the machine; returns the previous setting."""
    global _query_machine
    previous, _query_machine = _query_machine, enabled
    return previous


def cpu_precision() -> str:
    """The CPU trainer's precision (conf/trainer/cpu.yaml): ``bf16-mixed`` where the CPU computes bf16 natively
    (oneDNN's bf16 kernels: AVX-512 or AMX), else ``32-true`` (torch emulates bf16 products on an AVX2-only CPU:
    docs/performance.md#cpu-precision)."""
    if not _query_machine:
        return CPU_PRECISION_UNQUERIED
    from flowlm.ops.bf16_products import native_bf16_kernels  # here, not at the top: `--help` needs no torch

    return "bf16-mixed" if native_bf16_kernels() else "32-true"


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (the one question every accelerator choice below asks)."""
    import torch  # here: `--help` needs no torch

    return bool(torch.cuda.is_available())


def accelerator_precision(accelerator: object = "auto") -> str:
    """A trainer's precision from its ``accelerator`` (conf/trainer/ddp.yaml, fsdp2.yaml, auto.yaml): ``bf16-mixed``
    on a GPU (what every CUDA card the suite targets computes natively), ``cpu_precision`` on the CPU; ``auto`` is
    the GPU where CUDA is available (Lightning's own choice). The host CPU's bf16 support says nothing about a GPU's:
    asked alone, a DGX A100's EPYC CPUs would put its GPUs in 32-true."""
    if not _query_machine:
        return PRECISION_UNQUERIED
    name = str(accelerator).lower()
    if name == "cpu" or (name == "auto" and not cuda_available()):
        return cpu_precision()
    return "bf16-mixed"


def auto_accelerator() -> str:
    """``gpu`` where CUDA is available, else ``cpu`` with one log line saying so (conf/trainer/auto.yaml)."""
    if not _query_machine:
        return ACCELERATOR_UNQUERIED
    if cuda_available():
        return "gpu"
    _say_once("no CUDA device here: trainer=auto runs on the CPU (trainer=cpu chooses it without this line)")
    return "cpu"


def autocast_dtype(device: object = None, runner: str = "this run") -> str:
    """A sampler's autocast dtype from its ``device`` (conf/mt_bench.yaml ``generate.dtype``): ``bfloat16`` on a
    CUDA device, ``float32`` on the CPU; ``null`` is CUDA where available, else the CPU with one log line saying so."""
    if not _query_machine:
        return DTYPE_UNQUERIED
    if device in (None, "None", "null", ""):
        if cuda_available():
            return "bfloat16"
        _say_once(f"{runner}: no CUDA device here, generating on the CPU in float32")
        return "float32"
    return "bfloat16" if str(device).startswith("cuda") else "float32"


def short_hash(text: object) -> str:
    """First 10 hex digits of the SHA-1 of ``str(text)``: a stable, filesystem-safe name for a config value."""
    return hashlib.sha1(str(text).encode()).hexdigest()[:10]


def sudoku_table_nfe(
    conditional: bool, box_rows: int, box_cols: int, difficulty: str | None, family: str | None = None
) -> list[int]:
    """The NFE budgets of the papers' Sudoku tables (docs/results.md): conditional 4 (PR's R = 4, N = 1) and the
    number of empty cells (full); unconditional 1, 3, 9, 27 and n² (the paper's 1 / 3 / 9 / 27 / 81 on 9×9, the same
    NFE) and the paper's budgets mapped by tokens per call, ⌈n² · NFE / 81⌉ (its 81 / NFE tokens a call on 81 cells,
    never more parallel than the paper: 2, 4, 12 on 6×6; the report's ``tokens_per_call_nfe``). An MDM
    (``family`` mdm) on a conditional task also gets one call per position it generates (n² + n − 1: clue copies and
    separators included), the regime of the paper's MDLM row at 128 NFE on 9×9's 89 positions: at most one token per
    call (issue 47)."""
    from flowlm.tasks.sudoku import SudokuSpec, clues_for  # here: the package imports torch (`--help` needs none)

    spec = SudokuSpec(int(box_rows), int(box_cols))
    cells = spec.n**2
    if not conditional:
        paper = (1, 3, 9, 27, 81)
        mapped = {max(1, math.ceil(cells * nfe / 81 - 1e-9)) for nfe in paper}
        return sorted({*(b for b in paper[:-1] if b < cells), cells} | mapped)
    one_per_call = {cells + spec.n - 1} if family == "mdm" else set()
    return sorted({4, cells - clues_for(spec, str(difficulty)), *one_per_call})


def steps_share(total: int, share: float) -> int:
    """``share`` of ``total`` optimizer steps, rounded: a warm-up scaled with the budget as the released recipe's
    (2 500 of 20 000 steps: 0.125)."""
    if int(total) < 0 or not 0.0 <= float(share) <= 1.0:
        raise ValueError(f"steps_share needs total >= 0 and share in [0, 1], got {total!r} and {share!r}")
    return round(int(total) * float(share))


# One folder name of a run's path (``name``, each ``/``-separated part of ``run_name``): word characters and
# ``. - + = , @``, starting with a word character: no ``..`` or ``/`` to leave or nest the runs folder, no hidden name.
RUN_NAME_PART = re.compile(r"\w[\w.+=,@-]*")
RUN_NAME_RULE = "letters, digits and _ . - + = , @, starting with a letter, digit or _ (no '/', '..' or hidden name)"


def check_run_parts(name: str, run_name: str) -> None:
    """Refuse a ``name`` that is not one folder name, or a ``run_name`` with a part that is not (RUN_NAME_RULE)."""
    for key, part in [("name", name)] + [("run_name", part) for part in run_name.split("/")]:
        if not RUN_NAME_PART.fullmatch(part):
            what = "name" if key == "name" else f"run_name's part {part!r}"
            value = name if key == "name" else run_name
            raise ValueError(
                f"{key}={value!r} is refused: {what} must be one folder name under the runs folder, made of "
                f"{RUN_NAME_RULE}"
            )


def run_dir(root: str, name: str, run_name: str) -> str:
    """``<root>/<name>/<run_name>``, once ``name`` and ``run_name`` pass ``check_run_parts``."""
    check_run_parts(str(name), str(run_name))
    return f"{root}/{name}/{run_name}"


def output_dir(path: str, option: str) -> str:
    """``path``, Hydra's output folder (made before the task runs), once this process can write there
    (runners/outputs.py ``check_writable``, naming ``option``): a read-only one failed in Hydra's own mkdir, under a
    traceback."""
    from runners.outputs import check_writable

    check_writable(str(option), str(path))
    return str(path)


NO_SOURCE = "<no source run: this experiment names no `source`; set method.init_from=<ckpt> or method.teacher=<ckpt>>"


def source_ckpt(root: str, source: str | None, scale: str, seed: int) -> str:
    """The checkpoint of the experiment's ``source`` run (same scale and seed), or, without a source, a placeholder
    that says what to set where a checkpoint reader names the missing file (resolving it raises nothing: every run
    config is resolved whole, also those that never read it)."""
    return NO_SOURCE if source in (None, "None", "") else f"{root}/{source}/{scale}/seed{seed}/checkpoints/last.ckpt"


# `${flowlm.source_ckpt:...}` in conf/train.yaml: what method.init_from / method.teacher read by default.
OmegaConf.register_new_resolver("flowlm.source_ckpt", source_ckpt, replace=True)
# `${flowlm.run_dir:${paths.root},${name},${run_name}}` in conf/paths/default.yaml: the run folder, refused before
# Hydra creates it (its output folder is the run folder) when the name would leave, nest or hide it.
OmegaConf.register_new_resolver("flowlm.run_dir", run_dir, replace=True)
# `${flowlm.output_dir:<folder>,<option>}`: Hydra's output folder (conf/hydra/default.yaml, conf/report.yaml), refused
# in one line before Hydra makes it when it cannot be written.
OmegaConf.register_new_resolver("flowlm.output_dir", output_dir, replace=True)
# `${flowlm.cpu_precision:}` in conf/trainer/cpu.yaml; `trainer.precision=bf16-mixed` (or 32-true) still sets it.
OmegaConf.register_new_resolver("flowlm.cpu_precision", cpu_precision, replace=True)
# `${flowlm.accelerator_precision:${.accelerator}}` in conf/trainer/{ddp,fsdp2,auto}.yaml: precision from the
# accelerator, not from the host CPU.
OmegaConf.register_new_resolver("flowlm.accelerator_precision", accelerator_precision, replace=True)
# `${flowlm.auto_accelerator:}` in conf/trainer/auto.yaml (flowlm-eval's default trainer).
OmegaConf.register_new_resolver("flowlm.auto_accelerator", auto_accelerator, replace=True)
# `${flowlm.autocast_dtype:${.device},flowlm-mt-bench}` in conf/mt_bench.yaml.
OmegaConf.register_new_resolver("flowlm.autocast_dtype", autocast_dtype, replace=True)
# `${flowlm.hash:...}` in configs: trial folders (conf/hydra/default.yaml), one sweep name per checkpoint.
OmegaConf.register_new_resolver("flowlm.hash", short_hash, replace=True)
# `${flowlm.or_default:${seed},0}` in conf/hparams_search/optuna.yaml: a value, or the default where it is null
# (flowlm-eval's seed is null until the checkpoint's is read, after Hydra built the sweeper; oc.select keeps null).
OmegaConf.register_new_resolver(
    "flowlm.or_default", lambda value, default: default if value is None else value, replace=True
)
# `${flowlm.steps_share:${trainer.max_steps},0.125}`: hparams_search=sudoku_tables's warm-up, scaled with the budget.
OmegaConf.register_new_resolver("flowlm.steps_share", steps_share, replace=True)
# `${flowlm.sudoku_table_nfe:...}`: the budgets of hparams_search=sudoku_tables, from the task's data config.
OmegaConf.register_new_resolver(
    "flowlm.sudoku_table_nfe", lambda *args: OmegaConf.create(sudoku_table_nfe(*args)), replace=True
)  # a ListConfig: OmegaConf.resolve writes the value back into the config
