"""The sampling-only grids over the adaptive MDM decoders' knobs (conf/hparams_search/threshold_grid.yaml: τ,
eb_grid.yaml: γ): composed for flowlm-eval on a checkpoint, one sampler each, every grid value one the sampler
accepts, the budget a cap that cannot bind on the tables' 6×6 boards, one sweep folder per checkpoint."""

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.utils import instantiate
from omegaconf import OmegaConf

from flowlm.project import CONF_DIR
from flowlm.samplers import EBSampler, ThresholdSampler
from runners.common import build  # noqa: F401 (registers data=from_checkpoint, which conf/eval.yaml names)

GRIDS = [
    ("threshold_grid", "threshold", "threshold", ThresholdSampler, [0.5, 0.7, 0.8, 0.9, 0.95, 0.99]),
    ("eb_grid", "eb", "gamma", EBSampler, [0.0, 0.01, 0.03, 0.1, 0.3, 1.0]),
]


def _compose(search: str, ckpt: str):
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return compose("eval", overrides=[f"hparams_search={search}", f"ckpt_path={ckpt}"], return_hydra_config=True)


@pytest.mark.parametrize(("search", "sampler", "knob", "cls", "values"), GRIDS)
def test_a_grid_sweeps_one_knob_of_one_decoder_over_a_checkpoint(search, sampler, knob, cls, values, runs_env):
    cfg = _compose(search, "runs/mdm/last.ckpt")
    cfg.a_priori_temperature = 0.0  # what flowlm-eval takes from a conditional checkpoint (inherit_temperature)
    assert cfg.hydra.sweeper._target_.endswith("BasicSweeper")  # a grid: every value is one trial
    assert list(cfg.eval.samplers) == [sampler]  # trials differ in the knob alone, no other sampler rerun each time
    (key, spec), *others = cfg.hydra.sweeper.params.items()
    assert key == f"eval.samplers.{sampler}.{knob}" and not others
    (override,) = OverridesParser.create().parse_overrides([f"{key}={spec}"])
    swept = [float(v) for v in override.sweep_iterator()]
    assert swept == values
    for value in swept:  # each trial's sampler builds, so no trial fails on its value
        node = OmegaConf.to_container(cfg.eval.samplers[sampler], resolve=True) | {knob: value}
        built = instantiate(node)
        assert isinstance(built, cls) and getattr(built, knob) == value
    cells = 2 * (36 + 6) - (36 + 6 + 1)  # 6×6 conditional: positions generated per row (the solution half)
    assert list(cfg.eval.nfe) == [64] and cells < 64  # a cap that never binds: a call commits ≥ 1 position
    other = _compose(search, "runs/other/last.ckpt")
    assert cfg.sweep.name.startswith(f"{search}-") and other.sweep.name != cfg.sweep.name  # one sweep per checkpoint
    assert cfg.hydra.sweep.dir.endswith(cfg.sweep.name)
