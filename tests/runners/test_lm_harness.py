"""The lm-evaluation-harness model `flowlm` (runners/lm_harness.py) and the likelihood estimators it scores with
(flowlm/metrics/likelihood.py): lm-eval's own `simple_evaluate` on the local tasks of tests/fixtures/lm_eval over tiny
checkpoints written as flowlm-train writes them, and the MDM's Monte-Carlo ELBO against its exact value."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import lm_eval
import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager
from mlflow import MlflowClient

from datamodules.sources import load_tokenizer
from flowlm.metrics.likelihood import (
    causal_log_likelihood,
    elbo_draws,
    mdm_elbo_exact,
    mdm_elbo_samples,
    mdm_greedy,
)
from flowlm.metrics.mt_bench import chat_renderer
from flowlm.samplers import MaskedDenoiser
from lightning_modules.ar import ARModule
from lightning_modules.checkpoints import checkpoint_of
from lightning_modules.fmlm_plus import FMLMPlusModule
from lightning_modules.mdm import MDMModule
from lightning_modules.mlfm import MLFMModule
from runners import lm_harness

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "fixtures" / "lm_eval"
TOKENIZER = "data/cpu/tiny_tokenizer"
V, L = 513, 64  # the tiny tokenizer's 512 ids + [PAD]; the row length
BACKBONE = {"d_model": 32, "n_layers": 1, "n_heads": 4, "cond_dim": 16}


def write_checkpoint(path: Path, module_class, data: dict | None = None, record: dict | None = None, **kwargs) -> Path:
    """A checkpoint as flowlm-train writes it (hyper-parameters, the flowlm record with ``data`` as its data config,
    by default GSM8K's on the tiny tokenizer, and ``record``'s keys in its run config), random weights N(0, 0.3²)."""
    torch.manual_seed(0)
    module = module_class(data_vocab_size=V, seq_len=L, backbone=BACKBONE, optim={}, **kwargs)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.3 * torch.randn_like(p))
    module.run_config = {
        "name": f"tiny_{module.family}",
        "data": data or {"_target_": "datamodules.gsm8k.GSM8KDataModule", "tokenizer": TOKENIZER, "seq_len": L},
        **(record or {}),
    }
    torch.save(checkpoint_of(module, global_step=7), path)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lm_harness")
    return {
        "mdm": write_checkpoint(root / "mdm.ckpt", MDMModule),
        "flow": write_checkpoint(root / "flow.ckpt", FMLMPlusModule),
        "ar": write_checkpoint(root / "ar.ckpt", ARModule),
        # MLFM reads its MDM (init_from) when it trains, not when a checkpoint of it is loaded
        "mlfm": write_checkpoint(root / "mlfm.ckpt", MLFMModule, init_from=str(root / "mdm.ckpt")),
        "sudoku": write_checkpoint(root / "sudoku.ckpt", MDMModule, data={"_target_": "datamodules.sudoku.X"}),
        "run": write_checkpoint(root / "run.ckpt", MDMModule, record={"task": "tiny_task"}),  # a run of the suite
    }


@pytest.fixture
def local_tasks(tmp_path, monkeypatch) -> TaskManager:
    """The fixture tasks (data_files relative to the repository root), HF datasets' cache under tmp_path."""
    import datasets

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf_datasets"))
    return TaskManager(include_path=str(TASKS), include_defaults=False)


def evaluate(tasks: TaskManager, names: list[str], model_args: str, **kwargs) -> dict:
    return lm_eval.simple_evaluate(
        model="flowlm",
        model_args=model_args,
        tasks=names,
        task_manager=tasks,
        batch_size=64,
        device="cpu",
        log_samples=True,
        bootstrap_iters=0,
        **kwargs,
    )


def tiny_mdm(vocab: int = 4, seq_len: int = 6, time_conditioning: bool = False) -> MDMModule:
    """A random MDM over a vocabulary small enough to enumerate, weights N(0, 0.2²)."""
    torch.manual_seed(1)
    module = MDMModule(
        data_vocab_size=vocab, seq_len=seq_len, backbone=BACKBONE, optim={}, time_conditioning=time_conditioning
    )
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.2 * torch.randn_like(p))
    return module.eval()


def _rows(tokens: list[list[int]], pinned: int, scored: list[int]) -> tuple[torch.Tensor, ...]:
    """(tokens, pinned, scored) (B, L): the first ``pinned`` positions pinned, the next scored[b] scored."""
    x = torch.tensor(tokens)
    positions = torch.arange(x.shape[1])
    pin = (positions < pinned).expand_as(x)
    score = (positions >= pinned) & (positions < pinned + torch.tensor(scored)[:, None])
    return x, pin.clone(), score


# ---------------------------------------------------------------------------------------------- the estimators
def test_the_enumerated_elbo_is_the_integral_over_times():
    """mdm_elbo_exact against the definition: Σ_M ∫₀¹ (1/t) t^|M| (1−t)^(n−|M|) dt Σ_{i∈M} log p(x_i | x_¬M),
    the Beta integral (k−1)!(n−k)!/n! per masked set, each set a network call made here."""
    module = tiny_mdm()
    model = module.denoiser()
    tokens, pinned, scored = _rows([[0, 1, 2, 3, 1, 0], [3, 2, 2, 1, 0, 0]], 2, [3, 2])
    expected = []
    for b in range(2):
        where = scored[b].nonzero().squeeze(-1).tolist()
        n, total = len(where), 0.0
        for k in range(1, n + 1):
            for subset in itertools.combinations(where, k):
                x = tokens[b].clone()
                x[list(subset)] = module.mask_id
                x[~(pinned[b] | scored[b])] = module.mask_id
                with torch.no_grad():
                    log_p = torch.log_softmax(module(x[None], torch.zeros(1))[0, :, : module.data_vocab_size], -1)
                weight = math.factorial(k - 1) * math.factorial(n - k) / math.factorial(n)
                total += weight * sum(float(log_p[i, tokens[b, i]]) for i in subset)
        expected.append(total)
    assert mdm_elbo_exact(model, tokens, pinned, scored).tolist() == pytest.approx(expected, rel=1e-5)


def test_the_elbo_is_a_normalised_lower_bound_on_an_enumerable_vocabulary():
    """Over every continuation of a 4-token vocabulary: one token's ELBO is its exact log-likelihood (the model's
    probabilities, summing to 1); three tokens' ELBOs sum to at most 1 in probability: exp(ELBO) is the geometric
    mean over orders of chain-rule likelihoods, each normalised, so a bound for any network."""
    module = tiny_mdm()
    model = module.denoiser()
    context = [2, 0]
    for n in (1, 3):
        continuations = list(itertools.product(range(4), repeat=n))
        rows = [context + list(y) + [0] * (6 - 2 - n) for y in continuations]
        tokens, pinned, scored = _rows(rows, 2, [n] * len(rows))
        elbo = mdm_elbo_exact(model, tokens, pinned, scored)
        mass = float(elbo.exp().sum())
        if n == 1:
            x = torch.tensor([context + [module.mask_id] * 4])
            with torch.no_grad():
                log_p = torch.log_softmax(module(x, torch.zeros(1))[0, 2, :4].double(), -1)
            assert elbo.tolist() == pytest.approx(log_p.tolist(), abs=1e-5)
            assert mass == pytest.approx(1.0, abs=1e-6)
        else:
            assert 0.9 < mass <= 1.0 + 1e-6


@pytest.mark.parametrize("estimator", ["time", "count"])
def test_the_monte_carlo_mean_is_the_exact_elbo(estimator):
    """4 096 stratified draws per row: the mean lies within 4 standard errors of the enumerated ELBO (2 and 3 scored
    tokens, one more masked after them), and the standard error is below 5 % of it."""
    module = tiny_mdm()
    model = module.denoiser()
    tokens, pinned, scored = _rows([[1, 3, 0, 2, 1, 0], [0, 0, 3, 3, 1, 2], [2, 1, 1, 0, 3, 3]], 2, [2, 3, 3])
    exact = mdm_elbo_exact(model, tokens, pinned, scored)
    generators = [torch.Generator().manual_seed(10 + b) for b in range(3)]
    terms = mdm_elbo_samples(
        model, tokens, pinned, scored, samples=4096, generators=generators, estimator=estimator, batch_size=2048
    )
    mean, stderr = terms.mean(1), terms.std(1) / math.sqrt(terms.shape[1])
    assert ((mean - exact).abs() <= 4 * stderr).all(), (mean, exact, stderr)
    assert (stderr < 0.05 * exact.abs()).all() and (stderr > 0).all()


def test_one_scored_token_is_exact_with_the_count_estimator():
    """k = 1 always, weight 1: every term is log p(x | context), zero variance; the time estimator is not."""
    model = tiny_mdm().denoiser()
    tokens, pinned, scored = _rows([[1, 2, 3, 0, 0, 0]], 2, [1])
    exact = mdm_elbo_exact(model, tokens, pinned, scored)
    for estimator, spread in (("count", 0.0), ("time", None)):
        gen = [torch.Generator().manual_seed(0)]
        terms = mdm_elbo_samples(model, tokens, pinned, scored, samples=64, generators=gen, estimator=estimator)
        if spread is not None:
            assert terms[0].tolist() == pytest.approx([float(exact[0])] * 64, abs=1e-5) and terms.std() < 1e-6
        else:
            assert float(terms.std()) > 0.1


def test_the_draws_are_stratified_and_mask_only_scored_positions():
    """time: one t per stratum of [ε, 1] (ε + (1 − ε)(j, j+1]/S, the training's floor ε = 10⁻³), weight (1 − ε)/t
    (at most 1 000); count: k_j = ⌊(j + u)·n/S⌋ + 1 masked of the n scored positions, weight n/k; nothing outside
    ``scored`` is ever masked."""
    scored = torch.tensor([False, True, True, False, True, False])
    masked, times, weights = elbo_draws(scored, 8, torch.Generator().manual_seed(0), "time")
    strata, eps = torch.arange(8, dtype=torch.float64), 1e-3
    assert ((times > eps + (1 - eps) * strata / 8) & (times <= eps + (1 - eps) * (strata + 1) / 8)).all()
    assert torch.allclose(weights, (1 - eps) / times) and not masked[:, ~scored].any()
    assert float(weights.max()) < 1 / eps
    _, floorless, _ = elbo_draws(scored, 8, torch.Generator().manual_seed(0), "time", eps=0.0)
    assert ((floorless > strata / 8) & (floorless <= (strata + 1) / 8)).all()
    masked, times, weights = elbo_draws(scored, 6, torch.Generator().manual_seed(0), "count")
    k = masked.sum(-1)
    assert k.tolist() == [1, 1, 2, 2, 3, 3] and not masked[:, ~scored].any()
    assert torch.allclose(weights, 3 / k.double()) and torch.allclose(times, k.double() / 3)


def test_a_rows_terms_do_not_depend_on_the_other_rows_or_the_batching():
    """Row b draws from its own generator: alone, beside another row, or in chunks of 5 network rows, the same
    terms (to float rounding of the batched forward)."""
    model = tiny_mdm().denoiser()
    tokens, pinned, scored = _rows([[1, 3, 0, 2, 1, 0], [0, 0, 3, 3, 1, 2]], 2, [2, 3])
    both = mdm_elbo_samples(
        model, tokens, pinned, scored, samples=16, generators=[torch.Generator().manual_seed(s) for s in (4, 5)]
    )
    alone = mdm_elbo_samples(
        model, tokens[1:], pinned[1:], scored[1:], samples=16, generators=[torch.Generator().manual_seed(5)],
        batch_size=5,
    )  # fmt: skip
    assert torch.allclose(both[1], alone[0], atol=1e-5)


def test_greedy_means_every_scored_token_is_the_argmax_of_one_call():
    """mdm_greedy: true when each scored token is the argmax with the continuation and the tail masked, whatever the
    argmax at the pinned and tail positions; false when one of two scored tokens is not."""
    module = tiny_mdm()
    x = torch.tensor([[1, 2] + [module.mask_id] * 4])
    with torch.no_grad():
        top = module(x, torch.zeros(1))[0, :, :4].argmax(-1).tolist()
    other = [(t + 1) % 4 for t in top]
    rows = [[1, 2, top[2], top[3], 0, 0], [1, 2, top[2], other[3], 0, 0], [1, 2, other[2], top[3], 0, 0]]
    tokens, pinned, scored = _rows(rows, 2, [2, 2, 2])
    assert mdm_greedy(module.denoiser(), tokens, pinned, scored).tolist() == [True, False, False]


def test_a_time_conditioned_mdm_is_refused_by_the_count_estimator_and_the_enumeration():
    model = tiny_mdm(time_conditioning=True).denoiser()
    tokens, pinned, scored = _rows([[1, 2, 3, 0, 0, 0]], 2, [2])
    gen = [torch.Generator().manual_seed(0)]
    with pytest.raises(ValueError, match="time-conditioned MDM needs estimator=time"):
        mdm_elbo_samples(model, tokens, pinned, scored, samples=4, generators=gen, estimator="count")
    with pytest.raises(ValueError, match="time-agnostic"):
        mdm_elbo_exact(model, tokens, pinned, scored)
    assert mdm_elbo_samples(model, tokens, pinned, scored, samples=4, generators=gen).shape == (1, 4)


# ---------------------------------------------------------------------------------------------- through lm-eval
def _single_token_log_p(module, tokenizer, context: str, continuation: str) -> tuple[float, bool] | None:
    """log p(continuation | [BOS] context) of an MDM, read off one forward with the continuation and everything
    after it masked, and whether it is the argmax there; None unless the continuation is one token (then that is its
    ELBO)."""
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    cont = tokenizer(context + continuation, add_special_tokens=False)["input_ids"][len(ctx) :]
    if len(cont) != 1:
        return None
    row = [tokenizer.bos_token_id, *ctx]
    x = torch.tensor([row + [module.mask_id] * (L - len(row))])
    with torch.no_grad():
        logits = module(x, torch.zeros(1))[0, len(row), : module.data_vocab_size]
    return float(torch.log_softmax(logits.double(), -1)[cont[0]]), int(logits.argmax()) == cont[0]


def test_lm_eval_evaluates_an_mdm_checkpoint(checkpoints, local_tasks):
    """Generation (stop sequence "\\n"), multiple choice and perplexity in one simple_evaluate by name and model_args
    string, as the CLI does: the mean NFE spent is in the results; a one-token choice's score is its exact
    log-likelihood (the count estimator, rows [BOS] context continuation [MASK]…)."""
    args = f"checkpoint={checkpoints['mdm']},nfe=4,gen_length=8,mc_samples=16,estimator=count,seed=3"
    results = evaluate(local_tasks, ["flowlm_qa", "flowlm_choice", "flowlm_text"], args)
    info = results["config"]["flowlm"]
    assert (info["family"], info["sampler"], info["generated"], info["mean_nfe"]) == ("mdm", "confidence", 4, 4.0)
    assert info["scored"] > 10 and info["mean_mc_stderr"] > 0  # choices and windows, multi-token ones not exact
    assert results["results"]["flowlm_qa"]["exact_match,none"] == 0.0  # a random model
    assert 0 <= results["results"]["flowlm_choice"]["acc,none"] <= 1
    assert 1 < results["results"]["flowlm_text"]["word_perplexity,none"] < math.inf
    assert all(s["resps"][0][0] and "\n" not in s["resps"][0][0] for s in results["samples"]["flowlm_qa"])

    module = lm_harness.load_module(checkpoints["mdm"]).eval()
    tokenizer = load_tokenizer(TOKENIZER)
    checked = 0
    for sample in results["samples"]["flowlm_choice"]:
        for (context, continuation), ((value, greedy),) in zip(sample["arguments"], sample["resps"], strict=True):
            exact = _single_token_log_p(module, tokenizer, context, continuation)
            assert value <= 0 and isinstance(greedy, bool)
            if exact is not None:
                assert (value, greedy) == (pytest.approx(exact[0], abs=1e-5), exact[1]), (context, continuation)
                checked += 1
    assert checked >= 5  # " green", " sun", " day" are one token


def test_rolling_windows_fill_the_row_and_score_every_token_once(checkpoints, monkeypatch):
    """A document longer than the row: windows of max_length − 1 tokens after one token of context (the first after
    BOS, the last after as many as fill the row), every token scored once, in order; a document that fits scores as
    loglikelihood("", text)."""
    lm = lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), mc_samples=8, batch_size=64, device="cpu")
    windows = []
    score = lm._score
    monkeypatch.setattr(lm, "_score", lambda pairs, **kw: windows.extend(pairs) or score(pairs, **kw))
    text = " ".join([json.loads((TASKS / "text.jsonl").read_text().splitlines()[0])["text"]] * 2)
    ids = lm._encode(text)
    (total,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])
    assert len(ids) > 2 * L and len(windows) == math.ceil(len(ids) / (L - 1))
    assert [t for _, cont in windows for t in cont] == ids
    starts = [sum(len(cont) for _, cont in windows[:w]) for w in range(len(windows))]
    assert windows[0][0] == [lm.bos_id] and all(len(ctx) + len(cont) == L for ctx, cont in windows)
    assert all(ctx == ids[start - len(ctx) : start] for (ctx, _), start in zip(windows[1:], starts[1:], strict=True))
    assert len(windows[1][0]) == 1 and len(windows[-1][0]) > 1  # a middle window's context: 1; the last one's: more
    assert total == pytest.approx(sum(v for v, _ in score(windows)), rel=1e-9)
    short = "The dog ran to the park."
    (rolled,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (short,), 0)])
    ((direct, _),) = lm.loglikelihood([Instance("loglikelihood", {}, ("", short), 0)])
    assert rolled == direct


def test_generation_rows_pin_the_context_and_pad_after_the_window(checkpoints):
    """What the sampler gets: [BOS] context pinned, gen_length free positions after it, PAD pinned to max_length; a
    context too long for the window cut from the left, BOS kept. The NFE recorded is the NFE spent (2 positions: the
    confidence sampler stops after 2 of its budget of 8)."""
    lm = lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), nfe=8, gen_length=2, batch_size=2, device="cpu")
    calls = []
    sampler = lm.sampler
    lm.sampler = lambda model, **kw: calls.append(kw) or sampler(model, **kw)
    lm.sampler.check_budget = sampler.check_budget
    contexts = ["Question: hi\nAnswer:", " the dog" * 40]
    answers = lm.generate_until([Instance("generate_until", {}, (c, {"until": []}), i) for i, c in enumerate(contexts)])
    (call,) = calls
    tokens, mask = call["prompt"], call["prompt_mask"]
    first = [lm.bos_id, *lm._encode(contexts[0])]
    assert tokens.shape == (2, L) and tokens[0, : len(first)].tolist() == first
    assert mask[0].tolist() == [True] * len(first) + [False] * 2 + [True] * (L - len(first) - 2)
    assert tokens[0, len(first) + 2 :].eq(lm.pad_id).all()
    second = lm._encode(contexts[1])
    assert tokens[1, : L - 2].tolist() == [lm.bos_id, *second[len(second) - (L - 3) :]] and mask[1, L - 2 :].sum() == 0
    assert lm.summary()["mean_nfe"] == 2.0 and len(answers) == 2


def test_an_adaptive_sampler_s_nfe_is_recorded_per_request(checkpoints):
    """The EB-sampler finishes rows at different calls (SampleOutput.row_nfe): each request records its own row's
    count, and the mean is theirs, not the batch's call count."""
    lm = lm_harness.FlowLM(
        checkpoint=str(checkpoints["mdm"]), sampler="eb", nfe=64, batch_size=4, device="cpu", **{"sampler.gamma": 20}
    )
    outputs = []
    sampler = lm.sampler
    lm.sampler = lambda model, **kw: outputs.append(sampler(model, **kw)) or outputs[-1]
    lm.sampler.check_budget = sampler.check_budget
    contexts = ["Question: hi\nAnswer:", "The dog ran to the", "Once upon a time there was", "Tom had 3 apples"]
    lm.generate_until([Instance("generate_until", {}, (c, {"until": []}), i) for i, c in enumerate(contexts)])
    (out,) = outputs
    rows = out.row_nfe.tolist()
    assert len(set(rows)) > 1 and max(rows) <= out.nfe  # rows finished apart: the case this checks
    assert lm._nfe == rows and lm.summary()["mean_nfe"] == pytest.approx(sum(rows) / 4)


def test_a_likelihood_does_not_depend_on_the_other_requests(checkpoints):
    """Each request draws from its own seed: scored alone, after another request or in another batch size, the
    same value; another seed, another value (the time estimator)."""
    lm = lm_harness.FlowLM(  # 2 terms: no enumeration (2² − 1 = 3 rows), so the seed shows
        checkpoint=str(checkpoints["mdm"]), mc_samples=2, batch_size=4, device="cpu", estimator="time"
    )
    a, b = ("The dog ran to the", " park"), ("Once upon a time", " there was")
    both = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate([a, b])])
    lm.batch_size = 2
    alone = lm.loglikelihood([Instance("loglikelihood", {}, b, 0)])
    assert alone[0][0] == pytest.approx(both[1][0], abs=1e-5)
    lm.seed = 1
    assert lm.loglikelihood([Instance("loglikelihood", {}, b, 0)])[0][0] != pytest.approx(alone[0][0], abs=1e-3)


def test_the_choices_of_a_question_share_their_draws_and_short_ones_are_exact(checkpoints, monkeypatch):
    """issue 48: estimator auto is count for the suite's time-agnostic MDM; a continuation of n tokens with
    2ⁿ − 1 ≤ mc_samples is enumerated (the exact ELBO, no Monte-Carlo error); the draws are seeded by the context
    alone, so the choices of one question share them (common random draws); rows are max_length long for a DiT."""
    lm = lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), mc_samples=8, batch_size=16, device="cpu")
    assert (lm.estimator, lm.rows) == ("count", "max_length")
    seen = []
    real = lm_harness.mdm_elbo_estimate

    def spy(model, tokens, pinned, scored, *, generators, **kwargs):
        seen.append(([g.initial_seed() for g in generators], tokens.shape[1]))
        return real(model, tokens, pinned, scored, generators=generators, **kwargs)

    monkeypatch.setattr(lm_harness, "mdm_elbo_estimate", spy)
    context = "Once upon a time"
    (short,) = lm.loglikelihood([Instance("loglikelihood", {}, (context, " there"), 0)])
    tokens, pinned, scored = lm._rows([lm._encode_pair(context, " there")], lm.max_length)
    assert int(scored.sum()) <= 3  # 2ⁿ − 1 ≤ 8
    exact = mdm_elbo_exact(lm.module.denoiser(), tokens, pinned, scored)
    assert short[0] == pytest.approx(float(exact[0]), abs=1e-6) and lm._stderr[-1] == 0.0
    seen.clear()
    choices = [(context, " there was a dog who ran"), (context, " there was a cat who sat")]
    lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(choices)])
    ((seeds, length),) = seen
    assert seeds[0] == seeds[1] and length == lm.max_length


def test_item_rows_are_scored_in_order_of_length_and_answered_in_order(checkpoints, monkeypatch):
    """rows=item: the requests are chunked in order of length (calls of few lengths, full), and each answer is the
    one its request gets alone (its draws seeded by its context), in the requests' order."""
    lm = lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), mc_samples=4, batch_size=8, device="cpu", rows="item")
    pairs = [("The dog ran", " to the big park"), ("Once", " upon"), ("The cat sat on", " the mat"), ("A", " b c"),
             ("Then the bird flew", " away"), ("Hi", " there it is now")]  # fmt: skip
    alone = [lm.loglikelihood([Instance("loglikelihood", {}, pair, 0)])[0] for pair in pairs]
    lengths = []
    real = lm_harness.mdm_elbo_estimate

    def spy(model, tokens, pinned, scored, **kwargs):
        lengths.append(tokens.shape[1])
        return real(model, tokens, pinned, scored, **kwargs)

    monkeypatch.setattr(lm_harness, "mdm_elbo_estimate", spy)
    together = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    assert lengths == sorted(lengths) and len(set(lengths)) > 1, lengths  # chunks of 2 requests, shortest first
    for (value, greedy), (one, one_greedy) in zip(together, alone, strict=True):
        assert value == pytest.approx(one, abs=1e-5) and greedy == one_greedy


def test_item_rows_are_as_long_as_the_item(checkpoints, monkeypatch):
    """rows=item (LLaDA's and Dream's harnesses; the default for the LLaMA family): each row is its context and
    continuation, rows of one length batched together."""
    lm = lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), mc_samples=4, batch_size=16, device="cpu", rows="item")
    lengths = []
    real = lm_harness.mdm_elbo_estimate

    def spy(model, tokens, pinned, scored, **kwargs):
        lengths.append(tuple(tokens.shape))
        assert bool((pinned | scored).all())  # nothing after the continuation
        return real(model, tokens, pinned, scored, **kwargs)

    monkeypatch.setattr(lm_harness, "mdm_elbo_estimate", spy)
    pairs = [("The dog ran", " to the park"), ("Once upon a", " time"), ("The cat sat", " on the mat")]
    lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    want = sorted({sum(map(len, lm._encode_pair(c, x))) for c, x in pairs})
    assert sorted(length for _, length in lengths) == want and sum(b for b, _ in lengths) == 3
    with pytest.raises(ValueError, match="rows must be one of"):
        lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), device="cpu", rows="tail")


def test_stop_sequences_cut_the_decoded_answer(checkpoints, local_tasks):
    """The same requests again with a stop sequence taken from the middle of the first answer: each answer is the
    uncut one up to the stop's first occurrence (argmax decoding: the same tokens)."""
    args = f"checkpoint={checkpoints['mdm']},nfe=4,gen_length=12"
    uncut = [s["resps"][0][0] for s in evaluate(local_tasks, ["flowlm_qa"], args)["samples"]["flowlm_qa"]]
    stop = uncut[0][len(uncut[0]) // 2 :][:3]
    results = evaluate(local_tasks, ["flowlm_qa"], args, gen_kwargs={"until": [stop]})
    cut = [s["resps"][0][0] for s in results["samples"]["flowlm_qa"]]
    assert cut == [a[: a.find(stop)] if stop in a else a for a in uncut]
    assert cut[0] != uncut[0] and stop in uncut[0]


def test_an_answer_is_cut_at_the_earliest_stop():
    assert lm_harness.cut_at_stops("a b. c b. d", ["b.", "c"]) == "a "
    assert lm_harness.cut_at_stops("x\n\ny", ["", "z", "\n\n"]) == "x" and lm_harness.cut_at_stops("xy", []) == "xy"


def test_a_stop_that_is_a_special_token_cuts_the_answer(checkpoints):
    """issue 48: lm-eval's gsm8k stops at <|im_end|>, a special token: the cut is made on the raw decode, before the
    special tokens are stripped (stripped first, the stop was gone and the text after it survived)."""
    lm = lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), device="cpu")
    lm.tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    end = lm.tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = lm._encode(" the dog") + [end] + lm._encode(" ran away")
    assert lm._decode_answer(ids, ["<|im_end|>"]) == " the dog"
    assert lm._decode_answer(ids, ["away"]) == " the dog ran " and lm._decode_answer(ids) == " the dog ran away"


def test_an_answer_ends_at_eos(checkpoints):
    lm = lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), device="cpu")
    ids = lm._encode(" the dog")
    assert lm._decode_answer(ids + [lm.eos_id] + lm._encode(" ran")) == " the dog"
    assert lm._decode_answer(ids + [lm.pad_id] * 3) == " the dog"


@pytest.mark.parametrize(
    ("family", "sampler", "why"),
    [("flow", "pr", "a flow-map model .* no likelihood"), ("mlfm", "mlfm", "an MLFM .* no likelihood")],
)
def test_flow_families_generate_and_refuse_likelihoods(checkpoints, local_tasks, family, sampler, why):
    """FMLM+ (Posterior Refinement) and MLFM (bridge sampler), their default samplers, generate at the budget;
    multiple-choice and rolling requests are refused, naming the family."""
    args = f"checkpoint={checkpoints[family]},nfe=4"
    results = evaluate(local_tasks, ["flowlm_qa"], args)
    info = results["config"]["flowlm"]
    assert (info["family"], info["sampler"], info["generated"], info["mean_nfe"]) == (family, sampler, 4, 4.0)
    with pytest.raises(NotImplementedError, match=f"'{family}' checkpoint: {why}"):
        evaluate(local_tasks, ["flowlm_choice"], args)
    lm = lm_harness.FlowLM(checkpoint=str(checkpoints[family]), device="cpu")
    with pytest.raises(NotImplementedError, match="loglikelihood_rolling requests"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("some text",), 0)])


def test_a_mixed_run_of_a_flow_checkpoint_is_refused_before_any_generation(checkpoints, local_tasks, monkeypatch):
    """issue 48: lm-eval runs the generations of a mixed run first; the likelihood tasks of a family without a
    likelihood are refused before any request runs, naming them (an MDM's mixed run goes on)."""
    generated = []
    monkeypatch.setattr(lm_harness.FlowLM, "generate_until", lambda self, requests, **_: generated.append(1) or [])
    run = lm_harness.tracked(lm_eval.simple_evaluate, tracking_uri="none")
    common = {"model": "flowlm", "tasks": ["flowlm_qa", "flowlm_choice"], "task_manager": local_tasks}
    with pytest.raises(ValueError, match="'flow' checkpoint: .* tasks flowlm_choice score likelihoods"):
        run(model_args=f"checkpoint={checkpoints['flow']},nfe=4", device="cpu", **common)
    assert generated == []
    lm_harness.refuse_likelihood_tasks({"checkpoint": str(checkpoints["mdm"])}, common)  # an MDM scores them


def test_an_ar_checkpoint_scores_exactly_and_generates_one_nfe_per_token(checkpoints):
    """AR: log p(continuation | [BOS] context) by the chain rule of one forward (trailing context spaces moved to the
    continuation, an empty context scored after BOS), greedy when every token is the argmax; generation spends one
    NFE per position of the window."""
    lm = lm_harness.FlowLM(checkpoint=str(checkpoints["ar"]), nfe=8, gen_length=8, batch_size=4, device="cpu")
    pairs = [("The dog ran to the", " park"), ("", "Once upon a time"), ("Every morning the girl ", "walked")]
    values = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)])
    module = lm.module
    for (context, continuation), (value, greedy) in zip(pairs, values, strict=True):
        context, continuation = context.rstrip(), continuation if not context.endswith(" ") else " " + continuation
        ctx = lm._encode(context) if context else []
        row = [lm.bos_id, *lm._encode(context + continuation)]
        with torch.no_grad():
            log_p = torch.log_softmax(module(torch.tensor([row]))[0].double(), -1)
        scored = range(1 + len(ctx), len(row))
        exact = sum(float(log_p[i, row[i]]) for i in scored)
        assert value == pytest.approx(exact, abs=1e-4)
        assert greedy == all(int(log_p[i].argmax()) == row[i] for i in scored)
    nothing = torch.zeros(1, len(row), dtype=torch.bool)  # an empty continuation: log 1
    assert causal_log_likelihood(module.denoiser(), torch.tensor([row]), nothing)[0].item() == 0.0
    contexts = [Instance("generate_until", {}, ("Question: hi\nAnswer:", {"until": ["\n"]}), 0)]
    lm.generate_until(contexts)
    assert lm.summary()["mean_nfe"] == 8.0


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ({"sampler": "pr"}, ValueError, r"sampler 'pr' \(PosteriorRefinementSampler\) samples 'flow' models, but the "
         r"checkpoint is a 'mdm' model; its samplers: "),
        ({"sampler": "nope"}, ValueError, "unknown sampler 'nope': conf/sampler holds .*confidence, .*pr, "),
        ({"sampler.tempreature": 1.0}, ValueError, "sampler.tempreature is not a setting of conf/sampler/confidence"),
        ({"nfes": 4}, TypeError, "unknown model_args nfes"),
        ({"nfe": 10_000, "gen_length": 8}, ValueError, "NFE budget 10000 is above the cap of 128"),
        ({"gen_length": 64}, ValueError, "gen_length=64 leaves no room in a row of max_length=64"),
        ({"estimator": "bogus"}, ValueError, "estimator must be one of"),
        ({"batch_size": "auto"}, ValueError, "batch_size must be an integer"),
    ],
)  # fmt: skip
def test_bad_model_args_are_refused_before_the_weights_are_read(checkpoints, monkeypatch, args, error, match):
    monkeypatch.setattr(lm_harness, "load_module", lambda *a, **k: pytest.fail("the weights were read"))
    with pytest.raises(error, match=match):
        lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), device="cpu", **args)


def test_a_sampler_of_another_family_is_refused_naming_the_familys_own(checkpoints):
    with pytest.raises(ValueError, match="its samplers: ") as refused:
        lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), sampler="flow_map", device="cpu")
    listed = str(refused.value).split("its samplers: ")[1].split(", ")
    assert {"ancestral", "confidence", "semi_ar"} <= set(listed)
    assert not {"pr", "a_priori", "flow_map", "mlfm", "ar"} & set(listed)


def test_a_tokenizer_of_another_vocabulary_is_refused(checkpoints):
    with pytest.raises(ValueError, match="trained on 513 data tokens; tokenizer 'data/cpu/tiny_llada'"):
        lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), tokenizer="data/cpu/tiny_llada", device="cpu")


def test_a_checkpoint_without_a_tokenizer_is_refused(checkpoints):
    with pytest.raises(ValueError, match="records no tokenizer .* give model_args tokenizer=NAME_OR_DIR"):
        lm_harness.FlowLM(checkpoint=str(checkpoints["sudoku"]), device="cpu")
    lm = lm_harness.FlowLM(checkpoint=str(checkpoints["sudoku"]), tokenizer=TOKENIZER, device="cpu")
    assert lm.tokenizer_name == "data__cpu__tiny_tokenizer__vicuna"  # lm-eval HF model naming; no chat template


def test_a_missing_budget_or_a_context_that_fills_the_row_is_refused_before_sampling(checkpoints):
    lm = lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), device="cpu")
    request = Instance("generate_until", {}, ("Question: hi\nAnswer:", {"until": ["\n"]}), 0)
    with pytest.raises(ValueError, match="needs an NFE budget: give model_args nfe=N"):
        lm.generate_until([request])
    lm.nfe = 4
    long = Instance("generate_until", {}, (" the dog" * 70, {"until": ["\n"]}), 1)
    with pytest.raises(ValueError, match="fills the row of max_length=64 positions; give gen_length=N"):
        lm.generate_until([request, long])
    assert lm.summary()["generated"] == 0


def test_sampler_settings_reach_the_sampler(checkpoints):
    lm = lm_harness.FlowLM(
        checkpoint=str(checkpoints["mdm"]), sampler="semi_ar", nfe=4, device="cpu",
        **{"sampler.block_length": 4, "sampler.temperature": 0.5},
    )  # fmt: skip
    assert (type(lm.sampler).__name__, lm.sampler.block_length, lm.sampler.temperature) == (
        "SemiARConfidenceSampler",
        4,
        0.5,
    )
    assert lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), device="cpu").sampler.temperature == 0.0


# ---------------------------------------------------------------------------------------------- MLflow
def _run(store: Path, experiment: str):
    """The one MLflow run of ``experiment`` in the SQLite store ``store``."""
    client = MlflowClient(f"sqlite:///{store}")
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return client, run


def test_the_command_line_logs_every_metric_the_nfe_and_the_sampler_to_the_runs_experiment(
    checkpoints, local_tasks, runs_env, tmp_path, monkeypatch
):
    """`flowlm-lm-eval` (main, in-process) on a checkpoint of a run: an MLflow run lm_eval/<run>/<time> in the run's
    experiment holds every numeric metric of lm-eval's results file with its stderr, the NFE spent (mean, max, per
    request), the sampler's settings and lm-eval's as params, the versions as tags, the results as an artifact."""
    out = tmp_path / "out"
    argv = ["flowlm-lm-eval", "--model", "flowlm", "--tasks", "flowlm_qa,flowlm_choice", "--include_path", str(TASKS)]
    argv += ["--model_args", f"checkpoint={checkpoints['run']},nfe=4,gen_length=8,mc_samples=4,sampler.temperature=0.5"]
    argv += ["--device", "cpu", "--batch_size", "64", "--output_path", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    lm_harness.main()
    (written,) = out.rglob("results_*.json")
    results = json.loads(written.read_text())
    client, run = _run(tmp_path / "runs" / "mlflow.db", "tiny_task")
    assert run.info.run_name.startswith("lm_eval/tiny_mdm/") and run.info.status == "FINISHED"
    metrics, params, tags = run.data.metrics, run.data.params, run.data.tags
    expected = {
        f"lm_eval/{task}/{key.replace(',', '/')}": value
        for task, values in results["results"].items()
        for key, value in values.items()
        if isinstance(value, float)
    }
    assert {"lm_eval/flowlm_qa/exact_match/none", "lm_eval/flowlm_choice/acc_stderr/none"} <= expected.keys()
    assert {k: metrics[k] for k in expected} == pytest.approx(expected)
    assert (metrics["lm_eval/mean_nfe"], metrics["lm_eval/max_nfe"]) == (4.0, 4.0)
    assert metrics["lm_eval/mean_mc_stderr"] == pytest.approx(results["config"]["flowlm"]["mean_mc_stderr"])
    assert (params["sampler/name"], params["sampler/temperature"], params["nfe_budget"]) == ("confidence", "0.5", "4")
    assert (params["gen_length"], params["mc_samples"], params["lm_eval/num_fewshot/flowlm_qa"]) == ("8", "4", "0")
    assert params["lm_eval/tasks"] == "flowlm_qa,flowlm_choice" and params["checkpoint"] == str(checkpoints["run"])
    assert tags["lm_eval.version"] == lm_eval.__version__ and tags["lm_eval.task_version.flowlm_qa"] == "1.0"
    assert tags["flowlm.checkpoint"] == str(checkpoints["run"]) and tags["lm_eval.output_path"] == str(out)
    folder = Path(client.download_artifacts(run.info.run_id, "lm_eval", str(tmp_path / "artifacts")))
    assert json.loads((folder / "results.json").read_text())["results"] == results["results"]
    assert json.loads((folder / "nfe.json").read_text()) == {"per_request": [4] * 4, "histogram": {"4": 4}}


def test_an_export_is_tracked_in_a_named_experiment_and_a_failure_ends_its_run(
    checkpoints, local_tasks, runs_env, tmp_path
):
    """An export of the run (flowlm-export) is not its run: the experiment lm_eval (or the one named), the run named
    after the export; an evaluation that fails (generation asked of an export without an NFE budget) ends its run
    FAILED with the error; tracking_uri=none tracks nothing."""
    from runners.export import export

    folder = export(checkpoints["run"], tmp_path / "exports" / "tiny")
    cfg = lm_harness.tracking_config(str(folder))
    assert (cfg.task, cfg.name, cfg.logger.experiment_name) == ("lm_eval", f"lm_eval/{folder}", "lm_eval")
    assert lm_harness.tracking_config(str(checkpoints["run"]), experiment="mine").task == "mine"
    assert lm_harness.tracking_config(str(folder), tracking_uri="none") is None
    with pytest.raises(ValueError, match="needs an NFE budget"):
        lm_harness.evaluate(
            model="flowlm", model_args=f"checkpoint={folder}", tasks=["flowlm_qa"],
            task_manager=local_tasks, device="cpu", experiment="mine",
        )  # fmt: skip
    _, run = _run(tmp_path / "runs" / "mlflow.db", "mine")
    assert run.info.status == "FAILED" and "NFE budget" in run.data.tags["flowlm.error"]
    assert run.info.run_name.startswith(f"lm_eval/{folder}/")  # no task recorded: named by its path


# ---------------------------------------------------------------------------------------------- chat templates
CHAT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
    "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}{% if add_generation_prompt %}<|assistant|>"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory) -> Path:
    """The tiny tokenizer with a chat template (a BOS first, markers <|user|> … <|end|>, no system role)."""
    folder = tmp_path_factory.mktemp("chat_tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((ROOT / TOKENIZER / name).read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT}))
    return folder


def _prompts(lm) -> list[str]:
    """Spy on ``lm``'s sampler: the text of each context row it is given (BOS kept), appended per call."""
    seen = []
    sampler = lm.sampler

    def spy(model, **kw):
        for tokens, pinned in zip(kw["prompt"].tolist(), kw["prompt_mask"].tolist(), strict=True):
            free = pinned.index(False)
            seen.append((tokens[:free], lm.tokenizer.decode(tokens[:free])))
        return sampler(model, **kw)

    lm.sampler = spy
    lm.sampler.check_budget = sampler.check_budget
    return seen


def test_apply_chat_template_puts_the_tokenizers_markers_into_the_prompt(checkpoints, local_tasks, chat_tokenizer):
    """--apply_chat_template with a tokenizer that has a template: the sampler's context row is [BOS] then the
    template's rendering (its own BOS left out), open for the answer; lm-eval's system message, which this template
    refuses, left out; the summary names the layout."""
    lm = lm_harness.FlowLM(
        checkpoint=str(checkpoints["mdm"]), tokenizer=str(chat_tokenizer), nfe=4, gen_length=8, device="cpu"
    )
    seen = _prompts(lm)
    with pytest.warns(UserWarning, match="rendered without the system message"):
        results = lm_eval.simple_evaluate(
            model=lm, tasks=["flowlm_qa"], task_manager=local_tasks, apply_chat_template=True, limit=1,
            system_instruction="Be brief.", bootstrap_iters=0,
        )  # fmt: skip
    ((ids, text),) = seen
    assert results["config"]["flowlm"]["chat_template"] == "tokenizer"
    assert ids[0] == lm.bos_id and ids[1] != lm.bos_id  # one BOS: the row's
    assert text == "<|endoftext|><|user|>Question: How many legs do 4 dogs have?\nAnswer:<|end|><|assistant|>"
    assert lm.tokenizer_name == str(chat_tokenizer).replace("/", "__")
    assert lm.chat_template(True) == CHAT and lm.chat_template(False) is None


def test_without_a_template_the_chat_layout_is_vicunas(checkpoints, local_tasks):
    """The tiny tokenizer has no chat template: Vicuna's layout, lm-eval's system message as its system prompt."""
    lm = lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), nfe=4, gen_length=8, device="cpu")
    seen = _prompts(lm)
    lm_eval.simple_evaluate(
        model=lm, tasks=["flowlm_qa"], task_manager=local_tasks, apply_chat_template=True, limit=1,
        system_instruction="Be brief.", bootstrap_iters=0,
    )  # fmt: skip
    ((_, text),) = seen
    assert text == "<|endoftext|>Be brief. USER: Question: How many legs do 4 dogs have?\nAnswer: ASSISTANT:"
    assert lm.tokenizer_name.endswith("__vicuna") and lm.summary()["chat_template"] == "vicuna"
    with pytest.raises(ValueError, match="template=tokenizer, but the tokenizer has no chat template"):
        lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), template="tokenizer", device="cpu")


def test_a_prefilled_answer_is_continued_in_both_layouts(chat_tokenizer):
    """add_generation_prompt=False (lm-eval's prefilled assistant turn): the last message left open, no EOS."""
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    tok = load_tokenizer(chat_tokenizer)
    render = chat_renderer(tok, "auto", None, drop_bos=True)
    assert render(messages, add_generation_prompt=False) == "<|user|>q<|end|><|assistant|>The answer is"
    vicuna = chat_renderer(tok, "vicuna", "S", drop_bos=True)
    assert vicuna(messages, add_generation_prompt=False) == "S USER: q ASSISTANT: The answer is"
    assert vicuna(messages) == "S USER: q ASSISTANT: The answer is<|endoftext|>"


@pytest.mark.slow
def test_the_command_line_finds_the_model(checkpoints, tmp_path):
    """`python -m runners.lm_harness` takes lm_eval's arguments with `flowlm` registered: a local task by
    --include_path, results table printed."""
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf"), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "runners.lm_harness", "--model", "flowlm", "--tasks", "flowlm_choice"]
    cmd += ["--model_args", f"checkpoint={checkpoints['mdm']},mc_samples=4", "--include_path", str(TASKS)]
    cmd += ["--device", "cpu", "--batch_size", "16", "--limit", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "flowlm_choice" in proc.stdout and "acc" in proc.stdout


def test_llada_s_greedy_check_commits_one_token_a_call():
    """greedy=iterative (LLaDA's suffix_greedy_prediction): one most-confident token a call. A chain model (a position
    predicts its left neighbour + 1 when that is decoded, else weakly 3): from context (0, 1) it decodes 2, 3, 0 one
    token a call, so that continuation is greedy for the iterative check and not for the one-call check (which reads
    3, 3 where the left neighbour is still masked); one token changed is greedy for neither."""
    from flowlm.metrics.likelihood import mdm_greedy, mdm_greedy_iterative

    def chain(x, t):
        left = torch.nn.functional.pad(x, (1, 0), value=4)[:, :-1]
        sure = 5.0 * torch.nn.functional.one_hot((left % 4 + 1) % 4, 4).float()
        weak = torch.nn.functional.one_hot(torch.full_like(x, 3), 4).float()
        return torch.where((left == 4)[..., None], weak, sure)

    model = MaskedDenoiser(fn=chain, mask_id=4)
    tokens, pinned, scored = _rows([[0, 1, 2, 3, 0, 0], [0, 1, 2, 3, 1, 0]], 2, [3, 3])
    assert mdm_greedy_iterative(model, tokens, pinned, scored).tolist() == [True, False]
    assert mdm_greedy(model, tokens, pinned, scored).tolist() == [False, False]
    with pytest.raises(ValueError, match="greedy must be one of"):
        lm_harness.FlowLM(checkpoint="unused", greedy="llada")


def test_the_greedy_model_arg_picks_the_check(checkpoints, monkeypatch):
    called = []
    monkeypatch.setattr(
        lm_harness,
        "mdm_greedy_iterative",
        lambda m, t, p, s: called.append(1) or torch.ones(t.shape[0], dtype=torch.bool),
    )
    lm = lm_harness.FlowLM(checkpoint=str(checkpoints["mdm"]), mc_samples=4, device="cpu", greedy="iterative")
    (result,) = lm.loglikelihood([Instance("loglikelihood", {}, ("The dog", " ran"), 0)])
    assert called and result[1] is True and lm.summary()["greedy"] == "iterative"
