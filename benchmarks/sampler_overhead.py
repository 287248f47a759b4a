"""Sampler overhead: wall time of one sample batch / (NFE actually spent × one forward of an MDM on ids).

For every sampler of conf/sampler/ (plus CCFG + OTP, two-step PR, and the earlier paths: flow states over the
vocabulary, ``*_onehot``, an option; float64 draws at every position, ``*_full``, and whole-tensor reads, ``*_dense``,
the test oracles of tests/samplers/oracles.py and tests/models/oracles.py), on an untrained
model of its family (MDM, FMLM+, MLFM: conf/method/*.yaml on conf/backbone/<size>.yaml; zero-initialised layers
given small random weights so outputs are not exactly uniform), under ``torch.no_grad()`` and the autocast the
evaluation callback uses:

    ratio = time(sampler(batch, budget)) / (NFE reported by the sampler × time(MDM(ids, t)))

The denominator is the network's own cost, the physical limit of a sampler that calls it NFE times: one forward of
an MDM of the same backbone on token ids (an embedding lookup, the blocks, the output head), whatever the family.
A flow model's forward on vectors over the vocabulary costs more than that by its (B·L) × |V| × d input product;
that excess is the sampler's to avoid (the embedding state space does), so it is counted in the ratio, not hidden in
the denominator. Forwards and sampler calls alternate in every repetition; medians are compared (wall time, and on
a CPU also process CPU time, which other processes on a shared machine do not stretch).

    .venv/bin/python benchmarks/sampler_overhead.py       # tiny DiT, a 6×6 Sudoku evaluation batch, CPU
    .venv/bin/python benchmarks/sampler_overhead.py --batch 4 --seq-len 128 --vocab 50258 --nfe 4   # GPT-2 vocab
    .venv/bin/python benchmarks/sampler_overhead.py --device cuda --backbone small --seq-len 1024 --vocab 50258

The column "outside network calls", from one extra call with the network timed, splits the excess: the share of the
sampler's time spent outside its network calls (its own work); the rest is its network calls costing more than an MDM
forward (a |V|-sized input, per-token times) or running slower inside the sampler than back to back (caches). The AR
sampler is listed, not measured: with its KV cache a call processes one new position (benchmarks/ar_kv_cache.py).

The last column is the sampler's limit where a step needs more than the network by its definition: the matrix-product
FLOPs of one call (torch's FlopCounterMode) over NFE × those of one MDM forward. It is 1.0 for samplers whose only
products are their network calls (PR and the a-priori loop with one flow step per round, the MDM samplers); a
flow-map sub-step adds one (B·L) × |V| × d product δ·E, an MLFM step one p·E (two with CCFG), which at a text
vocabulary cost about as much as the output head. The earlier paths kept as options (``*_onehot``: the network's
|V|-sized input product) count their extra products there too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from common import autocast, build_module, load_group_config, model_parser, parse_model_args, randomise_zero_init
from probes import clock, elapsed, matmul_flops, median, peak_memory

from flowlm.ops.compiled import compiled_tails
from flowlm.project import CONF_DIR, PROJECT_DIR
from runners.common import build

sys.path.insert(0, str(PROJECT_DIR))  # the earlier paths measured below are test oracles (tests/*/oracles.py)
from tests.models.oracles import dense_view  # noqa: E402

FAMILY_METHOD = {"mdm": "mdm", "flow": "fmlm_plus", "mlfm": "mlfm"}
# Samplers whose interface is being changed elsewhere (not measured; listed with the reason).
# A KV-cached AR step processes one new position, not a full forward: its cost is measured against the uncached
# decoder instead (benchmarks/ar_kv_cache.py).
NOT_MEASURED = {"ar": "n/a (KV cache: one position per call; see benchmarks/ar_kv_cache.py)"}
FULL_DRAWS = "tests.samplers.oracles.FullDraw"  # the MDM samplers' earlier whole-tensor stream (test oracles)
DENSE_STATS = "tests.samplers.oracles.Dense"  # the adaptive decoders' earlier dense float64 statistics
# Variants beyond conf/sampler/*.yaml: (name, config, sampler overrides, denoiser options).
VARIANTS = [
    ("pr_n2", "pr", {"flow_steps": 2}, {}),
    ("mlfm_ccfg_otp", "mlfm", {"guidance": 2.0, "otp_eps": 0.05}, {}),
    # the earlier paths, side by side: flow states over the vocabulary (the released draws), float64 everywhere
    ("pr_onehot", "pr", {}, {"space": "onehot"}),
    ("a_priori_onehot", "a_priori", {}, {"space": "onehot"}),
    ("flow_map_onehot", "flow_map", {}, {"space": "onehot"}),
    ("confidence_full", "confidence", {"_target_": FULL_DRAWS + "Confidence"}, {}),
    ("ancestral_full", "ancestral", {"_target_": FULL_DRAWS + "Ancestral"}, {}),
    ("semi_ar_full", "semi_ar", {"_target_": FULL_DRAWS + "SemiAR"}, {}),
    # greedy drafts read off the full (B, L, |V|) log δ (the path before the chunked summary); the confidence
    # sampler's ranking over the whole float32 logits at once
    ("pr_dense", "pr", {}, {"dense": True}),
    ("a_priori_dense", "a_priori", {}, {"dense": True}),
    ("block_dense", "block", {}, {"dense": True}),
    # flow-map sub-steps lifting the full δ (B, L, |V|) before δ·E; MLFM reading whole posteriors
    ("flow_map_dense", "flow_map", {}, {"dense": True}),
    ("flm_euler_dense", "flm_euler", {}, {"dense": True}),
    ("pr_n2_dense", "pr", {"flow_steps": 2}, {"dense": True}),
    ("mlfm_dense", "mlfm", {}, {"dense": True}),
    ("mlfm_ccfg_otp_dense", "mlfm", {"guidance": 2.0, "otp_eps": 0.05}, {"dense": True}),
    ("confidence_dense", "confidence", {}, {"dense_ranking": True}),
    # the adaptive decoders on the network's whole logits read in chunks (``*_logits``: no head in chunks), over a
    # float64 log_softmax of the whole (B, L, |V|) at every call (before the chunked summary: tests/samplers/oracles.py
    # DenseStats), and at T = 1
    ("ancestral_logits", "ancestral", {"_target_": "tests.samplers.oracles.LogitsAncestral"}, {}),
    ("semi_ar_logits", "semi_ar", {"_target_": "tests.samplers.oracles.LogitsSemiAR"}, {}),
    ("confidence_logits", "confidence", {"_target_": "tests.samplers.oracles.LogitsConfidence"}, {}),
    ("threshold_logits", "threshold", {"_target_": "tests.samplers.oracles.LogitsThreshold"}, {}),
    ("eb_logits", "eb", {"_target_": "tests.samplers.oracles.LogitsEB"}, {}),
    ("threshold_dense", "threshold", {"_target_": DENSE_STATS + "Threshold"}, {}),
    ("eb_dense", "eb", {"_target_": DENSE_STATS + "EB"}, {}),
    ("threshold_t1", "threshold", {"temperature": 1.0}, {}),
    (
        "threshold_logits_t1",
        "threshold",
        {"_target_": "tests.samplers.oracles.LogitsThreshold", "temperature": 1.0},
        {},
    ),
    ("threshold_t07", "threshold", {"temperature": 0.7}, {}),
    (
        "threshold_logits_t07",
        "threshold",
        {"_target_": "tests.samplers.oracles.LogitsThreshold", "temperature": 0.7},
        {},
    ),
    ("threshold_dense_t1", "threshold", {"_target_": DENSE_STATS + "Threshold", "temperature": 1.0}, {}),
    ("eb_t1", "eb", {"temperature": 1.0}, {}),
    ("eb_logits_t1", "eb", {"_target_": "tests.samplers.oracles.LogitsEB", "temperature": 1.0}, {}),
    ("eb_dense_t1", "eb", {"_target_": DENSE_STATS + "EB", "temperature": 1.0}, {}),
    ("confidence_t1", "confidence", {"temperature": 1.0}, {}),
    (
        "confidence_logits_t1",
        "confidence",
        {"_target_": "tests.samplers.oracles.LogitsConfidence", "temperature": 1.0},
        {},
    ),
    ("semi_ar_t1", "semi_ar", {"temperature": 1.0}, {}),
    ("semi_ar_logits_t1", "semi_ar", {"_target_": "tests.samplers.oracles.LogitsSemiAR", "temperature": 1.0}, {}),
    # the threshold decoder's other ranks (top-2 margin, negative entropy), at T = 0 and T = 1
    ("threshold_margin", "threshold", {"score": "margin"}, {}),
    ("threshold_margin_t1", "threshold", {"score": "margin", "temperature": 1.0}, {}),
    ("threshold_entropy", "threshold", {"score": "entropy"}, {}),
    ("threshold_entropy_t1", "threshold", {"score": "entropy", "temperature": 1.0}, {}),
]


def kept_variants() -> list[tuple[str, str, dict, dict]]:
    """The samplers that rank, then draw at the committing rows, at T = 1 and 0.7: with the head's group masses kept
    by the rank's fold (``<name>_t1``), the path before (``<name>_2pass_t1``: the committing rows' head product made
    again for the draw, tests/samplers/oracles.py ``TwoPass*``) and the logits path (``<name>_logits_t1``)."""
    oracles = "tests.samplers.oracles."
    rows = []
    for name, config, options, two_pass, logits in [
        ("confidence", "confidence", {}, "TwoPassConfidence", "LogitsConfidence"),
        ("eb", "eb", {}, "TwoPassEB", "LogitsEB"),
        ("threshold_max", "threshold", {"confidence": "max_prob"}, "TwoPassThreshold", "LogitsThreshold"),
        ("semi_ar_max", "semi_ar", {"score": "max_prob"}, "TwoPassSemiAR", "LogitsSemiAR"),
    ]:
        for kind, target in [("", None), ("_2pass", two_pass), ("_logits", logits)]:
            for temperature, tag in [(1.0, "1"), (0.7, "07")]:
                over = {**options, "temperature": temperature, **({"_target_": oracles + target} if target else {})}
                rows.append((f"{name}{kind}_t{tag}", config, over, {}))
    return rows


VARIANTS += [row for row in kept_variants() if row[0] not in {v[0] for v in VARIANTS}]


# With --compile-tails: the samplers whose passes over the logits have a compiled version (flowlm/ops/compiled.py).
COMPILED = ["confidence", "pr", "a_priori", "flow_map", "block"]
COMPILED_VARIANTS = [("pr_dense_compiled", "pr", {}, {"dense": True, "compile": True})]


def sampler_specs(compile_tails: bool = False) -> list[tuple[str, str, dict, dict]]:
    """(name, conf/sampler file, overrides, denoiser options) of every sampler to measure, the configs first; with
    ``compile_tails`` also the ``*_compiled`` variants (option ``compile``: run inside ``compiled_tails()``)."""
    names = sorted(p.stem for p in (Path(CONF_DIR) / "sampler").glob("*.yaml"))
    compiled = [(f"{name}_compiled", name, {}, {"compile": True}) for name in COMPILED] if compile_tails else []
    compiled += COMPILED_VARIANTS if compile_tails else []
    return [(name, name, {}, {}) for name in names] + VARIANTS + compiled


def view_of(module, options: dict):
    """The module's sampler view with ``options``; ``dense``: without its head summaries (``dense_view``)."""
    options = dict(options)
    dense = options.pop("dense", False)
    view = module.denoiser(**options)
    return dense_view(view) if dense else view


def make_sampler(config: str, overrides: dict):
    """A sampler from conf/sampler/<config>.yaml with overrides (``a_priori_temperature`` left at its default)."""
    from omegaconf import OmegaConf

    node = load_group_config("sampler", config)
    for key, value in overrides.items():
        node[key] = value
    root = OmegaConf.create({"sampler": node})
    return build(root.sampler)


def bare_inputs(family: str, module, prompt: torch.Tensor, prompt_mask: torch.Tensor, nfe: int) -> tuple:
    """What the sampler's first network call feeds the model, for the bare forward: (args, keyword args)."""
    b, length = prompt.shape
    device = prompt.device
    if family == "mdm":
        return (torch.where(prompt_mask, prompt, module.mask_id), torch.zeros(b, device=device)), {}
    if family == "flow":  # as the flow samplers call it: per-sequence times, prompt tokens pinned at s = t = 1
        v = module.data_vocab_size
        onehot = torch.nn.functional.one_hot(prompt.clamp(0, v - 1), v).float()
        x = torch.where(prompt_mask[..., None], onehot, torch.randn(b, length, v, device=device))
        s, t = torch.zeros(b, device=device), torch.full((b,), 1.0 / nfe, device=device)
        return (x, s, t), {"pinned": prompt_mask}
    emb = module.net.embeddings
    z = torch.where(prompt_mask[..., None], emb[prompt], emb[module.mask_id])
    return (z, torch.zeros(b, device=device)), {}


def measure_sampler(module, sampler, args, device, prompt, prompt_mask, *, limit, denoiser_options=None) -> dict:
    """Blocks of MDM forwards on ids (``limit``: the module and its inputs) and sampler calls alternate, B S B S … S
    B (after a warm-up of each): every sampler call is compared with the mean of the two blocks around it (which
    cancels a drift of the machine's speed), and the median of those per-call ratios is reported, with the medians
    of the times themselves."""
    options = dict(denoiser_options or {})
    compile_tails = options.pop("compile", False)
    context = tails_context(compile_tails, options.pop("dense_ranking", False))
    denoiser = view_of(module, options)
    bare, (inputs, kwargs) = limit
    clocks = (0, 1) if device.type == "cpu" else (0,)  # wall; and process CPU time on a CPU

    def bare_block(calls: int) -> tuple[float, float]:
        start = clock(device)
        for _ in range(calls):
            bare(*inputs, **kwargs)
        wall, cpu = elapsed(start, device)
        return wall / calls, cpu / calls

    def sample(rep: int) -> tuple[tuple[float, float], int]:
        gen = torch.Generator(device=device).manual_seed(args.seed + rep)
        start = clock(device)
        with context():
            out = sampler(denoiser, prompt=prompt, prompt_mask=prompt_mask, nfe=args.nfe, generator=gen)
        return elapsed(start, device), int(out.nfe)

    with torch.no_grad(), autocast(args.precision, device):
        _, calls = sample(-1)  # warm-up (and the NFE this sampler spends)
        bare_block(max(calls, 1))
        bares, samples, nfes = [bare_block(max(calls, 1))], [], []
        for rep in range(args.reps):
            spent, nfe = sample(rep)
            samples.append(spent)
            nfes.append(nfe)
            bares.append(bare_block(max(calls, 1)))
        with context():
            inside, total = network_share(denoiser, sampler, args, device, prompt, prompt_mask)
            flops = matmul_flops(
                lambda: sampler(
                    denoiser,
                    prompt=prompt,
                    prompt_mask=prompt_mask,
                    nfe=args.nfe,
                    generator=torch.Generator(device=device).manual_seed(args.seed),
                )
            )
        forward_flops = matmul_flops(lambda: bare(*inputs, **kwargs))
    row = {"nfe": median(nfes), "sample_s": median([x[0] for x in samples]), "forward_s": median([b[0] for b in bares])}
    for i, key in zip(clocks, ("ratio", "ratio_cpu"), strict=False):
        per_call = [
            samples[r][i] / (nfes[r] * (bares[r][i] + bares[r + 1][i]) / 2) if nfes[r] else float("nan")
            for r in range(len(samples))
        ]
        row[key] = median(per_call)
    row["outside_share"] = 1 - inside / total  # the sampler's own work, outside its network calls
    row["flop_ratio"] = flops / (max(calls, 1) * forward_flops)  # the compute-bound limit of this implementation
    return row


def tails_context(compile_tails: bool, dense_ranking: bool):
    """A context factory for one sampler's calls: compiled tails on or off; ``dense_ranking``: the MDM confidence
    sampler ranks over the whole float32 logits at once (``fused_max_log_prob`` run eagerly, the earlier path)
    instead of in vocabulary chunks."""
    import contextlib

    from flowlm.samplers import mdm_confidence

    @contextlib.contextmanager
    def context():
        chunked = mdm_confidence.max_log_prob
        if dense_ranking:
            mdm_confidence.max_log_prob = dense_max_log_prob
        try:
            with compiled_tails(compile_tails):
                yield
        finally:
            mdm_confidence.max_log_prob = chunked

    return context


def dense_max_log_prob(logits: torch.Tensor, *, rows: torch.Tensor | None = None):
    """``max_log_prob`` over the whole float32 logits (of the selected rows) at once, eagerly."""
    from flowlm.samplers import mdm_confidence

    picked = logits if rows is None else logits.reshape(-1, logits.shape[-1])[rows]
    return mdm_confidence.fused_max_log_prob.eager(picked)


def network_share(denoiser, sampler, args, device, prompt, prompt_mask) -> tuple[float, float]:
    """One diagnostic call (not among the timed ones: its timer syncs a GPU at every network call) with the
    network timed: (seconds inside network calls, seconds in all). What is left is the sampler's own work."""
    import dataclasses

    spent = [0.0]
    pick = 1 if device.type == "cpu" else 0

    def timed(fn):
        def call(*inputs, **options):
            start = clock(device)
            out = fn(*inputs, **options)
            spent[0] += elapsed(start, device)[pick]
            return out

        return call

    fns = {"fn": timed(denoiser.fn)}
    for field in ("pinned_fn", "summary_fn", "lift_fn", "posterior_fn", "head_fn"):
        if getattr(denoiser, field, None) is not None:
            fns[field] = timed(getattr(denoiser, field))
    gen = torch.Generator(device=device).manual_seed(args.seed)
    start = clock(device)
    sampler(dataclasses.replace(denoiser, **fns), prompt=prompt, prompt_mask=prompt_mask, nfe=args.nfe, generator=gen)
    return spent[0], elapsed(start, device)[pick]


def interleaved_medians(calls: dict, reps: int, device) -> dict[str, float]:
    """Median seconds of each no-argument call, the calls interleaved over ``reps`` rounds after an untimed one
    (process CPU time on a CPU, wall time on a GPU)."""
    times: dict[str, list[float]] = {key: [] for key in calls}
    pick = 1 if device.type == "cpu" else 0
    for rep in range(reps + 1):
        for key, call in calls.items():
            start = clock(device)
            call()
            if rep:
                times[key].append(elapsed(start, device)[pick])
    return {key: median(values) for key, values in times.items()}


def flow_forward_cost(module, limit, args, device, prompt, prompt_mask) -> tuple[float, float]:
    """An FMLM+ no-grad forward (pinned form) on states over the vocabulary, and on the same states projected
    (h = x·E, the embedding space), each over one MDM forward on ids (``limit``)."""
    (x, s, t), kwargs = bare_inputs("flow", module, prompt, prompt_mask, args.nfe)
    bare, (inputs, bare_kwargs) = limit
    with torch.no_grad():
        h = module.net.input_embeddings(x)
    with torch.no_grad(), autocast(args.precision, device):
        times = interleaved_medians(
            {
                "mdm": lambda: bare(*inputs, **bare_kwargs),
                "onehot": lambda: module(x, s, t, **kwargs),
                "embedded": lambda: module(h, s, t, embedded=True, **kwargs),
            },
            args.reps,
            device,
        )
    return times["onehot"] / times["mdm"], times["embedded"] / times["mdm"]


def compiled_forward_cost(module, limit, args, device, prompt, prompt_mask) -> float:
    """The FMLM+ no-grad forward on h = x·E with its soft-capped log-softmax compiled, over an MDM forward."""
    (x, s, t), kwargs = bare_inputs("flow", module, prompt, prompt_mask, args.nfe)
    bare, (inputs, bare_kwargs) = limit
    with torch.no_grad():
        h = module.net.input_embeddings(x)

    def compiled() -> None:
        with compiled_tails():
            module(h, s, t, embedded=True, **kwargs)

    with torch.no_grad(), autocast(args.precision, device):
        times = interleaved_medians(
            {"mdm": lambda: bare(*inputs, **bare_kwargs), "compiled": compiled}, args.reps, device
        )
    return times["compiled"] / times["mdm"]


def per_token_time_cost(module, args, device, prompt, prompt_mask) -> tuple[float, float]:
    """Flow models: a bare forward at dense per-token (B, L) times, and one in the pinned form the samplers use
    (times per sequence, prompt tokens pinned at s = t = 1), each over one at per-sequence times (no token pinned)."""
    (x, s, t), kwargs = bare_inputs("flow", module, prompt, prompt_mask, args.nfe)
    pinned = kwargs["pinned"]
    dense = (x, torch.where(pinned, 1.0, s[:, None]), torch.where(pinned, 1.0, t[:, None]))
    with torch.no_grad(), autocast(args.precision, device):
        times = interleaved_medians(
            {
                "token": lambda: module.net(*dense),
                "pinned": lambda: module.net(x, s, t, **kwargs),
                "seq": lambda: module.net(x, s, t),
            },
            args.reps,
            device,
        )
    return times["token"] / times["seq"], times["pinned"] / times["seq"]


def softcap_cost(module, args, device, prompt, prompt_mask) -> tuple[float, float]:
    """The released DiT's attention soft-cap (the default): an FMLM+ no-grad forward, and a forward + backward, with
    the cap over the same without it (SDPA: its flash kernel without autograd on a CPU, FlexAttention vs SDPA's fused
    kernels on CUDA)."""
    inputs, kwargs = bare_inputs("flow", module, prompt, prompt_mask, args.nfe)
    blocks = module.net.blocks
    caps = [block.softcap for block in blocks]

    def run(cap: float, grad: bool):
        def call() -> None:
            for block in blocks:
                block.softcap = cap
            with torch.set_grad_enabled(grad), autocast(args.precision, device):
                out = module(*inputs, **kwargs)
            if grad:
                out.float().sum().backward()

        return call

    calls = {f"{cap}_{grad}": run(cap, grad) for grad in (False, True) for cap in (50.0, 0.0)}
    try:
        times = interleaved_medians(calls, args.reps, device)
    finally:
        for block, cap in zip(blocks, caps, strict=True):
            block.softcap = cap
        module.zero_grad(set_to_none=True)
    return times["50.0_False"] / times["0.0_False"], times["50.0_True"] / times["0.0_True"]


def measure(args, *, log=print) -> dict:
    """Every sampler's overhead ratio; printed as a table and one ``ratio`` line per sampler."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    modules = {}
    for family, method in FAMILY_METHOD.items():
        module = build_module(method, backbone=args.backbone, vocab=args.vocab, seq_len=args.seq_len, seed=args.seed)
        randomise_zero_init(module, seed=args.seed)
        modules[family] = module.to(device).eval()
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=gen).to(device)
    prompt_mask = torch.zeros(args.batch, args.seq_len, dtype=torch.bool, device=device)
    prompt_mask[:, : args.prompt_len] = True
    base = modules["mdm"].net
    log(
        f"# sampler overhead: backbone {args.backbone} (d {base.d_model} × {len(base.blocks)} blocks), batch "
        f"{args.batch} × seq {args.seq_len} (prompt {args.prompt_len}), vocab {args.vocab}, NFE budget {args.nfe}, "
        f"{args.precision}, {device.type}, {args.reps} interleaved reps, torch threads {torch.get_num_threads()}"
    )
    on_cpu = device.type == "cpu"
    log(
        "| sampler | family | NFE spent | ms / batch | ms / MDM forward | ratio (wall) |"
        + (" ratio (CPU time) |" if on_cpu else "")
        + " outside network calls | matmul FLOPs / (NFE × forward) |"
    )
    log("|---|---|---|---|---|---|---|---|" + ("---|" if on_cpu else ""))
    rows, lines = {}, []
    limit = (modules["mdm"], bare_inputs("mdm", modules["mdm"], prompt, prompt_mask, args.nfe))
    for name, config, overrides, options in sampler_specs(getattr(args, "compile_tails", False)):
        if args.samplers and name not in args.samplers:
            continue
        if name in NOT_MEASURED:
            lines.append(f"ratio sampler/(NFE × forward) [{name}]: {NOT_MEASURED[name]}")
            log(f"| {name} | — | — | — | — | {NOT_MEASURED[name]} |" + (" |" if on_cpu else "") + " | |")
            continue
        sampler = make_sampler(config, overrides)
        free = args.seq_len - args.prompt_len
        if config == "block" and sampler.block_size * args.nfe < free:  # more blocks than the budget: K = 1 per block
            sampler = make_sampler(config, {**overrides, "block_size": -(-free // args.nfe)})
            log(f"note: block_size {sampler.block_size} here, so that {free} positions fit {args.nfe} NFE")
        if getattr(sampler, "block_length", None) and -(-free // sampler.block_length) > args.nfe:  # semi-AR
            sampler = make_sampler(config, {**overrides, "block_length": -(-free // args.nfe)})
            log(f"note: {name}'s block_length {sampler.block_length} here, so that {free} positions fit {args.nfe} NFE")
        if getattr(sampler, "guidance", 0) > 0 and args.prompt_len == 0:
            log(f"note: {name} without a prompt (--prompt-len 0): CCFG has no context to corrupt, no reference call")
        row = measure_sampler(
            modules[sampler.family], sampler, args, device, prompt, prompt_mask, limit=limit, denoiser_options=options
        )
        rows[name] = {"family": sampler.family, **row}
        cpu_cell = f" {row['ratio_cpu']:.3f} |" if on_cpu else ""
        log(
            f"| {name} | {sampler.family} | {row['nfe']:g} | {1e3 * row['sample_s']:.2f} | "
            f"{1e3 * row['forward_s']:.2f} | {row['ratio']:.3f} |{cpu_cell} {100 * row['outside_share']:.1f} % | "
            f"{row['flop_ratio']:.3f} |"
        )
        note = f" (wall clock; process CPU time: {row['ratio_cpu']:.3f})" if on_cpu else " (wall clock)"
        lines.append(f"ratio sampler/(NFE × forward) [{name}]: {row['ratio']:.3f}{note}")
    for line in lines:
        log(line)
    if any(r["family"] == "flow" for r in rows.values()):
        onehot, embedded = flow_forward_cost(modules["flow"], limit, args, device, prompt, prompt_mask)
        rows["_flow_forward_onehot"], rows["_flow_forward_embedded"] = onehot, embedded
        log(
            f"ratio flow forward/MDM forward: {onehot:.3f} (states over the vocabulary: x·E inside), {embedded:.3f} "
            "(states h = x·E: the network alone), no grad, pinned form"
        )
        if getattr(args, "compile_tails", False):
            rows["_flow_forward_compiled"] = compiled = compiled_forward_cost(
                modules["flow"], limit, args, device, prompt, prompt_mask
            )
            log(f"ratio flow forward/MDM forward, soft-capped log-softmax compiled: {compiled:.3f} (states h = x·E)")
        dense, pinned = per_token_time_cost(modules["flow"], args, device, prompt, prompt_mask)
        rows["_flow_per_token_times"], rows["_flow_pinned_times"] = dense, pinned
        log(
            f"note: over an FMLM+ forward at per-sequence (B,) times, one at dense per-token (B, L) times (time MLPs "
            f"and adaLN per token) costs {dense:.2f}×, one in the pinned form the flow samplers use (prompt and "
            f"committed tokens at s = t = 1, two adaLN rows per sequence) {pinned:.2f}×; the denominator above is "
            "the pinned form"
        )
        no_grad, grad = softcap_cost(modules["flow"], args, device, prompt, prompt_mask)
        rows["_softcap_no_grad"], rows["_softcap_train"] = no_grad, grad
        log(
            f"note: the attention soft-cap (50, the released DiT's default) costs {no_grad:.2f}× an uncapped FMLM+ "
            f"no-grad forward and {grad:.2f}× a forward + backward (on a CPU it is written out; uncapped, SDPA runs "
            "its flash kernel without autograd and its math kernel with it)"
        )
    if getattr(args, "memory", False):
        rows["_peak_memory"] = memory_rows(modules, args, device, prompt, prompt_mask, log)
    return rows


def memory_rows(modules, args, device, prompt, prompt_mask, log) -> dict[str, float]:
    """Peak memory of one call of PR (both state spaces; the chunked summary and the full log δ), the a-priori loop
    (both), and the MDM confidence sampler (both draws), each added to the process's memory before it; printed as
    MiB and over the confidence sampler's."""
    specs = [
        ("confidence", "confidence", {}, {}),
        ("confidence_full", "confidence", {"_target_": FULL_DRAWS + "Confidence"}, {}),
        ("pr", "pr", {}, {}),
        ("pr_dense", "pr", {}, {"dense": True}),
        ("pr_onehot", "pr", {}, {"space": "onehot"}),
        ("a_priori", "a_priori", {}, {}),
        ("a_priori_dense", "a_priori", {}, {"dense": True}),
    ]
    out = {}
    for name, config, overrides, options in specs:
        sampler = make_sampler(config, overrides)
        module = modules[sampler.family]

        def call(sampler=sampler, module=module, options=options) -> None:
            with torch.no_grad(), autocast(args.precision, device):
                denoiser = view_of(module, options)
                gen = torch.Generator(device=device).manual_seed(args.seed)
                sampler(denoiser, prompt=prompt, prompt_mask=prompt_mask, nfe=args.nfe, generator=gen)

        call()  # warm-up: allocator caches, lazy initialisation
        out[name] = min(peak_memory(call, device) for _ in range(2))
    base = out["confidence"]
    per_bld = args.batch * args.seq_len * modules["flow"].net.d_model * 4
    for name, value in out.items():
        over = f"{value / base:.3f}×" if base > 0 else "n/a ×"
        log(
            f"peak memory [{name}]: {value / 2**20:.1f} MiB, {over} the confidence sampler's "
            f"(B·L·d float32 = {per_bld / 2**20:.2f} MiB)"
        )
    return out


def parser() -> argparse.ArgumentParser:
    """Command-line options (shared with gpu_check.py)."""
    ap = model_parser(__doc__, batch=128)  # an evaluation batch of the CPU demo
    ap.add_argument("--nfe", type=int, default=12, help="NFE budget of every sampler")
    ap.add_argument("--samplers", nargs="*", default=None, help="only these (names as printed)")
    ap.add_argument("--memory", action="store_true", help="also the peak memory of one PR / confidence call")
    ap.add_argument("--compile-tails", action="store_true", help="also the samplers with compiled logit passes")
    return ap


def main() -> None:
    """Parse, check the device, measure."""
    measure(parse_model_args(parser(), "sampler_overhead.py"))


if __name__ == "__main__":
    main()
