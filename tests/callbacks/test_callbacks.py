"""EMA averaging and the Sudoku metric on hand-made inputs."""

import numpy as np
import pytest
import torch

from callbacks.ema import EMA
from flowlm.metrics.sudoku_metric import SudokuMetric
from flowlm.tasks.sudoku import SudokuLayout, SudokuSpec

GRID = np.array([[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]], dtype=np.int8)
OTHER = np.array([[1, 2, 3, 4], [3, 4, 1, 2], [2, 3, 4, 1], [4, 1, 2, 3]], dtype=np.int8)


def test_ema_update_with_and_without_warmup():
    avg, cur = [torch.zeros(3)], [torch.ones(3)]
    EMA(decay=0.9, warmup=False)._update(avg, cur, torch.tensor(5))
    torch.testing.assert_close(avg[0], torch.full((3,), 0.1))
    avg = [torch.zeros(3)]
    EMA(decay=0.999, warmup=True)._update(avg, cur, torch.tensor(1))  # decay_1 = 2/11
    torch.testing.assert_close(avg[0], torch.full((3,), 1 - 2 / 11))
    with pytest.raises(ValueError, match="decay"):
        EMA(decay=1.0)


def test_unconditional_validity_distinct_and_copies():
    layout = SudokuLayout(SudokuSpec(2, 2), conditional=False)
    bad = GRID.copy()
    bad[0, 0], bad[0, 1] = bad[0, 1], bad[0, 0]  # swaps break the columns
    tokens, _ = layout.encode(np.stack([GRID, GRID, OTHER, bad]), np.stack([GRID, GRID, OTHER, bad]))
    metric = SudokuMetric(layout=layout, train_keys={GRID.tobytes()})
    metric.update(tokens, tokens)
    out = metric.compute()
    assert out["valid_pct"].item() == 75.0
    assert out["distinct_valid"].item() == 2
    assert out["train_copy_pct"].item() == 50.0


def test_conditional_accuracy_needs_valid_grid_and_clues():
    layout = SudokuLayout(SudokuSpec(2, 2), conditional=True)
    puzzle = GRID * (np.arange(16).reshape(4, 4) % 3 == 0)
    target, _ = layout.encode(np.stack([puzzle] * 3), np.stack([GRID] * 3))
    pred = target.clone()
    # second sample: a valid grid that breaks a clue; third: leaves a [MASK]-like id in a cell
    other, _ = layout.encode(puzzle[None], OTHER[None])
    pred[1] = other[0]
    pred[2, layout.prompt_len] = 99
    metric = SudokuMetric(layout=layout)
    metric.update(pred, target)
    out = metric.compute()
    clue_broken = ((puzzle != 0) & (puzzle != OTHER)).any()
    assert clue_broken
    assert out["accuracy"].item() == pytest.approx(100 / 3)
    assert out["exact_match"].item() == pytest.approx(100 / 3)
    assert "→" in metric.render(target[0])  # puzzle → solution


@pytest.mark.filterwarnings("ignore:The ``compute`` method")  # the counts are set, not updated
def test_sudoku_metric_percentages_are_the_exact_quotients_of_its_counts():
    """1 939 of 2 000 is 96.95 %: the float64 nearest it (a table prints 97.0), not float32's 96.9499969 (96.9)."""
    for conditional, key in ((True, "accuracy"), (False, "valid_pct")):
        metric = SudokuMetric(layout=SudokuLayout(SudokuSpec(2, 2), conditional=conditional))
        metric.total, metric.correct, metric.exact = torch.tensor(2000), torch.tensor(1939), torch.tensor(1939)
        value = metric.compute()[key]
        assert value.dtype == torch.float64 and value.item() == 96.95
        assert f"{value.item():.1f}" == "97.0"


def test_token_correct_unconditional_marks_clashing_cells():
    layout = SudokuLayout(SudokuSpec(2, 2), conditional=False)
    bad = GRID.copy()
    bad[0, 0], bad[0, 1] = bad[0, 1], bad[0, 0]  # row 0 stays a permutation; columns 0, 1 and box 0 clash
    tokens, _ = layout.encode(np.stack([GRID, bad]), np.stack([GRID, bad]))
    correct, scored = SudokuMetric(layout=layout).token_correct(tokens, tokens)
    assert scored.all()  # unconditional: every token is a cell
    assert correct[0].all()
    wrong = {divmod(i, 4) for i in (~correct[1]).nonzero().flatten().tolist()}
    # columns 0 and 1 now hold 2 and 1 twice (rows 0 and 2); boxes and rows stay permutations
    assert wrong == {(0, 0), (2, 0), (0, 1), (2, 1)}


def test_token_correct_conditional_scores_solution_cells_only():
    layout = SudokuLayout(SudokuSpec(2, 2), conditional=True)
    puzzle = GRID * (np.arange(16).reshape(4, 4) % 3 == 0)
    target, prompt_mask = layout.encode(puzzle[None], GRID[None])
    pred = target.clone()
    cell = layout.prompt_len + 1 * 5 + 2  # row 1, column 2 of the solution half (rows are 4 cells + a separator)
    pred[0, cell] = 1 if target[0, cell] != 1 else 2
    correct, scored = SudokuMetric(layout=layout).token_correct(pred, target)
    assert scored.sum() == 16 and not (scored & prompt_mask).any()
    assert (scored & ~correct).nonzero().tolist() == [[0, cell]]


def test_calibration_buffer_keeps_the_first_scored_tokens_and_saves_them(tmp_path):
    from callbacks.sampling_eval import CalibrationBuffer, SamplingEvaluation, confidence_kind, save_calibration
    from flowlm.samplers import ConfidenceSampler, PosteriorRefinementSampler

    buffer = CalibrationBuffer(cap=5)
    conf = torch.tensor([[0.9, 0.8, 0.7, 0.6], [0.5, 0.4, 0.3, 0.2]])
    correct = torch.tensor([[True, False, True, False], [True, True, False, False]])
    scored = torch.tensor([[False, True, True, True], [True, True, True, True]])
    buffer.add(conf, correct, scored)
    buffer.add(conf, correct, scored)  # full: ignored
    got_conf, got_ok = buffer.arrays()
    np.testing.assert_allclose(got_conf, [0.8, 0.7, 0.6, 0.5, 0.4])
    assert got_ok.tolist() == [False, True, False, True, True] and buffer.full
    samplers = {
        "pr": PosteriorRefinementSampler(confidence="posterior"),
        "a_priori": PosteriorRefinementSampler(confidence="a_priori"),
        "confidence": ConfidenceSampler(),
    }
    assert [confidence_kind(s) for s in samplers.values()] == ["a-posteriori", "a-priori", "a-priori"]
    other = CalibrationBuffer(cap=3)
    other.add(conf, correct, scored)
    path = save_calibration(tmp_path / "c.npz", {("pr", 4): buffer, ("confidence", 8): other}, samplers)
    with np.load(path) as data:
        assert data["samplers"].tolist() == ["pr", "confidence"] and data["budgets"].tolist() == [4, 8]
        assert data["kinds"].tolist() == ["a-posteriori", "a-priori"]
        np.testing.assert_allclose(data["confidence"][data["group"] == 1], [0.8, 0.7, 0.6])
        assert data["correct"].dtype == bool and len(data["correct"]) == 8
    with pytest.raises(ValueError, match="calibration_tokens"):
        SamplingEvaluation(samplers=samplers, nfe=[4], metric=SudokuMetric, calibration_tokens=-1)


@pytest.mark.parametrize(("max_steps", "sampled"), [(6, [4, 6]), (5, [4, 5])])
def test_sampling_every_n_steps_and_always_the_final_weights(runs_env, monkeypatch, max_steps, sampled):
    """With validation every 2 steps and eval.every_n_steps=4, sampling happens at step 4 during fit and at the last
    step (6, 5) in the runner's final validation of the last weights; the validation loss is computed at every
    validation and the results' step is the last one."""
    from callbacks.sampling_eval import SamplingEvaluation
    from runners.train import train
    from tests.conftest import FAST, compose_config

    steps, losses = [], []
    sample_batch = SamplingEvaluation._sample_batch

    def recorded(self, trainer, *args):
        if not steps or steps[-1] != trainer.global_step:
            steps.append(trainer.global_step)
        return sample_batch(self, trainer, *args)

    monkeypatch.setattr(SamplingEvaluation, "_sample_batch", recorded)
    overrides = ["experiment=sudoku_mdm_easy", "scale=cpu", *FAST, "logger=none", "eval.nfe=[2]"]
    overrides += [f"trainer.max_steps={max_steps}", "eval.every_n_steps=4"]
    cfg = compose_config(overrides=overrides)
    from callbacks.convergence import Convergence

    on_val_end = Convergence.on_validation_end

    def record_loss(self, trainer, pl_module):
        losses.append(trainer.global_step)
        return on_val_end(self, trainer, pl_module)

    monkeypatch.setattr(Convergence, "on_validation_end", record_loss)
    result = train(cfg)
    assert steps == sampled
    assert {row["step"] for row in result["rows"]} == {sampled[-1]}
    assert {2, 4} <= set(losses)  # the validation loss at every validation, also where it did not sample
    with pytest.raises(ValueError, match="every_n_steps must be"):
        SamplingEvaluation(samplers={"x": object()}, nfe=[1], metric=None, every_n_steps=0)
