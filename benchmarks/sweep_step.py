"""The Sudoku tables sweep's wall time per training step, against the bare step and the step's FLOP limit.

Issue 35, item 1: where does a step of ``flowlm-train -m hparams_search=sudoku_tables`` go beyond the network? Three
loops on the same module and the same data, side by side in one process (interleaved, so a shared machine moves
them alike):

  - **sweep**: the tables sweep's own training (``runners.train.train`` on the composed sweep config: validation every
    50 steps, EMA, the convergence record, checkpoints every 50 steps, MLflow logging, the datamodule), timed from the
    end of step ``warmup`` over 100 steps (``--window``), so the window holds two validations and two checkpoints
    as every 100 steps of the sweep do; the sampling at the final weights is timed apart (one validation with the
    samplers), as a cost per model;
  - **lightning**: the same module under a bare ``lightning.Trainer`` (no validation, logger, checkpoints or
    callbacks; ``throughput.run_lightning``), on batches drawn from the same datamodule;
  - **bare**: ``zero_grad → autocast(draw + loss) → backward → clip → AdamW → schedule`` (``throughput.run_bare``).

The limit: the step's matrix-product FLOPs (torch's FlopCounterMode) at this machine's measured rate of a 2048²
matmul in the step's precision (the physical limit of a step on this CPU). Printed: seconds per step of each loop,
each over the bare step and over the limit.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/sweep_step.py                   # sudoku_mdm_easy, the sweep's batch
    .venv/bin/python benchmarks/sweep_step.py --experiment sudoku_fmlm_plus_scratch_uncond --reps 2
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/sweep_step.py --compile  # + the loops with compiled DiT blocks

``--compare A,B,...`` times instead the bare step of several models of the sweep, interleaved (``--reps`` rounds),
with each step's FLOPs and tokens: a model's cost against the first's, for planning a campaign (which models to put
on which of two campaigns so that both end together: docs/results.md, "The campaign"):

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/sweep_step.py --reps 3 --bare-steps 4 --warmup 2 \
        --compare sudoku_mdm_easy,sudoku_mdm_uncond,sudoku_fmlm_plus_scratch_easy,sudoku_fmlm_plus_scratch_uncond

With ``--compile`` two more loops run in the same interleaving: the bare step on a copy of the module whose DiT blocks
are compiled (``lightning_modules.sharding.compile_blocks``, what ``compile: true`` does), and the sweep with
``compile=true``. Their compilation falls in the untimed warm-up; the first validation's (eval-mode graphs) is
printed apart, as a once-per-model cost, with the eager sweep's first validation beside it.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time

import torch
from hydra import compose, initialize_config_dir
from omegaconf import open_dict
from probes import median
from throughput import quiet_lightning, run_bare, run_lightning, step_flops

from flowlm.project import CONF_DIR
from runners.common import build

VAL_EVERY = 50  # the sweep's validation and checkpoint interval


def sweep_config(experiment: str, seed: int, root: str, steps: int, overrides: list[str]):
    """The tables sweep's config for one model, its runs under ``root``, stopped after ``steps`` steps, sampling
    only where asked (``eval.every_n_steps`` past the end: none inside the timed window; no final evaluation)."""
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(
            "train",
            overrides=[
                "hparams_search=sudoku_tables",
                f"experiment={experiment}",
                "scale=cpu",
                f"seed={seed}",
                f"paths.root={root}",
                f"trainer.max_steps={steps}",
                "callbacks.convergence.stop=false",
                "callbacks.results_csv.dir=null",
                *overrides,
            ],
        )
    with open_dict(cfg):
        cfg.eval.every_n_steps = 10**9
        cfg.final_eval = False
    return cfg


class StepClock:
    """Lightning callback: the wall time at the end of every training batch, and of every validation."""

    def __init__(self) -> None:
        from lightning.pytorch.callbacks import Callback

        clock = self
        self.steps: list[float] = []
        self.validations: list[float] = []

        class Hook(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                clock.steps.append(time.perf_counter())

            def on_validation_end(self, trainer, pl_module) -> None:
                clock.validations.append(time.perf_counter())

        self.callback = Hook()


def run_sweep(args, warmup: int, overrides: tuple[str, ...] = ()) -> tuple[float, float]:
    """Seconds per step of the sweep's own training over ``args.window`` steps after ``warmup`` (the window holds
    the sweep's share of validations and checkpoints: ``args.window`` is a multiple of the validation interval), and
    the seconds of the first validation beyond the later ones' median (a once-per-model cost: with compiled blocks,
    the eval-mode compilation)."""
    import callbacks.progress as progress
    from runners.train import train

    clock = StepClock()
    with tempfile.TemporaryDirectory() as root:
        cfg = sweep_config(args.experiment, args.seed, root, warmup + args.window + 1, [*args.override, *overrides])
        progress.progress_callbacks, restore = _with_clock(progress.progress_callbacks, clock)
        try:
            train(cfg)
        finally:
            progress.progress_callbacks = restore
    stamps = clock.steps
    # a validation runs after its step's training batch: from that batch's end to its own end
    val_seconds = [end - max(t for t in stamps if t <= end) for end in clock.validations if end > stamps[0]]
    first_extra = val_seconds[0] - median(val_seconds[1:]) if len(val_seconds) > 1 else float("nan")
    return (stamps[warmup + args.window - 1] - stamps[warmup - 1]) / args.window, first_extra


def _with_clock(progress_callbacks, clock: StepClock):
    """``callbacks.progress.progress_callbacks`` (imported by ``runners.train.train`` when it runs) returning the
    clock beside its own callbacks, so how the sweep's trainer is built stays the runner's."""

    def patched(*a, **kw):
        return [*progress_callbacks(*a, **kw), clock.callback]

    return patched, progress_callbacks


def sampling_seconds(args) -> float:
    """Seconds of one validation with the sweep's samplers at its NFE budgets (the sampling at the final weights,
    once per model), on the untrained module: the cost does not depend on the weights."""
    import lightning as L

    with tempfile.TemporaryDirectory() as root:
        cfg = sweep_config(args.experiment, args.seed, root, 1, args.override)
        datamodule = build(cfg.data)
        module = build(cfg.method, data_vocab_size=datamodule.vocab_size, seq_len=datamodule.seq_len)
        evaluation = build(cfg.eval)
        evaluation.every_n_steps = None
        trainer = L.Trainer(
            accelerator="cpu",
            devices=1,
            precision=cfg.trainer.precision,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[evaluation],
            default_root_dir=root,
        )
        start = time.perf_counter()
        trainer.validate(module, datamodule=datamodule, verbose=False)
        return time.perf_counter() - start


def module_and_batches(args):
    """The sweep's module (untrained) and eight of its datamodule's training batches."""
    with tempfile.TemporaryDirectory() as root:
        cfg = sweep_config(args.experiment, args.seed, root, 1, args.override)
        datamodule = build(cfg.data)
        datamodule.prepare_data()
        datamodule.setup("fit")
        module = build(cfg.method, data_vocab_size=datamodule.vocab_size, seq_len=datamodule.seq_len)
        batches = []
        for batch in datamodule.train_dataloader():
            batches.append(batch)
            if len(batches) == 8:
                break
    return cfg, module, batches


def sweep_loss(module):
    """The module's training loss on a batch with its own draws (``draw`` at stage train), as the sweep computes it."""

    def loss(batch: dict, i: int):
        return module.loss(batch, module.draw(batch, i, stage="train")).loss

    return loss


def compare(args) -> None:
    """``--compare``: the bare step of each model named, interleaved over ``args.reps`` rounds, printed with its tokens
    a step (batch × length), its matrix-product FLOPs, its median seconds, each over the first model's, and over
    its FLOP limit."""
    names = [name.strip() for name in args.compare.split(",") if name.strip()]
    models = {}
    for name in names:
        cfg, module, batches = module_and_batches(argparse.Namespace(**{**vars(args), "experiment": name}))
        precision, loss = str(cfg.trainer.precision), sweep_loss(module)
        flops = step_flops(module, loss, batches[0], precision=precision, device=torch.device("cpu"))
        models[name] = (module, loss, batches, precision, flops)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.reps):
        for name, (module, loss, batches, precision, _) in models.items():
            kw = {"steps": args.warmup + args.bare_steps, "warmup": args.warmup, "precision": precision}
            seconds[name].append(run_bare(module, loss, batches, device=torch.device("cpu"), **kw)[0])
    rates = {precision: matmul_rate(precision) for *_, precision, _ in models.values()}
    first = names[0]
    print(
        f"# bare training steps side by side: torch threads {torch.get_num_threads()}, {args.reps} interleaved "
        f"rounds of {args.bare_steps} steps (after {args.warmup}); eager; × {first}: each over the first model's"
    )
    print("| model | batch × length | GFLOP a step | s/step | × first (time) | × first (FLOPs) | × FLOP limit |")
    print("|---|---|---|---|---|---|---|")
    for name, (_, _, batches, precision, flops) in models.items():
        s, tokens = median(seconds[name]), batches[0]["tokens"].shape
        print(
            f"| {name} | {tokens[0]} × {tokens[1]} | {flops / 1e9:.1f} | {s:.3f} | {s / median(seconds[first]):.2f} "
            f"| {flops / models[first][4]:.2f} | {s / (flops / rates[precision]):.2f} |"
        )


def matmul_rate(precision: str, reps: int = 5) -> float:
    """FLOP/s of a 2048² matrix product in the step's precision (bf16 under bf16-mixed; float32 on a CPU without bf16
    kernels, where bf16's products run on float32 BLAS: flowlm/ops/bf16_products.py), the best of ``reps``."""
    from flowlm.ops.bf16_products import native_bf16_kernels

    dtype = torch.bfloat16 if precision.startswith("bf16") and native_bf16_kernels() else torch.float32
    a = torch.randn(2048, 2048, dtype=dtype)
    b = torch.randn(2048, 2048, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best


def parser() -> argparse.ArgumentParser:
    """The script's command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experiment", default="sudoku_mdm_easy", help="a model of the tables sweep")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=1, help="interleaved repetitions of the three loops")
    ap.add_argument("--bare-steps", type=int, default=30, help="timed steps of the bare and Lightning loops")
    ap.add_argument("--warmup", type=int, default=10, help="untimed steps at the start of each loop")
    ap.add_argument("--window", type=int, default=100, help="timed steps of the sweep loop (a multiple of 50)")
    ap.add_argument(
        "--compile", action="store_true", help="also the bare step and the sweep with each DiT block compiled"
    )
    ap.add_argument(
        "--compare",
        metavar="A,B,...",
        help="instead of the loops: the bare step of each of these models, interleaved, against the first's",
    )
    ap.add_argument("override", nargs="*", help="more Hydra overrides of the sweep's config")
    return ap


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.window % VAL_EVERY or args.window <= 0:
        ap.error(f"--window must be a positive multiple of the sweep's validation interval, {VAL_EVERY}")
    quiet_lightning()
    if args.compare:
        compare(args)
        return
    cfg, module, batches = module_and_batches(args)
    precision = str(cfg.trainer.precision)
    device = torch.device("cpu")

    loss = sweep_loss(module)
    loops = ("bare", "lightning", "sweep", "bare_compiled", "sweep_compiled")
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    first_validation: dict[str, list[float]] = {"sweep": [], "sweep_compiled": []}
    compilation: list[float] = []  # the compiled bare loop's first pass: its wall time beyond its steady steps
    steps = args.warmup + args.bare_steps
    kw = {"steps": steps, "warmup": args.warmup, "precision": precision, "device": device}
    compiled = None
    if args.compile:
        from lightning_modules.sharding import compile_blocks

        compiled = copy.deepcopy(module)
        if not compile_blocks(compiled):
            ap.error("--compile: torch.compile is unavailable here (see the warning)")
        compiled_loss = sweep_loss(compiled)

    def sweep(name: str, overrides: tuple[str, ...] = ()) -> None:
        step, first = run_sweep(args, args.warmup, overrides)
        seconds[name].append(step)
        first_validation[name].append(first)

    for _ in range(args.reps):
        seconds["bare"].append(run_bare(module, loss, batches, **kw)[0])
        seconds["lightning"].append(run_lightning(module, batches, **kw)[0])
        sweep("sweep")
        seconds["bare"].append(run_bare(module, loss, batches, **kw)[0])
        if compiled is not None:
            start = time.perf_counter()
            seconds["bare_compiled"].append(run_bare(compiled, compiled_loss, batches, **kw)[0])
            if not compilation:
                compilation.append(time.perf_counter() - start - steps * seconds["bare_compiled"][-1])
            sweep("sweep_compiled", ("compile=true",))
    sampling = sampling_seconds(args)

    flops = step_flops(module, loss, batches[0], precision=precision, device=device)
    rate = matmul_rate(precision)
    limit = flops / rate
    bare = median(seconds["bare"])
    print(
        f"# tables sweep step: {args.experiment} seed {args.seed}, batch {cfg.data.batch_size}, {precision}, "
        f"torch threads {torch.get_num_threads()}, {args.reps} interleaved reps; step {flops / 1e9:.1f} GFLOP "
        f"(matmuls, forward + backward), matmul rate {rate / 1e9:.0f} GFLOP/s (2048², best of 5)"
    )
    print("| loop | s/step | × bare | × FLOP limit |")
    print("|---|---|---|---|")
    print(f"| FLOP limit | {limit:.4f} | {limit / bare:.2f} | 1.00 |")
    for name, label in (
        ("bare", "bare step (draw + loss + backward + clip + AdamW)"),
        ("lightning", "Lightning, no validation / logging / callbacks"),
        ("sweep", "the sweep's training (validation and checkpoint every 50, EMA, MLflow, data)"),
        ("bare_compiled", "bare step, DiT blocks compiled"),
        ("sweep_compiled", "the sweep's training, compile=true"),
    ):
        if seconds[name]:
            s = median(seconds[name])
            print(f"| {label} | {s:.4f} | {s / bare:.2f} | {s / limit:.2f} |")
    per_step = median(seconds["sweep"])
    print(
        f"sampling at the final weights (one validation with the sweep's samplers and budgets): {sampling:.1f} s, "
        f"the time of {sampling / per_step:.0f} sweep steps"
    )
    if compilation:
        print(
            f"compiling the training step (the compiled loop's first pass beyond its steady steps): "
            f"{compilation[0]:.1f} s"
        )
    for name, label in (("sweep", "eager"), ("sweep_compiled", "compile=true")):
        if first_validation[name]:
            print(f"first validation beyond the later ones' median ({label}): {median(first_validation[name]):.1f} s")


if __name__ == "__main__":
    main()
