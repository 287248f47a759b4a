"""The costs of an adaptive decode, as the evaluation logs and the results CSV keeps them: the NFE each row spent
(mean and spread), tokens per forward, the NFE histogram; on hand examples and through the callback itself."""

import math

import numpy as np
import pytest
import torch
from torchmetrics import Metric

from callbacks.results_csv import COLUMNS, ResultsCSV
from callbacks.sampling_eval import COST_KEYS, SamplingEvaluation, nfe_histogram, nfe_spread, row_costs
from flowlm.samplers.base import SampleOutput, Sampler
from tests.conftest import validating_trainer


def test_tpf_is_generated_positions_over_the_nfe_each_row_spent():
    prompt_mask = torch.tensor([[True, True, False, False, False, False, False, False]] * 3)
    prompt_mask[2] = True  # a row with nothing to generate
    adaptive = SampleOutput(
        tokens=prompt_mask.long(), confidence=prompt_mask.float(), nfe=3, row_nfe=torch.tensor([2, 3, 0])
    )
    spent, tpf = row_costs(adaptive, prompt_mask)
    assert spent.tolist() == [2.0, 3.0, 0.0]
    assert tpf[:2].tolist() == [6 / 2, 6 / 3] and math.isnan(tpf[2])  # 6 generated positions per row
    fixed = SampleOutput(tokens=prompt_mask.long(), confidence=prompt_mask.float(), nfe=4)  # every row spends nfe
    spent, tpf = row_costs(fixed, prompt_mask)
    assert spent.tolist() == [4.0, 4.0, 4.0] and tpf[:2].tolist() == [1.5, 1.5]


def test_the_spread_and_histogram_of_the_rows_nfe():
    spread = nfe_spread(np.array([1.0, 2.0, 3.0, 4.0, 10.0]))
    assert spread["nfe_min"] == 1.0 and spread["nfe_p50"] == 3.0 and spread["nfe_max"] == 10.0
    assert spread["nfe_p90"] == pytest.approx(4 + 0.6 * 6)  # linear between the 4th and 5th of 5 sorted values
    assert spread["nfe_std"] == pytest.approx(np.sqrt(np.mean((np.array([1, 2, 3, 4, 10]) - 4) ** 2)))
    assert all(math.isnan(v) for v in nfe_spread(np.zeros(0)).values())
    assert nfe_histogram(np.array([3.0, 4.0, 3.0, 3.0])) == {"3": 3, "4": 1}
    assert nfe_histogram(np.array([2.5, 2.5])) == {"2.5": 2}


class Matched(Metric):
    """% rows generated equal to their target, as ``accuracy``."""

    def __init__(self, **_) -> None:
        super().__init__()
        self.add_state("hits", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("rows", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, pred, target) -> None:  # noqa: D102
        self.hits += (pred == target).all(-1).sum()
        self.rows += pred.shape[0]

    def compute(self) -> dict:  # noqa: D102
        return {"accuracy": 100 * self.hits / self.rows}

    def render(self, tokens) -> str:  # noqa: D102
        return str(tokens.tolist())


class Scripted(Sampler):
    """An adaptive 'sampler' that copies the target and spends a scripted NFE per row, batch after batch."""

    family = "mdm"
    confidence_kind = "a-priori"

    def __init__(self, spent: list[list[int]]) -> None:
        self.spent = iter(spent)

    def __call__(self, model, *, prompt, prompt_mask, nfe, generator) -> SampleOutput:  # noqa: D102
        row_nfe = torch.tensor(next(self.spent))
        forced = row_nfe - 2  # a row's commits its budget forced: scripted as its calls past the second
        return SampleOutput(
            tokens=prompt, confidence=torch.ones(prompt.shape), nfe=int(row_nfe.max()), row_nfe=row_nfe, forced=forced
        )


class Module(torch.nn.Module):
    family = "mdm"
    device = torch.device("cpu")
    run_config = {"task": "t", "name": "n", "seed": 0, "eval": {"samplers": {"eb": {"gamma": 0.1}}}}

    def __init__(self) -> None:
        super().__init__()
        self.logged = {}

    def denoiser(self):  # noqa: D102
        return None

    def log(self, key, value, **_):  # noqa: D102
        self.logged[key] = value


def test_an_adaptive_decode_logs_its_mean_nfe_spread_and_tpf_into_the_results_rows():
    """Two batches of 2 rows, 8 positions, 2 of them prompt: rows spent 2, 3 | 3, 6 calls of a 16-call cap."""
    evaluation = SamplingEvaluation(samplers={"eb": Scripted([[2, 3], [3, 6]])}, nfe=[16], metric=Matched)
    trainer = validating_trainer(global_step=7, loggers=[])
    module = Module()
    evaluation._datamodule = None
    evaluation.on_validation_epoch_start(trainer, module)
    tokens = torch.arange(16).view(2, 8)
    batch = {"tokens": tokens, "prompt_mask": torch.arange(8).expand(2, 8) < 2}
    for i in range(2):
        evaluation.on_validation_batch_end(trainer, module, None, batch, i)
    evaluation.on_validation_epoch_end(trainer, module)
    (row,) = evaluation.results
    assert row["nfe"] == 3.5 and row["nfe_budget"] == 16  # the mean over rows, not the cap
    assert (row["nfe_min"], row["nfe_p50"], row["nfe_max"]) == (2.0, 3.0, 6.0)
    assert row["nfe_std"] == pytest.approx(np.std([2, 3, 3, 6]))
    assert row["tpf"] == pytest.approx(24 / 14)  # generated positions over NFE, both summed: 6 / mean NFE 3.5
    assert row["forced_share"] == pytest.approx((1 + 0 + 2 + 3) / 24)  # the commits the budget forced
    assert row["accuracy"] == 100.0
    assert {f"eval/eb/nfe16/{k}" for k in COST_KEYS} <= set(module.logged)
    assert module.logged["eval/eb/nfe16/tpf"] == row["tpf"]
    assert nfe_histogram(evaluation._states[("eb", 16)]["spent"]) == {"2": 1, "3": 2, "6": 1}
    (csv_row,) = ResultsCSV.rows(module.run_config, "MDM", evaluation, None)
    assert set(csv_row) <= set(COLUMNS)
    assert (csv_row["nfe"], csv_row["tpf"], csv_row["nfe_max"]) == (3.5, row["tpf"], 6.0)
    assert csv_row["samples"] == 4  # the rows sampled, behind the percentages (the report's Wilson intervals)


def test_tpf_and_the_forced_share_are_ratios_of_sums_over_ragged_rows():
    """Rows generating 6 and 2 positions in 3 and 4 calls, forced 1 and 2 commits: TPF = 8 / 7 (not the mean of 6/3
    and 2/4, 1.25) and the forced share 3 / 8 (not the mean of 1/6 and 2/2)."""
    evaluation = SamplingEvaluation(samplers={"eb": Scripted([[3, 4]])}, nfe=[16], metric=Matched)
    trainer = validating_trainer(global_step=7, loggers=[])
    module = Module()
    evaluation._datamodule = None
    evaluation.on_validation_epoch_start(trainer, module)
    prompt_mask = torch.arange(8).expand(2, 8) < torch.tensor([[2], [6]])
    evaluation.on_validation_batch_end(
        trainer, module, None, {"tokens": torch.arange(16).view(2, 8), "prompt_mask": prompt_mask}, 0
    )
    evaluation.on_validation_epoch_end(trainer, module)
    (row,) = evaluation.results
    assert row["tpf"] == pytest.approx(8 / 7) and row["forced_share"] == pytest.approx(3 / 8)
