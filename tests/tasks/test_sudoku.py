"""Sudoku task: generator, solver, layout, puzzle files, metrics and the datamodule."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import datamodules.sudoku as dm_module
from datamodules.sudoku import SudokuDataModule
from flowlm.metrics.sudoku import grid_hashes, grid_keys, respects_clues, valid_grids
from flowlm.tasks.sudoku import (
    SudokuLayout,
    SudokuSpec,
    clues_for,
    count_solutions,
    generate,
    grid_to_string,
    is_valid_grid,
    make_puzzle,
    random_full_grid,
    read_puzzle_file,
    render,
    solve,
)
from flowlm.tasks.sudoku import generator as G

SPEC4, SPEC6, SPEC9 = SudokuSpec(2, 2), SudokuSpec(2, 3), SudokuSpec(3, 3)

GRID4 = np.array([[1, 2, 3, 4], [3, 4, 1, 2], [2, 1, 4, 3], [4, 3, 2, 1]], dtype=np.int8)
GRID9 = np.array(
    [
        [5, 3, 4, 6, 7, 8, 9, 1, 2],
        [6, 7, 2, 1, 9, 5, 3, 4, 8],
        [1, 9, 8, 3, 4, 2, 5, 6, 7],
        [8, 5, 9, 7, 6, 1, 4, 2, 3],
        [4, 2, 6, 8, 5, 3, 7, 9, 1],
        [7, 1, 3, 9, 2, 4, 8, 5, 6],
        [9, 6, 1, 5, 3, 7, 2, 8, 4],
        [2, 8, 7, 4, 1, 9, 6, 3, 5],
        [3, 4, 5, 2, 8, 6, 1, 7, 9],
    ],
    dtype=np.int8,
)


def _swap(grid: np.ndarray, a: tuple[int, int], b: tuple[int, int]) -> np.ndarray:
    out = grid.copy()
    out[a], out[b] = grid[b], grid[a]
    return out


def _invalid_variants(grid: np.ndarray, spec: SudokuSpec) -> dict[str, np.ndarray]:
    """Grids breaking exactly one kind of unit (where possible), plus empty and out-of-range cells."""
    n = spec.n
    cyclic = np.array([[(r + c) % n + 1 for c in range(n)] for r in range(n)], dtype=np.int8)
    zero, high, negative = grid.copy(), grid.copy(), grid.copy()
    zero[1, 2], high[0, 0], negative[0, 0] = 0, n + 1, -1
    return {
        # Swapping two cells of one column inside one box keeps that column and box, breaks two rows.
        "rows": _swap(grid, (0, 0), (1, 0)),
        # Swapping two cells of one row inside one box keeps that row and box, breaks two columns.
        "cols": _swap(grid, (0, 0), (0, 1)),
        # A cyclic Latin square has perfect rows and columns but repeated digits in boxes.
        "boxes": cyclic,
        "zero": zero,
        "high": high,
        "negative": negative,
    }


# ------------------------------------------------------------------------------------------------------------
# Spec and difficulty


def test_spec_validation():
    assert SPEC9.n == 9 and SudokuSpec(3, 4).n == 12
    for bad in [(0, 3), (1, 1), (4, 5), (-1, -2)]:
        with pytest.raises(ValueError, match="box"):
            SudokuSpec(*bad)


def test_clues_for_scales_with_cells():
    assert [clues_for(SPEC4, d) for d in ("easy", "medium", "hard")] == [8, 7, 6]
    assert [clues_for(SPEC6, d) for d in ("easy", "medium", "hard")] == [18, 16, 13]
    assert [clues_for(SPEC9, d) for d in ("easy", "medium", "hard")] == [40, 35, 30]
    with pytest.raises(ValueError, match="easy.*hard.*medium"):
        clues_for(SPEC9, "expert")


# ------------------------------------------------------------------------------------------------------------
# Solver and generator


@pytest.mark.parametrize("shape", [(1, 2), (2, 2), (2, 3), (3, 2), (3, 3), (3, 4), (4, 4)])
def test_random_full_grid_is_valid(shape):
    spec = SudokuSpec(*shape)
    rng = np.random.default_rng(0)
    for _ in range(3):
        grid = random_full_grid(spec, rng)
        assert grid.dtype == np.int8 and grid.shape == (spec.n, spec.n)
        assert is_valid_grid(grid, spec)
        assert valid_grids(torch.from_numpy(grid)[None], spec).item()


def test_solver_counts_and_solves():
    assert count_solutions(GRID9, SPEC9) == 1
    empty4 = np.zeros((4, 4), dtype=np.int8)
    assert count_solutions(empty4, SPEC4, limit=1000) == 288
    clash = GRID4.copy()
    clash[0, 1] = 1  # two 1s in the first row
    assert count_solutions(clash, SPEC4) == 0 and solve(clash, SPEC4) is None
    puzzle = GRID9.copy()
    puzzle[np.random.default_rng(0).random((9, 9)) < 0.7] = 0
    solved = solve(puzzle, SPEC9)
    assert is_valid_grid(solved, SPEC9) and ((puzzle == 0) | (puzzle == solved)).all()
    # A randomized solve of an empty grid is a random valid grid.
    empty9 = np.zeros((9, 9), dtype=np.int8)
    a, b = (solve(empty9, SPEC9, rng=np.random.default_rng(i)) for i in range(2))
    assert is_valid_grid(a, SPEC9) and is_valid_grid(b, SPEC9) and not (a == b).all()
    with pytest.raises(ValueError, match="shape"):
        solve(np.zeros((9, 9)), SPEC4)


@pytest.mark.parametrize(("spec", "num"), [(SPEC4, 40), (SPEC6, 20), (SPEC9, 3)], ids=["4x4", "6x6", "9x9"])
@pytest.mark.parametrize("difficulty", ["easy", "medium", "hard"])
def test_generated_puzzles_unique_with_exact_clues(spec, num, difficulty):
    puzzles, solutions = generate(spec, conditional=True, difficulty=difficulty, num=num, seed=1)
    assert puzzles.shape == solutions.shape == (num, spec.n, spec.n)
    assert puzzles.dtype == solutions.dtype == np.int8
    for puzzle, solution in zip(puzzles, solutions, strict=True):
        assert (puzzle != 0).sum() == clues_for(spec, difficulty)
        assert is_valid_grid(solution, spec)
        assert ((puzzle == 0) | (puzzle == solution)).all()
        assert count_solutions(puzzle, spec, limit=2) == 1
    assert len({p.tobytes() for p in puzzles}) == num


def test_make_puzzle_gives_up_below_minimum():
    # No 4×4 puzzle with a unique solution has fewer than 4 clues, so 1 clue can never be reached.
    rng = np.random.default_rng(0)
    assert make_puzzle(GRID4, SPEC4, 1, rng) is None
    assert (make_puzzle(GRID4, SPEC4, 16, rng) == GRID4).all()


def test_generate_is_deterministic():
    kwargs = {"conditional": True, "difficulty": "medium", "num": 30}
    a = generate(SPEC6, seed=5, **kwargs)
    b = generate(SPEC6, seed=5, **kwargs)
    c = generate(SPEC6, seed=6, **kwargs)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert not (a[0] == c[0]).all()


def test_generate_is_deterministic_across_workers():
    kwargs = {"conditional": True, "difficulty": "hard", "num": 40, "seed": 3}
    one = generate(SPEC6, workers=1, **kwargs)
    two = generate(SPEC6, workers=2, **kwargs)
    assert all((x == y).all() for x, y in zip(one, two, strict=True))


def test_generate_dedups_and_excludes():
    puzzles, solutions = generate(SPEC4, conditional=False, difficulty=None, num=200, seed=0)
    assert (puzzles == 0).all()
    train = {s.tobytes() for s in solutions}
    assert len(train) == 200
    _, val = generate(SPEC4, conditional=False, difficulty=None, num=88, seed=1, exclude=train)
    assert len({s.tobytes() for s in val} | train) == 288  # all 4×4 grids, each once

    train_p, _ = generate(SPEC4, conditional=True, difficulty="hard", num=300, seed=0)
    train_keys = {p.tobytes() for p in train_p}
    assert len(train_keys) == 300
    val_p, _ = generate(SPEC4, conditional=True, difficulty="hard", num=300, seed=0, exclude=train_keys)
    assert not train_keys & {p.tobytes() for p in val_p}


def test_generate_argument_errors():
    with pytest.raises(ValueError, match="difficulty"):
        generate(SPEC4, conditional=True, difficulty=None, num=1, seed=0)
    with pytest.raises(ValueError, match="difficulty=None"):
        generate(SPEC4, conditional=False, difficulty="easy", num=1, seed=0)


def test_grid_cap_for_4x4(monkeypatch):
    monkeypatch.setattr(G, "_item", None)  # the check must come before any compute
    with pytest.raises(ValueError, match="only 288 distinct grids"):
        generate(SPEC4, conditional=False, difficulty=None, num=289, seed=0)
    with pytest.raises(ValueError, match="only 288 distinct grids"):
        generate(
            SPEC4,
            conditional=False,
            difficulty=None,
            num=200,
            seed=0,
            exclude={bytes([i]) for i in range(89)},
        )


def test_generate_gives_up_on_exhausted_unknown_shapes(monkeypatch):
    monkeypatch.setattr(G, "MAX_CONSECUTIVE_DUPLICATES", 50)
    # 1×2 boxes: only two 2×2 grids exist, a count the generator is not told.
    with pytest.raises(ValueError, match="duplicate draws in a row"):
        generate(SudokuSpec(1, 2), conditional=False, difficulty=None, num=3, seed=0)


# ------------------------------------------------------------------------------------------------------------
# Metrics


@pytest.mark.parametrize(("grid", "spec"), [(GRID4, SPEC4), (GRID9, SPEC9)], ids=["4x4", "9x9"])
def test_valid_grids_agree_with_hand_made_cases(grid, spec):
    variants = _invalid_variants(grid, spec)
    batch = torch.from_numpy(np.stack([grid, *variants.values()]))
    result = valid_grids(batch, spec)
    assert result.tolist() == [True] + [False] * len(variants)
    for name, bad in variants.items():
        assert not is_valid_grid(bad, spec), name
    # The batched check matches the per-grid numpy one on random digit swaps of a valid grid.
    rng = np.random.default_rng(0)
    grids = []
    for _ in range(64):
        g = grid.copy()
        if rng.random() < 0.5:
            a, b = tuple(rng.integers(0, spec.n, 2)), tuple(rng.integers(0, spec.n, 2))
            g = _swap(g, a, b)
        grids.append(g)
    expected = [is_valid_grid(g, spec) for g in grids]
    assert valid_grids(torch.from_numpy(np.stack(grids)).int(), spec).tolist() == expected


def test_respects_clues_and_keys():
    puzzle = GRID4.copy()
    puzzle[::2] = 0
    wrong = _swap(GRID4, (1, 0), (1, 1))
    result = respects_clues(torch.from_numpy(np.stack([puzzle, puzzle])), torch.from_numpy(np.stack([GRID4, wrong])))
    assert result.tolist() == [True, False]

    _, grids = generate(SPEC4, conditional=False, difficulty=None, num=288, seed=0)
    keys = grid_keys(torch.from_numpy(grids).long())
    assert keys == [g.tobytes() for g in grids] and len(set(keys)) == 288
    hashes = grid_hashes(torch.from_numpy(grids))
    assert hashes.dtype == torch.long and hashes.unique().numel() == 288
    assert torch.equal(hashes, grid_hashes(torch.from_numpy(grids).long()))


# ------------------------------------------------------------------------------------------------------------
# Layout and rendering


def test_conditional_layout_9x9_round_trip():
    layout = SudokuLayout(SPEC9, conditional=True)
    assert (layout.vocab_size, layout.seq_len, layout.prompt_len) == (12, 180, 91)
    puzzles, solutions = generate(SPEC9, conditional=True, difficulty="easy", num=2, seed=0)
    tokens, prompt = layout.encode(puzzles, solutions)
    assert tokens.shape == prompt.shape == (2, 180) and tokens.dtype == torch.long and prompt.dtype == torch.bool
    assert prompt[:, :91].all() and not prompt[:, 91:].any()
    bos, sep = layout.bos_id, layout.sep_id
    assert (bos, sep) == (11, 10)
    assert (tokens[:, [0, 90]] == bos).all() and (tokens[:, 10] == sep).all() and (tokens[:, 100] == sep).all()
    assert (tokens[0, 1:10] == torch.from_numpy(puzzles[0, 0]).long()).all()
    assert (tokens[0, 91:100] == torch.from_numpy(solutions[0, 0]).long()).all()
    dec_p, dec_s = layout.decode(tokens)
    assert torch.equal(dec_p, torch.from_numpy(puzzles).long())
    assert torch.equal(dec_s, torch.from_numpy(solutions).long())
    # Non-digit tokens in cell positions (separator, BOS, a model's [MASK] = vocab_size) decode to empty.
    noisy = tokens.clone()
    noisy[0, 91], noisy[0, 92], noisy[0, 93] = sep, bos, layout.vocab_size
    _, dec_s = layout.decode(noisy)
    assert dec_s[0, 0, :3].tolist() == [0, 0, 0] and dec_s[0, 0, 3] == solutions[0, 0, 3]


def test_unconditional_layout_round_trip():
    layout = SudokuLayout(SPEC9, conditional=False)
    assert (layout.vocab_size, layout.seq_len, layout.prompt_len) == (9, 81, 0)
    grids = np.stack([GRID9, GRID9.T])
    tokens, prompt = layout.encode(np.zeros_like(grids), grids)
    assert tokens.shape == (2, 81) and tokens.min() == 0 and tokens.max() == 8 and not prompt.any()
    puzzles, solutions = layout.decode(tokens)
    assert (puzzles == 0).all() and torch.equal(solutions, torch.from_numpy(grids).long())
    tokens[0, 0] = 9  # a [MASK] id left by a sampler
    assert layout.decode(tokens)[1][0, 0, 0] == 0
    with pytest.raises(ValueError, match="digits"):
        layout.encode(np.zeros_like(grids), np.zeros_like(grids))


def test_render_and_string():
    text = render(GRID9, SPEC9)
    assert text.splitlines()[0] == "5 3 4 | 6 7 8 | 9 1 2" and text.count("-+-") == 2 * 2
    assert render(np.zeros((6, 6), dtype=np.int8)).splitlines()[0] == ". . . | . . ."  # 2×3 boxes inferred
    assert grid_to_string(GRID4) == "1234341221434321"


# ------------------------------------------------------------------------------------------------------------
# Puzzle files


def _pairs(spec: SudokuSpec, num: int = 3) -> list[tuple[str, str]]:
    puzzles, solutions = generate(spec, conditional=True, difficulty="medium", num=num, seed=0)
    return [(grid_to_string(p), grid_to_string(s)) for p, s in zip(puzzles, solutions, strict=True)]


def _write_csv(path, rows, header="puzzle,solution"):
    path.write_text("\n".join([header] + [",".join(r) for r in rows]) + "\n")
    return path


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("spec", [SPEC4, SPEC9], ids=["4x4", "9x9"])
def test_read_puzzle_file_good(tmp_path, spec):
    pairs = _pairs(spec)
    dotted = [(p.replace("0", "."), s) for p, s in pairs]
    expected_p, expected_s = read_puzzle_file(_write_csv(tmp_path / "a.csv", pairs), spec)
    assert expected_p.shape == (3, spec.n, spec.n) and expected_p.dtype == np.int8
    for name in ("b.jsonl", "c.json-lines"):
        recs = [{"puzzle": p, "solution": s, "id": i} for i, (p, s) in enumerate(dotted)]
        got_p, got_s = read_puzzle_file(_write_jsonl(tmp_path / name, recs), spec)
        assert (got_p == expected_p).all() and (got_s == expected_s).all()
    assert [grid_to_string(p) for p in expected_p] == [p for p, _ in pairs]


def test_read_puzzle_file_letters_for_16x16(tmp_path):
    spec = SudokuSpec(4, 4)
    grid = random_full_grid(spec, np.random.default_rng(0))
    text = grid_to_string(grid)
    assert "G" in text
    _, solutions = read_puzzle_file(
        _write_jsonl(tmp_path / "x.jsonl", [{"puzzle": text.lower(), "solution": text}]), spec
    )
    assert (solutions[0] == grid).all()


def test_read_puzzle_file_errors(tmp_path):
    (p, s), (p2, s2) = _pairs(SPEC9, 2)
    bad_solution = s[1] + s[0] + s[2:]
    clue_index = next(i for i, ch in enumerate(p) if ch != "0")
    wrong_digit = str(int(p[clue_index]) % 9 + 1)
    bad_clue = p[:clue_index] + wrong_digit + p[clue_index + 1 :]
    cases = {
        "unknown file type": (tmp_path / "x.txt", f"{p},{s}\n"),
        r"lacks column\(s\) \['solution'\]": (tmp_path / "nocol.csv", f"puzzle,answer\n{p},{s}\n"),
        "missing 'solution'": (tmp_path / "nokey.jsonl", json.dumps({"puzzle": p}) + "\n"),
        "line 3: puzzle has 16 cells .*4x4 grid.* needs n² = 81.*box shape": (
            tmp_path / "short.csv",
            f"puzzle,solution\n{p},{s}\n{'0' * 16},{s}\n",
        ),
        "line 2: solution has invalid character 'x' at position 4": (
            tmp_path / "char.csv",
            f"puzzle,solution\n{p},{s[:4]}x{s[5:]}\n",
        ),
        "line 2: solution is not a valid 9x9": (
            tmp_path / "invalid.jsonl",
            "\n" + json.dumps({"puzzle": p, "solution": bad_solution}) + "\n",  # blank line 1 is skipped
        ),
        f"line 3: puzzle clue {wrong_digit} at row .* disagrees": (
            tmp_path / "clue.csv",
            f"puzzle,solution\n{p2},{s2}\n{bad_clue},{s}\n",
        ),
        "file is empty": (tmp_path / "empty.csv", "puzzle,solution\n"),
        "line 1: invalid JSON": (tmp_path / "broken.jsonl", "{not json\n"),
        "must be a string": (tmp_path / "list.jsonl", json.dumps({"puzzle": [1, 2], "solution": s}) + "\n"),
    }
    for pattern, (path, text) in cases.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=pattern) as info:
            read_puzzle_file(path, SPEC9)
        assert str(path) in str(info.value), pattern
    (tmp_path / "blank.jsonl").write_text("")
    with pytest.raises(ValueError, match="empty"):
        read_puzzle_file(tmp_path / "blank.jsonl", SPEC9)
    with pytest.raises(FileNotFoundError, match="nope.csv"):
        read_puzzle_file(tmp_path / "nope.csv", SPEC9)


# ------------------------------------------------------------------------------------------------------------
# Datamodule


def _dm(tmp_path, **kwargs) -> SudokuDataModule:
    args = {
        "box_rows": 2,
        "box_cols": 2,
        "conditional": True,
        "difficulty": "easy",
        "num_train": 64,
        "num_val": 20,
        "batch_size": 16,
        "cache_dir": tmp_path / "cache",
    }
    return SudokuDataModule(**(args | kwargs))


def test_datamodule_batches_and_cache(tmp_path, monkeypatch):
    dm = _dm(tmp_path)
    assert (dm.vocab_size, dm.seq_len, dm.prompt_len) == (7, 40, 21)
    dm.prepare_data()
    dm.setup("fit")
    assert dm.cache_path.is_file() and dm.cache_path.name.startswith("sudoku4x4_b2x2_easy_64+20_seed0_")
    batch = next(iter(dm.train_dataloader()))
    assert set(batch) == {"tokens", "prompt_mask"}
    assert batch["tokens"].shape == (16, 40) and batch["tokens"].dtype == torch.long
    assert batch["prompt_mask"].dtype == torch.bool and batch["prompt_mask"][:, :21].all()
    assert len(dm.train_dataloader()) == 4
    assert [b["tokens"].shape[0] for b in dm.val_dataloader()] == [16, 4]
    puzzles, solutions = dm.layout.decode(batch["tokens"])
    assert valid_grids(solutions, dm.spec).all() and respects_clues(puzzles, solutions).all()
    assert ((puzzles != 0).flatten(1).sum(1) == 8).all()
    # Keys are of solution grids, which repeat across 4×4 puzzles (there are only 288 grids).
    assert len(dm.train_keys) == len({s.tobytes() for s in dm._data["train_solutions"]})
    assert set(grid_keys(solutions)) <= dm.train_keys
    assert dm.train_hashes.shape == (64,)
    # val is disjoint from train
    val_puzzles = {p.tobytes() for p in dm._data["val_puzzles"]}
    assert not val_puzzles & {p.tobytes() for p in dm._data["train_puzzles"]}
    info = dm.describe()
    assert info["clues"] == 8 and info["seq_len"] == 40 and info["cache_file"] == str(dm.cache_path)

    def fail(*args, **kwargs):
        raise AssertionError("generate called despite a cached file")

    monkeypatch.setattr(dm_module, "generate", fail)
    again = _dm(tmp_path)
    again.prepare_data()
    again.setup("fit")
    assert torch.equal(again.train_set.tokens, dm.train_set.tokens)
    assert not list(dm.cache_path.parent.glob("*.tmp*"))
    # A different seed is a different cache file, so it would generate.
    with pytest.raises(AssertionError, match="cached"):
        _dm(tmp_path, seed=1).prepare_data()


def test_datamodule_unconditional(tmp_path):
    dm = _dm(tmp_path, conditional=False, difficulty=None, num_train=100, num_val=50)
    dm.prepare_data()
    dm.setup()
    batch = next(iter(dm.val_dataloader()))
    assert batch["tokens"].shape == (16, 16) and not batch["prompt_mask"].any()
    assert dm.vocab_size == 4 and dm.prompt_len == 0
    val_keys = {s.tobytes() for s in dm._data["val_solutions"]}
    assert len(val_keys) == 50 and not val_keys & dm.train_keys
    with pytest.warns(UserWarning, match="ignored"):
        _dm(tmp_path, conditional=False, difficulty="hard")


def test_datamodule_per_device_batch(tmp_path):
    import lightning as L

    dm = _dm(tmp_path, batch_size=256)
    assert dm.per_device_batch_size == 256
    dm.trainer = SimpleNamespace(world_size=4, accumulate_grad_batches=2)
    assert dm.per_device_batch_size == 32 and dm.per_device_val_batch_size == 64
    dm.trainer = SimpleNamespace(world_size=3, accumulate_grad_batches=1)
    with pytest.raises(ValueError, match="not divisible by world_size 3"):
        _ = dm.per_device_batch_size
    dm.trainer = L.Trainer(
        accelerator="cpu", devices=1, accumulate_grad_batches=4, logger=False, enable_progress_bar=False
    )
    assert dm.per_device_batch_size == 64


def test_datamodule_argument_errors(tmp_path, monkeypatch):
    monkeypatch.setattr(dm_module, "generate", None)  # every error must come before generation
    with pytest.raises(ValueError, match="difficulty"):
        _dm(tmp_path, difficulty=None)
    with pytest.raises(ValueError, match="difficulty"):
        _dm(tmp_path, difficulty="extreme")
    with pytest.raises(ValueError, match="only 288 exist"):
        _dm(tmp_path, conditional=False, difficulty=None, num_train=280, num_val=20)
    with pytest.raises(ValueError, match="only applies to conditional"):
        _dm(tmp_path, conditional=False, difficulty=None, eval_file=tmp_path / "x.csv")
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        _dm(tmp_path, eval_file=tmp_path / "missing.csv")
    bad = _write_csv(tmp_path / "bad.csv", [("0" * 81, "1" * 81)])
    with pytest.raises(ValueError, match="needs n² = 16"):
        _dm(tmp_path, eval_file=bad)
    with pytest.raises(ValueError, match="num_train"):
        _dm(tmp_path, num_train=0)
    with pytest.raises(ValueError, match="box"):
        _dm(tmp_path, box_rows=5, box_cols=5)


def test_datamodule_eval_file_replaces_val(tmp_path):
    pairs = _pairs(SPEC4, 5)
    path = _write_csv(tmp_path / "eval.csv", pairs)
    dm = _dm(tmp_path, eval_file=path, val_batch_size=4)
    dm.prepare_data()
    dm.setup("validate")
    assert len(dm.val_set) == 5 and dm.describe()["num_val"] == 5
    batches = list(dm.val_dataloader())
    assert [b["tokens"].shape[0] for b in batches] == [4, 1]
    puzzles, _ = dm.layout.decode(batches[0]["tokens"])
    assert [grid_to_string(p.numpy()) for p in puzzles] == [p for p, _ in pairs[:4]]
