"""conf/eval/sudoku_mdm_cache.yaml, the block KV cache's accuracy-cost evaluation (docs/results.md): under
`flowlm-eval` it builds, each decoder appears with cache none / prefix / dual / dual refreshed every 2 calls and
nothing else differing, its blocks follow `cache_block` / `cache_block_long`, and rows draw from their own
generators (so the caches are compared on the same rows and draws)."""

from __future__ import annotations

import re

from conftest import compose_config

import runners  # noqa: F401  (registers the ${flowlm.*} resolvers the configs use)
from runners.common import build

CACHES = [("none", None), ("prefix", None), ("dual", None), ("dual", 2)]
CACHE_SUFFIX = re.compile(r"_(none|prefix|dual|dual_r2)$")


def built(*overrides: str):
    """What `flowlm-eval eval=sudoku_mdm_cache` builds (at temperature 0: no checkpoint to inherit it from)."""
    base = ["ckpt_path=unused.ckpt", "eval=sudoku_mdm_cache", "a_priori_temperature=0.0"]
    return build(compose_config("eval", [*base, *overrides]).eval)


def test_each_decoder_runs_with_every_cache_and_nothing_else_differs():
    evaluation = built("+cache_block=7", "+cache_block_long=14", "eval.nfe=[12,36]")
    assert evaluation.row_generators
    groups: dict[str, list] = {}
    for name, sampler in evaluation.samplers.items():
        groups.setdefault(CACHE_SUFFIX.sub("", name), []).append(sampler)
    assert sorted(groups) == ["eb", "semi_ar", "semi_ar_long", "threshold"]
    for decoder, samplers in groups.items():
        assert [(s.cache, s.refresh) for s in samplers] == CACHES, decoder
        rest = [{k: v for k, v in vars(s).items() if k not in ("cache", "refresh")} for s in samplers]
        assert all(r == rest[0] for r in rest), decoder
        assert len({type(s) for s in samplers}) == 1, decoder
        assert rest[0]["block_length"] == (14 if decoder == "semi_ar_long" else 7), decoder


def test_blocks_default_to_one_and_two_rows_of_the_unconditional_grid():
    lengths = {name: s.block_length for name, s in built().samplers.items()}
    assert {n: b for n, b in lengths.items() if b != 6} == {n: 12 for n in lengths if n.startswith("semi_ar_long")}
