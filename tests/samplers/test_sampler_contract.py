"""The contract every sampler signs, checked for every conf/sampler/*.yaml on a tiny random model of its family:
NFE spent ≤ budget and equal to the network evaluations made (a call over the batch's rows is one; unsupervised
CFG's two branches batched as one call over twice the rows are two, flowlm/samplers/guidance.py), prompt kept
verbatim, every output token a data token, confidence in [0, 1] and 1 on the prompt, a declared confidence kind, and
a budget it cannot honour refused with a clear error before any network call. A new sampler is one file and one YAML;
this file picks the YAML up itself."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

import flowlm.samplers
from flowlm.project import CONF_DIR
from flowlm.samplers import CONFIDENCE_KINDS, Sampler
from runners.common import build
from tests.conftest import random_ar_module

V, L = 6, 12  # data vocabulary ([MASK] = V where the family has one) and sequence length
PROMPT_LENGTHS = (4, 1, 0)  # one row per length: a conditional row, a short prompt, an unconditional row
FREE = L - min(PROMPT_LENGTHS)  # the most non-prompt positions of a row (what the evaluation checks budgets with)
BUDGETS = (1, 2, 3, 5, 12, 16)
BAD_BUDGETS = (0, -1, 2.5, "4", None)
BACKBONE = {"size": "tiny", "n_layers": 2, "d_model": 32, "n_heads": 2, "cond_dim": 16}
SAMPLER_YAMLS = sorted((Path(CONF_DIR) / "sampler").glob("*.yaml"))
# Settings the YAML defaults leave untried, with the budgets they must refuse here (L = 12, FREE = 12).
VARIANTS = [
    ("pr", {"rounds": 4}, {1, 2, 3}),  # R × N = 4 NFE
    ("pr", {"rounds": 2, "flow_steps": None}, {1}),  # N = budget // R
    ("block", {"block_size": 5}, {1, 2}),  # 3 blocks
    ("mlfm", {"guidance": 2.0, "otp_eps": 0.3}, {1}),  # CCFG: 2 NFE per step
    ("mlfm", {"otp_eps": 0.3, "otp_mode": "rounds", "rounds": 3}, {1, 2}),
    ("ar", {"kv_cache": False}, {1, 2, 3, 5}),
    ("ancestral", {"cfg_scale": 1.0}, {1}),  # unsupervised CFG: 2 NFE per step
    ("semi_ar", {"cfg_scale": 1.0, "block_length": 5}, {1, 2, 3, 5}),  # 3 blocks × 2 NFE per step
    (
        "confidence_cfg",
        {"cfg_scale": 0.0},
        set(),
    ),  # w = 0: the unguided sampler, 1 NFE per step  # one call per generated token: the budget covers all 12
]
# The kind each sampler's confidence was recorded with before samplers declared it (calibration data stay comparable).
KINDS_BEFORE_DECLARATION = {
    "a_priori": "a-priori",
    "ancestral": "a-priori",
    "ar": "a-priori",
    "block": "a-posteriori",
    "confidence": "a-priori",
    "flm_euler": "a-posteriori",
    "flow_map": "a-posteriori",
    "mlfm": "a-posteriori",
    "pr": "a-posteriori",
}


def _randomised(module):
    """Every weight drawn from N(0, 0.3²), zero-initialised layers too, so no output is trivially uniform; the
    output layer larger, so the model is confident at some positions (confidences near 1 as well as near 0)."""
    torch.manual_seed(0)
    for name, p in module.named_parameters():
        torch.nn.init.normal_(p, std=1.5 if name.startswith("net.final.linear") else 0.3)
    return module.eval()


def _mdm():
    from lightning_modules.mdm import MDMModule

    return _randomised(MDMModule(data_vocab_size=V, seq_len=L, backbone=BACKBONE, optim={}))


def _flow():
    from lightning_modules.fmlm_plus import FMLMPlusModule

    return _randomised(FMLMPlusModule(data_vocab_size=V, seq_len=L, backbone=BACKBONE, optim={}))


def _mlfm():
    from lightning_modules.mlfm import MLFMModule

    module = MLFMModule(
        data_vocab_size=V, seq_len=L, backbone=BACKBONE, optim={}, init_from="unused.ckpt", adapter={"lora_rank": 4}
    )
    return _randomised(module)


def _ar():
    return random_ar_module(vocab=V, seq_len=L)


FAMILY_MODELS = {"mdm": _mdm, "flow": _flow, "mlfm": _mlfm, "ar": _ar}
# the fields of a model view that run the network
NETWORK_CALLS = ("fn", "pinned_fn", "summary_fn", "lift_fn", "posterior_fn", "extend", "head_fn")


@functools.cache
def _module(family: str):
    if family not in FAMILY_MODELS:
        raise AssertionError(f"no tiny model for family {family!r}: add a builder to FAMILY_MODELS in this file")
    return FAMILY_MODELS[family]()


class Counted:
    """A family's model view whose every network evaluation is counted: a call over at most the batch's rows is one,
    a call over k times the batch's rows (CFG's conditional and unconditional branches in one call) is k."""

    def __init__(self, family: str) -> None:
        self.calls = 0
        view = _module(family).denoiser()

        def counted(fn):
            def call(*args, **kwargs):
                self.calls += -(-args[0].shape[0] // len(PROMPT_LENGTHS))
                return fn(*args, **kwargs)

            return call

        fields = {f.name for f in dataclasses.fields(view)}
        wrapped = {k: counted(getattr(view, k)) for k in NETWORK_CALLS if k in fields and getattr(view, k) is not None}
        self.view = dataclasses.replace(view, **wrapped)


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    prompt = torch.randint(0, V, (len(PROMPT_LENGTHS), L), generator=torch.Generator().manual_seed(1))
    prompt_mask = torch.arange(L) < torch.tensor(PROMPT_LENGTHS)[:, None]
    return prompt, prompt_mask


def _sampler(path: Path, overrides: dict, a_priori_temperature: float) -> Sampler:
    """The sampler of conf/sampler/<path>, as the evaluation builds it (``a_priori_temperature`` from the root)."""
    node = OmegaConf.load(path)
    for key, value in overrides.items():
        node[key] = value
    root = OmegaConf.create({"a_priori_temperature": a_priori_temperature, "sampler": node})
    return build(root.sampler)


def _cases():
    """(yaml, overrides, budgets to refuse or None, a-priori temperature) for every YAML and variant."""
    cases = []
    variants = [(path.stem, {}, None) for path in SAMPLER_YAMLS] + VARIANTS
    for name, overrides, refused in variants:
        temperatures = (
            (0.0, 1.0)
            if "a_priori_temperature" in (Path(CONF_DIR) / "sampler" / f"{name}.yaml").read_text()
            else (0.0,)
        )
        for temperature in temperatures:
            label = "-".join(
                [name, *(f"{k}={v}" for k, v in overrides.items()), *([f"T{temperature:g}"] * (len(temperatures) > 1))]
            )
            cases.append(pytest.param(name, overrides, refused, temperature, id=label))
    return cases


def _run(sampler: Sampler, model: Counted, nfe):
    prompt, prompt_mask = _prompt()
    with torch.no_grad():
        out = sampler(
            model.view, prompt=prompt, prompt_mask=prompt_mask, nfe=nfe, generator=torch.Generator().manual_seed(0)
        )
    return out, prompt, prompt_mask


@pytest.mark.parametrize(("name", "overrides", "refused", "temperature"), _cases())
def test_sampler_honours_its_contract(name, overrides, refused, temperature):
    sampler = _sampler(Path(CONF_DIR) / "sampler" / f"{name}.yaml", overrides, temperature)
    assert isinstance(sampler, Sampler)
    assert sampler.confidence_kind in CONFIDENCE_KINDS
    if not overrides and name in KINDS_BEFORE_DECLARATION:
        assert sampler.confidence_kind == KINDS_BEFORE_DECLARATION[name]
    honoured = []
    for nfe in BUDGETS:
        model = Counted(sampler.family)
        try:
            sampler.check_budget(nfe, free_positions=FREE)
        except ValueError:  # a budget it cannot honour on these sequences: refused by the call too, before compute
            with pytest.raises(ValueError, match="(?i)budget"):
                _run(sampler, model, nfe)
            assert model.calls == 0, f"{name}: {model.calls} network call(s) before refusing NFE {nfe}"
            continue
        honoured.append(nfe)
        out, prompt, prompt_mask = _run(sampler, model, nfe)
        assert isinstance(out.nfe, int) and out.nfe == model.calls <= nfe, (name, nfe, out.nfe, model.calls)
        assert out.tokens.shape == prompt.shape and out.confidence.shape == prompt.shape
        assert torch.equal(out.tokens[prompt_mask], prompt[prompt_mask]), f"{name} changed the prompt at NFE {nfe}"
        assert ((out.tokens >= 0) & (out.tokens < V)).all(), f"{name} left a non-data token ([MASK]?) at NFE {nfe}"
        assert out.confidence.is_floating_point()
        assert ((out.confidence >= 0) & (out.confidence <= 1)).all(), f"{name}: confidence outside [0, 1]"
        assert (out.confidence[prompt_mask] == 1).all(), f"{name}: prompt confidence is not 1"
    assert honoured, f"{name} honoured none of the budgets {BUDGETS}"
    if refused is not None:
        assert set(BUDGETS) - set(honoured) == refused


@pytest.mark.parametrize("path", SAMPLER_YAMLS, ids=[p.stem for p in SAMPLER_YAMLS])
@pytest.mark.parametrize("nfe", BAD_BUDGETS, ids=repr)
def test_a_budget_that_is_not_a_positive_integer_is_refused_before_compute(path, nfe):
    sampler = _sampler(path, {}, 0.0)
    model = Counted(sampler.family)
    with pytest.raises(ValueError, match="(?i)budget"):
        sampler.check_budget(nfe)
    with pytest.raises(ValueError, match="(?i)budget"):
        _run(sampler, model, nfe)
    assert model.calls == 0


def test_every_sampler_is_exported_and_every_yaml_targets_the_package():
    defined = set()
    for info in pkgutil.iter_modules(flowlm.samplers.__path__):
        module = importlib.import_module(f"flowlm.samplers.{info.name}")
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, Sampler) and obj.__module__ == module.__name__:
                defined.add(obj.__name__)
    assert defined and defined <= set(flowlm.samplers.__all__), sorted(defined - set(flowlm.samplers.__all__))
    for path in SAMPLER_YAMLS:
        target = OmegaConf.load(path)._target_
        assert target.rsplit(".", 1)[0] == "flowlm.samplers" and target.rsplit(".", 1)[1] in defined, (
            path.name,
            target,
        )


def _never_sampled(self, model, *, prompt, prompt_mask, nfe, generator):
    """The ``__call__`` of the throwaway Sampler classes below, which are only defined and inspected."""
    raise AssertionError("these test classes are never called")


def test_a_sampler_without_a_valid_confidence_kind_is_refused_where_it_is_defined():
    with pytest.raises(TypeError, match="must declare confidence_kind"):
        type("Undeclared", (Sampler,), {"family": "mdm", "__call__": _never_sampled})
    with pytest.raises(TypeError, match="must be one of"):
        type("Misspelt", (Sampler,), {"family": "mdm", "__call__": _never_sampled, "confidence_kind": "a_priori"})
    base = type("AbstractBase", (Sampler,), {})  # no __call__ yet: a base for other samplers, allowed
    declared = type("Declared", (base,), {"__call__": _never_sampled, "confidence_kind": "a-priori"})
    assert declared().confidence_kind == "a-priori"


def test_the_evaluation_reads_the_declared_kind_and_refuses_a_bad_one():
    from callbacks.sampling_eval import SamplingEvaluation, confidence_kind
    from flowlm.metrics.sudoku_metric import SudokuMetric

    kind = property(lambda self: self.kind)
    sampler = type("Settable", (Sampler,), {"family": "flow", "__call__": _never_sampled, "confidence_kind": kind})()
    sampler.kind = "a-posteriori"
    assert confidence_kind(sampler) == "a-posteriori"
    sampler.kind = "posterior"
    with pytest.raises(ValueError, match="declares confidence_kind 'posterior'"):
        confidence_kind(sampler)
    with pytest.raises(ValueError, match="declares confidence_kind"):
        SamplingEvaluation(samplers={"bad": sampler}, nfe=[4], metric=SudokuMetric)
