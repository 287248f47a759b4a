"""MLFM straight on a pretrained LLaMA-family MDM (``backbone.source``, ``init_from: null``): the MLFM paper's setup
(SMDM adapted directly). A tiny SMDM-layout checkpoint is written here in SMDM's own tensor names."""

import pytest
import torch
from safetensors.torch import save_file

from flowlm.pretrained import smdm
from flowlm.pretrained.smdm import load_smdm
from lightning_modules.mlfm import MLFMModule

# vocab 64 (padded to a multiple of 8: 64): [MASK] = 64 = the extra wte row, lm_head predicts the 64 data ids
CFG = {"n_layer": 2, "n_head": 4, "n_embd": 32, "intermediate_size": 48, "n_query_groups": 2, "vocab_size": 64}
CFG |= {"padding_multiple": 8, "block_size": 64}


@pytest.fixture(scope="module")
def smdm_file(tmp_path_factory):
    """Random tensors under every SMDM name and shape the loader expects (norm gains around 1)."""
    gen = torch.Generator().manual_seed(0)
    shapes = smdm.expected_keys(smdm.smdm_config(CFG))
    state = {
        name: (1.0 if "norm" in name or "ln_f" in name else 0.0) + 0.2 * torch.randn(shape, generator=gen)
        for name, shape in shapes.items()
    }
    path = tmp_path_factory.mktemp("smdm") / "mdm-tiny.safetensors"
    save_file(state, str(path))
    return path


def backbone(path) -> dict:
    """The backbone config as conf/backbone/llama/smdm_1028m.yaml gives it, on the tiny file."""
    return {"_target_": "flowlm.pretrained.smdm.load_smdm", "source": str(path), "config": CFG}


def test_mlfm_on_the_pretrained_smdm_at_init_is_the_mdm(smdm_file):
    module = MLFMModule(data_vocab_size=64, seq_len=12, backbone=backbone(smdm_file), optim={}, init_from=None)
    module.validate_inputs()  # nothing else to read: the backbone is the MDM
    module.eval()
    mdm = load_smdm(smdm_file, config=CFG).eval()
    assert module.mask_id == mdm.mask_id == 64  # [MASK] stays the backbone's (the extra embedding row)
    x = torch.randint(0, 65, (3, 12), generator=torch.Generator().manual_seed(1))
    x[0, 2] = x[2, -1] = 64
    with torch.no_grad():
        z = module.net.embeddings[x]  # the bridge at t → 0: masked positions hold m = E[MASK]
        want = mdm.token_logits(x)[..., :64]
        for t in (0.05, 0.5, 0.95):  # zero-init adaLN + LoRA B = 0: every bridge time gives the MDM's logits
            torch.testing.assert_close(module.denoiser().fn(z, torch.full((3,), t)), want, rtol=0, atol=1e-5)
    assert torch.equal(module.denoiser().mask_embedding, mdm.model.embed_tokens.weight[64])
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or "layer_mods" in n or "emb_s" in n for n in trainable)


def test_another_vocabulary_is_refused_and_a_dit_still_needs_init_from(smdm_file):
    with pytest.raises(ValueError, match="vocabulary of 65 tokens but backbone .* predicts 64"):
        MLFMModule(data_vocab_size=65, seq_len=12, backbone=backbone(smdm_file), optim={})  # [PAD] added: 64 + 1
    with pytest.raises(ValueError, match="set method.init_from"):
        MLFMModule(data_vocab_size=8, seq_len=12, backbone={"size": "tiny"}, optim={}, init_from=None)


def test_a_random_backbone_without_init_from_warns_that_it_adapts_a_random_mdm():
    random_llama = {"_target_": "flowlm.backbones.llama.BidirectionalLM", "embed_rows": 9, "head_rows": 8}
    random_llama |= {"mask_id": 8, "hidden_size": 16, "n_layers": 1, "n_heads": 2, "intermediate_size": 32}
    with pytest.warns(UserWarning, match="a random MDM"):
        MLFMModule(data_vocab_size=8, seq_len=6, backbone=random_llama, optim={}, adapter={"cond_dim": 16})


def test_the_shipped_tiny_smdm_file_is_current():
    """data/cpu/tiny_smdm/mdm-tiny.safetensors (scale=cpu of gsm8k_mlfm_smdm) is what make.py writes."""
    from fixtures.tiny_smdm.make import PATH, build
    from safetensors.torch import load_file

    shipped, fresh = load_file(str(PATH)), build()
    assert shipped.keys() == fresh.keys(), "stale data/cpu/tiny_smdm: run its make.py"
    assert all(torch.equal(shipped[k], fresh[k]) for k in fresh), "stale data/cpu/tiny_smdm: run its make.py"
