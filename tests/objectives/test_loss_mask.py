"""`batch["loss_mask"]` (text data with `loss_on_pad=false`) restricts every method's loss to those positions."""

from __future__ import annotations

import pytest
import torch

from lightning_modules.ar import ARModule
from lightning_modules.fmlm_plus import FMLMPlusModule
from lightning_modules.mdm import MDMModule
from lightning_modules.mlfm import MLFMModule

V, L, BB = 6, 10, {"size": "tiny", "n_layers": 2, "d_model": 32, "n_heads": 2, "cond_dim": 16}


def losses(module, batch):
    torch.manual_seed(0)
    if isinstance(module, MDMModule):
        return module.loss(batch, module.draws_at(batch, torch.full((4,), 0.7), torch.Generator().manual_seed(1))).loss
    if isinstance(module, FMLMPlusModule):
        kinds = torch.zeros(4, dtype=torch.long)  # diagonal
        return module.loss(
            batch,
            module.draws_at(
                batch, kinds, torch.full((4,), 0.3), torch.full((4,), 0.3), torch.Generator().manual_seed(1)
            ),
        ).loss
    if isinstance(module, MLFMModule):
        return module.loss(
            batch, module.draws_at(batch, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2))
        ).loss
    return module.loss(batch, {}).loss


def build(kind):
    kw = {"data_vocab_size": V, "seq_len": L, "backbone": BB, "optim": {}}
    if kind == "mlfm":
        return MLFMModule(**kw, init_from="unused.ckpt")
    return {"mdm": MDMModule, "flow": FMLMPlusModule, "ar": ARModule}[kind](**kw)


@pytest.mark.parametrize("kind", ["mdm", "flow", "mlfm", "ar"])
def test_loss_mask_restricts_the_loss(kind):
    module = build(kind)
    for p in module.parameters():
        torch.nn.init.normal_(p, std=0.2)
    tokens = torch.randint(0, V, (4, L), generator=torch.Generator().manual_seed(3))
    prompt = torch.zeros(4, L, dtype=torch.bool)
    prompt[:, :2] = True
    batch = {"tokens": tokens, "prompt_mask": prompt}
    default = losses(module, batch)
    assert default > 0
    torch.testing.assert_close(losses(module, {**batch, "loss_mask": ~prompt}), default)  # the default mask
    assert losses(module, {**batch, "loss_mask": torch.zeros_like(prompt)}) == 0  # nothing scored
    half = ~prompt & (torch.arange(L) < 6)
    assert not torch.allclose(losses(module, {**batch, "loss_mask": half}), default)
