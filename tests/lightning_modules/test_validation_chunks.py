"""Validation in micro batches: every family's val loss at ``micro_batch_size`` equals the one-forward loss, and no
forward sees more rows than the micro batch (``FlowLMModule.validation_loss``)."""

from __future__ import annotations

import pytest
import torch

from flowlm.backbones.dit import DiTBlock
from lightning_modules.ar import ARModule
from lightning_modules.base import rows_of
from lightning_modules.fmlm_plus import FMLMPlusModule
from lightning_modules.mdm import MDMModule
from lightning_modules.mlfm import MLFMModule

pytestmark = pytest.mark.filterwarnings(r"ignore:You are trying to `self.log\(\)`")

V, L, ROWS = 7, 12, 10
BB = {"size": "tiny", "n_layers": 2, "d_model": 32, "n_heads": 2, "cond_dim": 16}
# Float tolerance of the chunked mean against the one-forward one: the same terms, summed in another order and
# scaled by the chunk's count and back (float32; the forwards of a row are the same at any batch size on the CPU).
RTOL, ATOL = 1e-5, 1e-7


def _random(module):
    """Every weight random (zero-initialised modulations and heads included), so nothing is trivial."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(std=0.3)
    return module.eval()


def _mlfm():
    module = MLFMModule(
        data_vocab_size=V, seq_len=L, backbone=BB, optim={}, init_from="mdm.ckpt", adapter={"lora_rank": 4}
    )
    return _random(module)


FAMILIES = {
    "mdm": lambda: _random(MDMModule(data_vocab_size=V, seq_len=L, backbone=BB, optim={})),
    "fmlm_plus": lambda: _random(FMLMPlusModule(data_vocab_size=V, seq_len=L, backbone=BB, optim={})),
    "fmlm_plus_fused": lambda: _random(
        FMLMPlusModule(data_vocab_size=V, seq_len=L, backbone=BB, optim={}, fused_loss=True)
    ),
    "ar": lambda: _random(ARModule(data_vocab_size=V, seq_len=L, backbone=BB, optim={})),
    "mlfm": _mlfm,
}


def _batch(pad: bool) -> dict:
    """ROWS sequences with prompts of uneven length (a row all prompt: nothing scored there) and, with ``pad``, text
    PAD left out of the loss at uneven lengths, so chunks score different numbers of tokens."""
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (ROWS, L), generator=gen)
    prompt_len = torch.tensor([0, 3, 1, 12, 5, 0, 2, 7, 4, 1])
    prompt = torch.arange(L) < prompt_len[:, None]
    batch = {"tokens": tokens, "prompt_mask": prompt}
    if pad:
        length = torch.tensor([12, 9, 4, 12, 11, 2, 12, 10, 6, 12])
        batch["loss_mask"] = ~prompt & (torch.arange(L) < length[:, None])
    return batch


def _rows_per_forward(module) -> list[int]:
    """The batch sizes every DiT block of ``module`` is called at, appended as it runs."""
    seen: list[int] = []
    for block in module.modules():
        if isinstance(block, DiTBlock):
            block.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[0]))
    assert seen == [] and any(isinstance(m, DiTBlock) for m in module.modules())
    return seen


@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_chunked_validation_loss_equals_one_forward(family, pad):
    """Micro batches of 3 over 10 rows (3, 3, 3, 1; uneven scored counts): the val loss of one forward."""
    module = FAMILIES[family]()
    batch = _batch(pad)
    with torch.no_grad():
        draws = module.draw(batch, 5, stage="val")
        whole = module.validation_loss(batch, draws)
        assert module.loss(batch, draws).loss.item() == whole.item()  # no micro batch: the one forward
        module.run_config = {"micro_batch_size": 3}
        chunked = module.validation_loss(batch, draws)
    assert whole.item() > 0
    torch.testing.assert_close(chunked, whole, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("family", ["mdm", "fmlm_plus"])
def test_validation_step_forwards_at_most_the_micro_batch(family):
    """Through ``validation_step`` (what Lightning calls): every forward takes ≤ micro_batch_size rows, and the
    logged loss is the one-forward one."""
    module = FAMILIES[family]()
    batch = _batch(pad=True)
    seen = _rows_per_forward(module)
    with torch.no_grad():
        whole = module.validation_step(batch, 2)
        assert set(seen) == {ROWS}
        seen.clear()
        module.run_config = {"micro_batch_size": 4}
        chunked = module.validation_step(batch, 2)
    assert seen and max(seen) <= 4, seen
    assert sum(seen) == ROWS * sum(isinstance(m, DiTBlock) for m in module.modules())  # every row, once
    torch.testing.assert_close(chunked, whole, rtol=RTOL, atol=ATOL)


def test_a_micro_batch_at_least_the_share_is_one_forward():
    """micro_batch_size ≥ the device's rows (a cap, as in training): one forward, the loss bit for bit."""
    module = FAMILIES["mdm"]()
    batch = _batch(pad=False)
    seen = _rows_per_forward(module)
    with torch.no_grad():
        draws = module.draw(batch, 0, stage="val")
        module.run_config = {"micro_batch_size": ROWS}
        assert module.validation_loss(batch, draws).item() == module.loss(batch, draws).loss.item()
    assert set(seen) == {ROWS}


def test_rows_of_cuts_tensors_and_refuses_what_is_not_per_row():
    values = {"tokens": torch.arange(20).view(5, 4), "name": "x"}
    cut = rows_of(values, slice(1, 3), 5)
    assert torch.equal(cut["tokens"], values["tokens"][1:3]) and cut["name"] == "x"
    with pytest.raises(ValueError, match="'w' of shape \\(3,\\) is not one row per sequence"):
        rows_of({"w": torch.zeros(3)}, slice(0, 2), 5)
