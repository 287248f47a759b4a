"""Activation checkpointing (lightning_modules/sharding.py ``checkpoint_activations``): the same loss and gradients
with and without it, on MLFM over a tiny SMDM-layout Llama (adaLN hooks + LoRA with dropout) and on an MDM DiT."""

import copy
from pathlib import Path

import pytest
import torch

from lightning_modules.mdm import MDMModule
from lightning_modules.mlfm import MLFMModule
from lightning_modules.sharding import checkpoint_activations
from tests.process_helpers import gloo_rank, rank_outputs, sharded_step_error

TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32 on CPU: the recomputed forward runs the same kernels, so ~bit-equal


def tiny_mlfm() -> MLFMModule:
    """MLFM on a 2-layer random Llama in SMDM's layout ([MASK] = the extra embedding row 8), adapter made non-zero."""
    torch.manual_seed(0)
    backbone = {
        "_target_": "flowlm.backbones.llama.BidirectionalLM",
        "arch": "llama",
        "embed_rows": 9,
        "head_rows": 8,
        "mask_id": 8,
        "hidden_size": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "intermediate_size": 64,
    }
    adapter = {"cond_dim": 32, "lora_rank": 4, "lora_alpha": 8.0, "lora_dropout": 0.1}
    module = MLFMModule(
        data_vocab_size=8, seq_len=10, backbone=backbone, optim={}, init_from="(not read)", adapter=adapter
    )
    with torch.no_grad():  # zero-init adaLN and LoRA B would hide a recompute without the modulation
        for name, p in module.net.named_parameters():
            if "layer_mods" in name or "lora_B" in name:
                p.normal_(0, 0.05)
    return module.train()


def loss_and_grads(module, loss_fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss and every trainable parameter's gradient, from one fixed draw (global RNG too: dropout)."""
    module.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = loss_fn(module)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}


def mlfm_loss(module: MLFMModule) -> torch.Tensor:
    """MLFM's training loss on a fixed batch (half prompt)."""
    tokens = torch.randint(0, 8, (3, 10), generator=torch.Generator().manual_seed(3))
    prompt = torch.zeros_like(tokens, dtype=torch.bool)
    prompt[:, :4] = True
    gens = torch.Generator().manual_seed(4), torch.Generator().manual_seed(5)
    batch = {"tokens": tokens, "prompt_mask": prompt}
    return module.loss(batch, module.draws_at(batch, *gens)).loss


def test_mlfm_on_llama_same_loss_and_gradients_with_checkpointing():
    plain, ckpt = tiny_mlfm(), tiny_mlfm()  # two builds, not a deepcopy: the adapter's hooks are bound to it
    assert checkpoint_activations(ckpt) == 2 and checkpoint_activations(ckpt) == 0  # both layers; idempotent
    assert list(ckpt.state_dict()) == list(plain.state_dict())  # names (hence checkpoints) unchanged
    want_loss, want = loss_and_grads(plain, mlfm_loss)
    got_loss, got = loss_and_grads(ckpt, mlfm_loss)
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    assert got.keys() == want.keys() and any("lora_A" in n for n in got) and any("layer_mods" in n for n in got)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)


def test_checkpointing_recomputes_and_the_config_key_applies_it():
    """The layers really are recomputed in backward (one more forward each), and ``activation_checkpointing: true``
    in the run config is what ``configure_model`` reads."""
    module = tiny_mlfm()
    module.run_config = {"activation_checkpointing": True}
    module.configure_model()
    layers = list(module.net.base.layers)
    assert all(getattr(layer, "_flowlm_checkpointed", False) for layer in layers)
    calls = []
    for layer in layers:  # the layer's first op (a recompute stops once it has what backward needs)
        layer.input_layernorm.register_forward_hook(lambda *_: calls.append(1))
    mlfm_loss(module).backward()
    assert len(calls) == 2 * len(layers)  # forward + recompute


def test_mdm_dit_same_loss_and_gradients_with_checkpointing():
    torch.manual_seed(0)
    plain = MDMModule(data_vocab_size=8, seq_len=10, backbone={"size": "tiny"}, optim={}).train()
    ckpt = copy.deepcopy(plain)
    assert checkpoint_activations(ckpt) > 0

    def loss(module):
        tokens = torch.randint(0, 8, (3, 10), generator=torch.Generator().manual_seed(3))
        return module.training_step({"tokens": tokens, "prompt_mask": torch.zeros_like(tokens, dtype=torch.bool)}, 0)

    want_loss, want = loss_and_grads(plain, loss)
    got_loss, got = loss_and_grads(ckpt, loss)
    torch.testing.assert_close(got_loss, want_loss, **TOL)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)


def test_nothing_to_checkpoint_is_refused():
    with pytest.raises(ValueError, match="nothing to checkpoint"):
        checkpoint_activations(torch.nn.Linear(2, 2))


def _fsdp_ac_worker(rank: int, init_file: str, out_dir: str) -> None:
    """Rank r of 2: activation checkpointing, then FSDP2 over the decoder layers and the adapter, its half of the
    batch, one SGD step; compared with the plain unsharded model on the whole batch."""

    def checkpointed(holder: torch.nn.Module) -> None:
        assert checkpoint_activations(holder) == 2  # before sharding, as configure_model does

    with gloo_rank(rank, init_file):
        diff, _ = sharded_step_error(rank, prepare=checkpointed)
        (Path(out_dir) / f"rank{rank}").write_text(f"{diff:.3e}")


@pytest.mark.slow
def test_checkpointing_under_fsdp2_on_two_cpu_processes_trains_like_one_plain_process(tmp_path):
    # a hang fails the test instead of blocking it
    for rank, out in enumerate(rank_outputs(_fsdp_ac_worker, tmp_path, timeout_s=180, what="FSDP2 ranks")):
        diff = float(out)
        assert diff < 1e-5, (rank, diff)
