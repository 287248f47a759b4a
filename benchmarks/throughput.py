"""Training throughput: the suite's LightningModule under a real ``lightning.Trainer`` vs a bare PyTorch loop.

For MDM, FMLM+ and MLFM on one backbone size, both loops run the same module on the same synthetic batches with the
same optimiser (the module's ``configure_optimizers``: AdamW + warm-up schedule), gradient clipping 1.0 and autocast:

  - Lightning: the suite's trainer config (conf/trainer/cpu|gpu.yaml) with no logger, no checkpointing, no progress
    bar and no validation; the module's own ``training_step``.
  - bare: ``zero_grad → autocast(loss) → backward → clip_grad_norm_ → step → scheduler``, where the loss is the
    module's ``loss`` hook called directly (at ``draws_at`` with the same time and
    noise draws ``training_step`` makes; no ``self.log``).

The variants are interleaved (Lightning, bare, bare, Lightning, …, every method in each repetition) and the medians
compared, so a noisy shared machine moves both alike. Printed: tokens/s of each, the overhead ratio Lightning time /
bare time, and the FMLM+ step's cost relative to MDM's with its theoretical value.

    .venv/bin/python benchmarks/throughput.py        # tiny DiT, the demo's batch (256 × 36 tokens, |V| = 6), CPU
    .venv/bin/python benchmarks/throughput.py --batch 16 --seq-len 128 --vocab 401 --precision 32-true
    .venv/bin/python benchmarks/throughput.py --backbone small --device cuda --batch 16 --seq-len 1024 --vocab 50257
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import warnings
from collections.abc import Callable

import torch
from common import autocast, build_module, load_group_config, model_parser, parse_model_args, synthetic_batch
from probes import clock, elapsed, matmul_flops, median, peak_memory
from torch import Tensor

METHODS = ("mdm", "fmlm_plus", "mlfm", "fmlm_plus_dense", "fmlm_plus_onehot", "fmlm_plus_compiled", "fmlm_plus_fused")
# Variants of a method: (its conf/method file, overrides). fmlm_plus is the default (``fused_loss: auto``: the
# student's loss fused from the head's input when |V| > d); fmlm_plus_dense: the dense student log δ (fused_loss
# false, the earlier path); fmlm_plus_onehot: the flow states over the vocabulary
# (ε and x·E of size |V|), which ``state_space: auto`` replaces by h = x·E when |V| > d; fmlm_plus_compiled: the
# loss's soft-capped log-softmax compiled (``method.compile_tails``; not in the default --methods: compiling takes
# a while on a CPU); fmlm_plus_fused: the student's soft-capped CE from the head's input in blocks of rows, its
# gradient made in the same pass (``method.fused_loss``, flowlm/ops/fused_ce.py; not in the default --methods).
VARIANTS = {
    "fmlm_plus_dense": ("fmlm_plus", {"fused_loss": False}),
    "fmlm_plus_onehot": ("fmlm_plus", {"state_space": "onehot", "fused_loss": False}),
    "fmlm_plus_compiled": ("fmlm_plus", {"compile_tails": True}),
    "fmlm_plus_fused": ("fmlm_plus", {"fused_loss": True}),
}
FLOWS = ("fmlm_plus", "fmlm_plus_dense", "fmlm_plus_onehot", "fmlm_plus_compiled", "fmlm_plus_fused")


def loss_function(method: str, module) -> Callable[[dict, int], Tensor]:
    """The module's loss on a batch with the draws its ``training_step`` makes (without the logging)."""

    def mdm(batch: dict, i: int) -> Tensor:
        t = module.sample_times(batch["tokens"].shape[0], i).to(module.device, non_blocking=True)
        return module.loss(
            batch, module.draws_at(batch, t, module.step_generator(1, i, shared=False, device=module.device))
        ).loss

    def fmlm_plus(batch: dict, i: int) -> Tensor:
        kinds, s, t = module.sample_pairs(batch["tokens"].shape[0], i)  # kinds stay on the host
        gen = module.step_generator(1, i, shared=False, device=module.device)
        s, t = (x.to(module.device, non_blocking=True) for x in (s, t))
        return module.loss(batch, module.draws_at(batch, kinds, s, t, gen)).loss

    def mlfm(batch: dict, i: int) -> Tensor:
        gen_cpu = module.step_generator(0, i, shared=False)
        gen = module.step_generator(1, i, shared=False, device=module.device)
        return module.loss(batch, module.draws_at(batch, gen_cpu, gen)).loss

    return {"mdm": mdm, "fmlm_plus": fmlm_plus, "mlfm": mlfm}[VARIANTS.get(method, (method,))[0]]


class Batches(torch.utils.data.Dataset):
    """``steps`` training batches cycling over a few pre-built ones (already on the device)."""

    def __init__(self, batches: list[dict], steps: int) -> None:
        self.batches, self.steps = batches, steps

    def __len__(self) -> int:
        return self.steps

    def __getitem__(self, i: int) -> dict:
        return self.batches[i % len(self.batches)]


def loader(batches: list[dict], steps: int) -> torch.utils.data.DataLoader:
    """One epoch of ``steps`` batches, as both loops read them (batch_size=None: the items are batches)."""
    return torch.utils.data.DataLoader(Batches(batches, steps), batch_size=None, shuffle=False)


def quiet_lightning() -> None:
    """No banner lines ("GPU available", "max_steps reached") and no data-loader worker advice."""
    from lightning.fabric.utilities.warnings import PossibleUserWarning

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=PossibleUserWarning)
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")


class _StepTimer:
    """Lightning callback: (wall, CPU) time from the end of step ``warmup − 1`` to the end of the last step."""

    def __init__(self, warmup: int, steps: int, device) -> None:
        from lightning.pytorch.callbacks import Callback

        timer = self

        class Hook(Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                if batch_idx == warmup - 1:
                    timer.start = clock(device)
                if batch_idx == steps - 1:
                    timer.spent = elapsed(timer.start, device)

        self.callback = Hook()
        self.start = self.spent = None

    def per_step(self, warmup: int, steps: int) -> tuple[float, float]:
        if self.spent is None:
            raise RuntimeError("the Lightning run ended before its last timed step")
        return self.spent[0] / (steps - warmup), self.spent[1] / (steps - warmup)


def run_lightning(
    module, batches: list[dict], *, steps: int, warmup: int, precision: str, device
) -> tuple[float, float]:
    """(wall, CPU) seconds per optimiser step of ``trainer.fit`` in steady state (the suite's trainer config,
    stripped of logging, checkpoints, progress bar and validation)."""
    import lightning as L

    timer = _StepTimer(warmup, steps, device)
    from omegaconf import OmegaConf

    node = load_group_config("trainer", "gpu" if torch.device(device).type == "cuda" else "cpu")
    cfg = OmegaConf.to_container(node, resolve=False)
    cfg.pop("_target_", None)
    with tempfile.TemporaryDirectory() as tmp:
        cfg.update(
            accelerator=torch.device(device).type,
            devices=1,
            precision=precision,
            max_steps=steps,
            max_epochs=-1,
            limit_val_batches=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=tmp,
            callbacks=[timer.callback],
        )
        trainer = L.Trainer(**cfg)
        trainer.fit(module, train_dataloaders=loader(batches, steps))
    return timer.per_step(warmup, steps)


def run_bare(
    module, loss: Callable, batches: list[dict], *, steps: int, warmup: int, precision: str, device
) -> tuple[float, float]:
    """(wall, CPU) seconds per step of the same math in a plain loop: the module's AdamW + schedule, clipping 1.0,
    autocast."""
    module.train()
    optim = module.configure_optimizers()
    opt, sched = optim["optimizer"], optim["lr_scheduler"]["scheduler"]
    params = [p for group in opt.param_groups for p in group["params"]]
    start = None
    for i, batch in enumerate(loader(batches, steps)):
        opt.zero_grad(set_to_none=True)
        with autocast(precision, device):
            value = loss(batch, i)
        value.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if i == warmup - 1:
            start = clock(device)
    wall, cpu = elapsed(start, device)
    return wall / (steps - warmup), cpu / (steps - warmup)


def net_inputs(method: str, module, batch: dict) -> tuple[tuple, dict]:
    """What ``training_step`` feeds the network, (args, keyword args): ids at per-sequence times (MDM), vectors over
    the vocabulary at per-sequence times with about half the tokens pinned at s = t = 1 (FMLM+: the context),
    bridge embeddings at per-sequence times (MLFM)."""
    tokens = batch["tokens"]
    b, length = tokens.shape
    gen = torch.Generator(device=tokens.device).manual_seed(0)
    if method == "mdm":
        return (tokens, torch.zeros(b, device=tokens.device)), {}
    if method.startswith("fmlm_plus"):  # the states of its training process: x over the vocabulary, or h = x·E
        process = module.view.training_process()
        x = torch.randn(process.draw_shape(tokens), generator=gen, device=tokens.device)
        s = torch.rand(b, generator=gen, device=tokens.device)
        pinned = torch.rand(b, length, generator=gen, device=tokens.device) < 0.5
        return (x, s, (s + 0.1).clamp(max=1)), {"pinned": pinned, "embedded": process.embedded}
    emb = module.net.embeddings
    t = torch.rand(b, generator=gen, device=tokens.device)
    return (emb[tokens].detach(), module.process.condition(t), torch.zeros_like(t)), {}


def forward_costs(modules: dict, batches: dict, *, reps: int, precision: str, device) -> dict[str, dict]:
    """Per method: median seconds of one network forward with autograd (``fwd``), forward + backward (``fwdbwd``)
    and a no-grad forward (``nograd``) on the training batch, interleaved across methods and repetitions (process
    CPU time on a CPU, wall time on a GPU)."""
    pick = 1 if torch.device(device).type == "cpu" else 0
    times: dict[str, dict[str, list]] = {m: {"fwd": [], "fwdbwd": [], "nograd": []} for m in modules}
    for _ in range(reps + 1):  # the first round warms up
        for method, module in modules.items():
            net, (inputs, kwargs) = module.net, net_inputs(method, module, batches[method])
            if kwargs.pop("embedded", False):
                net = net.forward_embeddings
            module.train()
            start = clock(device)
            with torch.no_grad(), autocast(precision, device):
                net(*inputs, **kwargs)
            nograd = elapsed(start, device)[pick]
            start = clock(device)
            with autocast(precision, device):
                out = net(*inputs, **kwargs)
            fwd = elapsed(start, device)[pick]
            out.float().mean().backward()
            fwdbwd = elapsed(start, device)[pick]
            module.zero_grad(set_to_none=True)
            times[method]["nograd"].append(nograd)
            times[method]["fwd"].append(fwd)
            times[method]["fwdbwd"].append(fwdbwd)
    return {m: {k: median(v[1:]) for k, v in t.items()} for m, t in times.items()}


def measure(args, *, log=print) -> dict:
    """Build the modules, run the interleaved comparison, print and return the figures."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    modules, batches, losses = {}, {}, {}
    for method in args.methods:
        config, overrides = VARIANTS.get(method, (method, {}))
        module = build_module(
            config, backbone=args.backbone, vocab=args.vocab, seq_len=args.seq_len, seed=args.seed, **overrides
        )
        module.optim_cfg["warmup_steps"] = 1  # the schedule's value does not change the cost; full LR from step 1
        if args.compile:
            module.net = torch.compile(module.net)
        modules[method] = module.to(device)
        batches[method] = [
            synthetic_batch(args.batch, args.seq_len, args.vocab, prompt_len=args.prompt_len, device=device, seed=k)
            for k in range(4)
        ]
        losses[method] = loss_function(method, module)
    warmup = max(1, min(args.warmup, args.steps - 1))
    tokens = args.batch * args.seq_len
    seconds: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for rep in range(args.reps):
        for method, module in modules.items():
            order = ("lightning", "bare") if rep % 2 == 0 else ("bare", "lightning")
            for loop in order:
                kw = {"steps": args.steps, "warmup": warmup, "precision": args.precision, "device": device}
                if loop == "lightning":
                    sec = run_lightning(module, batches[method], **kw)
                else:
                    sec = run_bare(module, losses[method], batches[method], **kw)
                seconds.setdefault((method, loop), []).append(sec)
    base = backbone_of(modules[args.methods[0]])
    on_cpu = device.type == "cpu"
    log(
        f"# throughput: backbone {args.backbone} (d {base.d_model} × {len(base.blocks)} blocks), batch "
        f"{args.batch} × seq {args.seq_len} = {tokens} tokens/step, vocab {args.vocab}, {args.precision}, "
        f"{device.type}{' + torch.compile' if args.compile else ''}, {args.steps} steps ({warmup} untimed) × "
        f"{args.reps} interleaved reps, torch threads {torch.get_num_threads()}"
    )
    log("| method | Lightning tok/s | bare tok/s | Lightning/bare wall time |" + (" CPU time |" if on_cpu else ""))
    log("|---|---|---|---|" + ("---|" if on_cpu else ""))
    result: dict = {"tokens_per_step": tokens, "device": device.type}
    for method in modules:
        lit = [median([x[i] for x in seconds[method, "lightning"]]) for i in (0, 1)]
        bare = [median([x[i] for x in seconds[method, "bare"]]) for i in (0, 1)]
        result[method] = {
            "lightning_s": lit[0],
            "bare_s": bare[0],
            "ratio": lit[0] / bare[0],
            "lightning_cpu_s": lit[1],
            "bare_cpu_s": bare[1],
            "ratio_cpu": lit[1] / bare[1],
            "lightning_tok_s": tokens / lit[0],
            "bare_tok_s": tokens / bare[0],
        }
        cpu_cell = f" {lit[1] / bare[1]:.3f} |" if on_cpu else ""
        log(f"| {method} | {tokens / lit[0]:,.0f} | {tokens / bare[0]:,.0f} | {lit[0] / bare[0]:.3f} |{cpu_cell}")
    for method in modules:
        r = result[method]
        cpu_note = (
            f" (wall-clock medians; process CPU time: {r['ratio_cpu']:.3f})" if on_cpu else " (wall-clock medians)"
        )
        log(f"ratio lightning/bare [{method}]: {r['ratio']:.3f}{cpu_note}")
    for flow in FLOWS:
        if "mdm" in modules and flow in modules:
            key = "fmlm_vs_mdm" if flow == "fmlm_plus" else f"{flow}_vs_mdm"
            result[key] = fmlm_cost_report(args, modules, batches, result, device, log, flow=flow, losses=losses)
    if getattr(args, "memory", False):
        result["peak_memory"] = step_memory(modules, losses, batches, args, device, log)
    return result


def step_memory(modules: dict, losses: dict, batches: dict, args, device, log) -> dict[str, float]:
    """Peak memory one bare training step (loss, backward, clipping, AdamW) adds to the process (``peak_memory``:
    CUDA's peak allocated, or the CPU process's peak RSS), after one untimed step (optimizer states exist);
    printed as MiB and over MDM's."""
    out = {}
    for method, module in modules.items():
        module.train()
        opt = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
        params = [p for group in opt.param_groups for p in group["params"]]

        def step(module=module, method=method, opt=opt, params=params) -> None:
            opt.zero_grad(set_to_none=True)
            with autocast(args.precision, device):
                value = losses[method](batches[method][0], 0)
            value.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()

        step()
        out[method] = min(peak_memory(step, device) for _ in range(2))
    base = out.get("mdm")
    for method, value in out.items():
        over = f", {value / base:.3f}× MDM's" if base else ""
        log(f"peak memory of one training step [{method}]: {value / 2**20:.1f} MiB{over}")
    return out


def backbone_of(module):
    """The DiT inside a module's network (through an MLFM adapter and a torch.compile wrapper)."""
    net = getattr(module.net, "_orig_mod", module.net)
    return getattr(net, "base", net)


def step_flops(module, loss: Callable[[dict, int], Tensor], batch: dict, *, precision: str, device) -> float:
    """The matrix-product FLOPs of one bare training step's loss and backward (``matmul_flops``), as ``run_bare``
    computes them: its student, teacher passes, flow-map lift and head, whatever this implementation runs."""
    module.train()

    def step() -> None:
        with autocast(precision, device):
            value = loss(batch, 0)
        value.backward()

    flops = matmul_flops(step)
    module.zero_grad(set_to_none=True)
    return flops


def fmlm_cost_report(
    args, modules, batches, result, device, log, *, flow: str = "fmlm_plus", losses: dict | None = None
) -> dict:
    """The FMLM+ step's cost relative to MDM's, measured, against its theoretical value.

    FMLM+ = one forward + backward on the whole batch + two no-grad teacher forwards (δ_{s,u} and δ_{u,t}) on the
    rows of the jump kinds (off-diagonal + boundary; the diagonal half and distill rows need none):
        cost(FMLM+)/cost(MDM) = (F·(1 + k) + 2·share·F) / (F·(1 + k)) = 1 + 2·share/(1 + k)
    with k = backward/forward ≈ 2 and the same forward cost F for both: 1 + 2·0.5/3 = 4/3 at the default shares.
    The second value replaces the assumptions by this machine's measured network costs (FMLM+ reads a dense
    (B, L, |V|) input and per-token times; MDM ids and one time per sequence). The third, with ``losses``, is the
    compute-bound limit of this implementation: the matrix-product FLOPs of one FMLM+ step over those of one MDM
    step (``step_flops``), which count what the definition adds to the theory's network passes (the teachers'
    heads, the flow map's δ·E lift of the embedding space); measured / that limit is the step's work outside its
    matrix products.
    """
    from flowlm.objectives.fmlm_plus import split_counts

    fm = modules[flow]
    n_diag, n_bound, n_off, _ = split_counts(
        args.batch, **{k: fm.shares[k] for k in ("diagonal", "boundary", "distill")}
    )
    share = (n_bound + n_off) / args.batch
    theory = 1 + 2 * share / 3
    key = "_cpu_s" if device.type == "cpu" else "_s"  # CPU time on a CPU (steadier on a shared machine)
    measured = {loop: result[flow][loop + key] / result["mdm"][loop + key] for loop in ("bare", "lightning")}
    costs = forward_costs(
        {m: modules[m] for m in ("mdm", flow)},
        {m: batches[m][0] for m in ("mdm", flow)},
        reps=max(3, args.reps),
        precision=args.precision,
        device=device,
    )
    mdm_c, fm_c = costs["mdm"], costs[flow]
    k_mdm = mdm_c["fwdbwd"] / mdm_c["fwd"] - 1
    k_fm = fm_c["fwdbwd"] / fm_c["fwd"] - 1
    theory_measured = (fm_c["fwdbwd"] + 2 * share * fm_c["nograd"]) / mdm_c["fwdbwd"]
    clock_name = "process CPU time" if device.type == "cpu" else "wall time"
    states = "h = x·E input" if fm.view.training_process().embedded else "dense |V| input"
    log(
        f"ratio {flow}/mdm step cost: {measured['bare']:.3f} (bare loop), {measured['lightning']:.3f} (Lightning) "
        f"[{clock_name}]; theory {theory:.3f}"
    )
    log(
        f"  theory = 1 + 2·share/(1 + k): one forward + backward (backward ≈ 2× forward, k = 2) plus 2 no-grad teacher "
        f"forwards on the jump share {n_bound + n_off}/{args.batch} = {share:.3f} of the rows (off-diagonal "
        f"{n_off} + boundary {n_bound}), same forward cost as MDM"
    )
    log(
        f"  with this machine's network costs: backward/forward k = {k_mdm:.2f} (MDM), {k_fm:.2f} (FMLM+); FMLM+ "
        f"forward = {fm_c['fwd'] / mdm_c['fwd']:.2f}× MDM's ({states}; pinned form) → "
        f"(fwdbwd_FMLM+ + 2·share·fwd_nograd_FMLM+)/fwdbwd_MDM = {theory_measured:.3f}"
    )
    flop_limit = None
    if losses is not None:
        flops = {
            m: step_flops(modules[m], losses[m], batches[m][0], precision=args.precision, device=device)
            for m in ("mdm", flow)
        }
        flop_limit = flops[flow] / flops["mdm"]
        log(
            f"  matrix-product FLOPs of one step (FlopCounterMode, forward + backward): {flow} / mdm = "
            f"{flop_limit:.3f} (the compute-bound limit of this implementation); measured / limit = "
            f"{measured['bare'] / flop_limit:.3f} (bare loop)"
        )
    return {
        "measured_bare": measured["bare"],
        "measured_lightning": measured["lightning"],
        "theory": theory,
        "theory_measured_costs": theory_measured,
        "flop_limit": flop_limit,
        "share": share,
        "k_mdm": k_mdm,
        "k_fmlm_plus": k_fm,
    }


def parser() -> argparse.ArgumentParser:
    """Command-line options (shared with gpu_check.py)."""
    ap = model_parser(__doc__, batch=256)  # the demo's training batch
    ap.add_argument("--methods", nargs="+", default=list(METHODS[:5]), choices=METHODS)
    ap.add_argument("--steps", type=int, default=20, help="optimiser steps per run")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each run")
    ap.add_argument("--compile", action="store_true", help="torch.compile the module's network in both loops")
    ap.add_argument("--memory", action="store_true", help="also the peak memory of one training step per method")
    return ap


def main() -> None:
    """Parse, check the device, measure."""
    args = parse_model_args(parser(), "throughput.py")
    if args.steps < 2:
        raise SystemExit("throughput.py: --steps must be ≥ 2 (at least one timed step after the first)")
    quiet_lightning()
    measure(args)


if __name__ == "__main__":
    main()
