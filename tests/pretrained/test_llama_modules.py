"""MDM and MLFM on the LLaMA-family backbone (flowlm/backbones/llama.py) through the method modules and entry points.

`flowlm-train method=mdm backbone=llama/tiny` on a tiny Sudoku task, `flowlm-eval` of its checkpoint with the
confidence and semi_ar samplers, MLFM `init_from` it (adapted model at init = the MDM's logits), and the refusals
(another vocabulary, another backbone, a method the backbone cannot serve) before any compute.
"""

from pathlib import Path

import pytest
import torch
from conftest import FAST, compose_config, isolate_runs

from flowlm.backbones.llama import BidirectionalLM
from lightning_modules.checkpoints import load_module, read_checkpoint
from lightning_modules.mdm import MDMModule
from runners.common import build
from runners.evaluate import evaluate
from runners.train import train

# The 6×6 Sudoku data have 9 token ids: a tiny random Llama in SMDM's layout ([MASK] = the extra embedding row 9,
# the head predicts the 9 data ids).
LLAMA = ["backbone=llama/tiny", "backbone.embed_rows=10", "backbone.head_rows=9", "backbone.mask_id=9"]
MDM = ["experiment=sudoku_mdm_easy", "scale=cpu", *FAST, *LLAMA, "logger=none"]
TARGET = "flowlm.backbones.llama.BidirectionalLM"


def tiny_llama(**layout) -> dict:
    """A 1-layer random bidirectional Llama config (``_target_``) with the given vocabulary layout."""
    return {
        "_target_": TARGET,
        "hidden_size": 32,
        "n_layers": 1,
        "n_heads": 4,
        "n_kv_heads": 2,
        "intermediate_size": 64,
        **layout,
    }


@pytest.fixture(scope="module")
def mdm_run(tmp_path_factory):
    """MDM on llama/tiny, trained 2 steps through flowlm-train (with its final evaluation and checkpoint)."""
    root = tmp_path_factory.mktemp("llama_runs")
    mp = pytest.MonkeyPatch()
    isolate_runs(mp, root)
    result = train(compose_config(overrides=MDM))
    yield result, Path(result["run_dir"], "checkpoints", "last.ckpt")
    mp.undo()


def test_mdm_on_llama_trains_and_records_the_built_backbone(mdm_run):
    result, ckpt = mdm_run
    assert {r["sampler"] for r in result["rows"]} == {"ancestral", "confidence"}
    saved = read_checkpoint(ckpt)
    spec = saved["hyper_parameters"]["backbone"]
    # the built network's spec (no DiT options), rebuilt on the meta device at reload
    assert spec == {
        "_target_": TARGET,
        "arch": "llama",
        "embed_rows": 10,
        "head_rows": 9,
        "hidden_size": 32,
        "n_layers": 2,
        "n_heads": 4,
        "n_kv_heads": 2,
        "intermediate_size": 64,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-5,
        "max_positions": 1024,
        "mask_id": 9,
        "shift_logits": False,
        "device": "meta",
    }
    assert saved["state_dict"]["net.model.embed_tokens.weight"].shape == (10, 32)
    assert saved["state_dict"]["net.lm_head.weight"].shape == (9, 32)


def test_reloaded_checkpoint_computes_the_saved_network(mdm_run):
    _, ckpt = mdm_run
    module = load_module(ckpt).eval()
    assert isinstance(module.net, BidirectionalLM) and module.mask_id == 9
    assert not any(t.is_meta for t in [*module.parameters(), *module.buffers()])
    # an independent rebuild: BidirectionalLM.from_state on the checkpoint's tensors
    saved = read_checkpoint(ckpt)
    spec = {k: v for k, v in saved["hyper_parameters"]["backbone"].items() if k not in ("_target_", "device")}
    state = {k[len("net.") :]: v for k, v in saved["state_dict"].items() if k.startswith("net.")}
    reference = BidirectionalLM.from_state(spec, state)
    x = torch.randint(0, 10, (2, 36), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(module(x, torch.rand(2)), reference(x), rtol=0, atol=0)


def test_flowlm_eval_runs_confidence_and_semi_ar_on_the_checkpoint(mdm_run):
    _, ckpt = mdm_run
    over = [
        f"ckpt_path={ckpt}",
        "eval.nfe=[6]",
        "eval.max_batches=1",
        "logger=none",
        "+sampler@eval.samplers.semi_ar=semi_ar",
        "eval.samplers.semi_ar.block_length=12",
    ]
    rows = evaluate(compose_config("eval", overrides=over))["rows"]
    assert {r["sampler"] for r in rows} == {"ancestral", "confidence", "semi_ar"}
    for row in rows:
        assert 1 <= row["nfe"] <= row["nfe_budget"] == 6 and 0 <= row["accuracy"] <= 100


@pytest.mark.parametrize(
    ("layout", "mask_id"),
    [
        ({"embed_rows": 9, "head_rows": 8, "mask_id": 8}, 8),  # SMDM: [MASK] the extra embedding row
        ({"embed_rows": 8, "head_rows": 8, "mask_id": 5}, 5),  # LLaDA/Dream: [MASK] inside the vocabulary
    ],
)
def test_mdm_takes_mask_id_and_head_from_the_backbone(layout, mask_id):
    torch.manual_seed(0)
    module = MDMModule(data_vocab_size=8, seq_len=12, backbone=tiny_llama(arch="llama", **layout), optim={})
    assert module.mask_id == module.process.mask_id == mask_id
    tokens = torch.tensor([[0, 1, 2, 3, 4, 6, 7, 0, 1, 2, 3, 4]] * 3)  # no 5: LLaDA's [MASK] id is never data
    batch = {"tokens": tokens, "prompt_mask": torch.zeros_like(tokens, dtype=torch.bool)}
    t = torch.tensor([0.3, 0.6, 0.9])
    out = module.loss(batch, module.draws_at(batch, t, torch.Generator().manual_seed(1)))
    noised = module.process.noise(tokens, t, batch["prompt_mask"], generator=torch.Generator().manual_seed(1))
    assert (noised.state[noised.noised] == mask_id).all() and noised.noised.any()
    # ELBO (§2): Σ masked (1/t) · −log p(y | x_t), p = softmax over the 8 data ids with p([MASK]) = 0
    logits = module.net(noised.state).float()
    if mask_id < 8:
        logits[..., mask_id] = -torch.inf
    nll = -torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    expected = (torch.where(noised.noised, nll, 0.0) / t[:, None]).sum() / tokens.numel()
    torch.testing.assert_close(out.loss, expected)
    probs = module.denoiser().fn(noised.state, t).softmax(-1)
    assert probs.shape == (3, 12, 8)
    assert mask_id == 8 or (probs[..., mask_id] == 0).all()  # a sampler never proposes [MASK]


def test_mlfm_init_from_the_llama_mdm_starts_as_the_mdm(mdm_run, tmp_path, monkeypatch):
    _, ckpt = mdm_run
    isolate_runs(monkeypatch, tmp_path)
    over = [
        "experiment=sudoku_mlfm_easy",
        "scale=cpu",
        *FAST,
        *LLAMA,
        "method=mlfm_llama",
        "method.adapter.cond_dim=32",
        f"method.init_from={ckpt}",
        "logger=none",
    ]
    cfg = compose_config(overrides=over)
    module = build(cfg.method, data_vocab_size=9, seq_len=36)
    module.validate_inputs()
    module.on_fit_start()  # copies the MDM into the frozen base (what flowlm-train runs)
    module.eval()
    mdm = load_module(ckpt).eval()
    x = torch.randint(0, 10, (3, 36), generator=torch.Generator().manual_seed(2))  # [MASK] (9) included
    with torch.no_grad():
        z = module.net.embeddings[x]  # the bridge at t → 0: masked positions hold m = E[MASK]
        want = mdm.denoiser().fn(x, torch.zeros(3))
        for t in (0.1, 0.5, 0.9):  # zero-init adaLN + LoRA B = 0: every time gives the MDM's logits
            torch.testing.assert_close(module.denoiser().fn(z, torch.full((3,), t)), want, rtol=0, atol=1e-6)
    assert torch.equal(module.denoiser().mask_embedding, mdm.net.model.embed_tokens.weight[9])
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or "layer_mods" in n or "emb_s" in n for n in trainable)
    # the whole run: 2 steps, the MLFM samplers' evaluation, a checkpoint flowlm-eval reloads
    result = train(compose_config(overrides=over))
    assert {r["sampler"] for r in result["rows"]} == {"mlfm", "mlfm_ccfg", "mlfm_ccfg_otp"}
    ckpt_mlfm = Path(result["run_dir"], "checkpoints", "last.ckpt")
    eval_over = ["eval=sudoku_mlfm", "eval.nfe=[2]", "eval.max_batches=1", "logger=none"]
    rows = evaluate(compose_config("eval", overrides=[f"ckpt_path={ckpt_mlfm}", *eval_over]))
    assert {r["sampler"] for r in rows["rows"]} == {"mlfm", "mlfm_ccfg", "mlfm_ccfg_otp"}


def test_bad_llama_runs_fail_before_compute(mdm_run, tmp_path, monkeypatch):
    _, ckpt = mdm_run
    isolate_runs(monkeypatch, tmp_path)
    wrong = ["backbone.head_rows=6", "backbone.embed_rows=7", "backbone.mask_id=6"]
    wrong_vocab = compose_config(overrides=[*MDM, *wrong])
    with pytest.raises(ValueError, match="vocabulary of 9 tokens but backbone .* predicts 6"):
        train(wrong_vocab)
    assert not (tmp_path / "runs").exists()  # nothing written
    with pytest.raises(ValueError, match="time_conditioning=true needs a DiT"):
        train(compose_config(overrides=[*MDM, "method.time_conditioning=true"]))
    with pytest.raises(ValueError, match="AR, needs a DiT backbone"):
        train(compose_config(overrides=["experiment=sudoku_ar_medium", "scale=cpu", *FAST, *LLAMA, "logger=none"]))
    mlfm = ["experiment=sudoku_mlfm_easy", "scale=cpu", *FAST, *LLAMA, "method=mlfm_llama", f"method.init_from={ckpt}"]
    with pytest.raises(ValueError, match="another backbone size"):
        train(compose_config(overrides=[*mlfm, "backbone.n_layers=1", "logger=none"]))
    assert not (tmp_path / "runs").exists()


def test_mlfm_reads_mask_and_data_rows_from_the_backbone(monkeypatch):
    from lightning_modules.mlfm import MLFMModule

    torch.manual_seed(0)
    layout = {"arch": "qwen2", "embed_rows": 8, "head_rows": 8, "mask_id": 5, "shift_logits": True}  # Dream's
    module = MLFMModule(
        data_vocab_size=8, seq_len=6, backbone=tiny_llama(**layout), optim={}, init_from="(not read here)"
    )
    emb = module.net.embeddings
    den = module.denoiser()
    assert module.mask_id == 5 and torch.equal(den.mask_embedding, emb[5]) and torch.equal(den.embeddings, emb)
    z = emb[torch.tensor([[0, 5, 5, 1, 5, 7]])]
    probs = den.fn(z, torch.tensor([0.5])).softmax(-1)
    assert probs.shape == (1, 6, 8) and (probs[..., 5] == 0).all()
    # training: the bridge starts from m = E[mask_id] (not the last row) and the loss ignores the [MASK] logit
    seen = []
    sample = type(module.process).sample

    def spy(self, m, e_y, t, noised, *args, **kw):
        z = sample(self, m, e_y, t, noised, *args, **kw)
        seen.append((m, t, noised, z))
        return z

    monkeypatch.setattr(type(module.process), "sample", spy)
    tokens = torch.tensor([[0, 1, 2, 3, 4, 6], [7, 6, 4, 3, 2, 1]])
    batch = {"tokens": tokens, "prompt_mask": torch.zeros_like(tokens, dtype=torch.bool)}
    out = module.loss(batch, module.draws_at(batch, torch.Generator().manual_seed(0), torch.Generator().manual_seed(1)))
    ((m, t, noised, z),) = seen
    assert torch.equal(m, emb[5])
    assert not noised[:, 0].any() and noised.any()  # shifted logits: position 0 has no prediction, never masked
    # CE (§6): per-sequence mean of −log p(y | z_t) over masked positions, p([MASK]) = 0
    with torch.no_grad():
        logits = module(z, t).float()
    logits[..., 5] = -torch.inf
    nll = -torch.log_softmax(logits, -1).gather(-1, tokens[..., None]).squeeze(-1)
    expected = ((nll * noised).sum(-1) / noised.sum(-1)).mean()
    torch.testing.assert_close(out.loss.detach(), expected)


@pytest.mark.parametrize(("layout", "scored_at_0"), [("smdm", True), ("dream", False)])
def test_mdm_loss_never_masks_what_a_shifted_model_cannot_predict(layout, scored_at_0):
    """Dream's shifted logits predict nothing at position 0: the MDM loss keeps it clean and unscored, as the prompt
    (its BOS in the released training); an unshifted backbone masks and scores it."""
    layouts = {
        "smdm": {"arch": "llama", "embed_rows": 9, "head_rows": 8, "mask_id": 8},
        "dream": {"arch": "qwen2", "embed_rows": 8, "head_rows": 8, "mask_id": 5, "shift_logits": True},
    }
    torch.manual_seed(0)
    module = MDMModule(data_vocab_size=8, seq_len=6, backbone=tiny_llama(**layouts[layout]), optim={})
    tokens = torch.tensor([[0, 1, 2, 3, 4, 6], [7, 6, 4, 3, 2, 1]])
    batch = {"tokens": tokens, "prompt_mask": torch.zeros_like(tokens, dtype=torch.bool)}
    out = module.loss(batch, {"t": torch.tensor([0.9, 0.9]), "u": torch.zeros(2, 6)})  # u < t: every free position
    assert bool((out.per_token[:, 0] != 0).all()) == scored_at_0
    assert (out.per_token[:, 1:] != 0).all()


def test_flowlm_eval_checks_the_data_tokens_before_compute(mdm_run, monkeypatch):
    """flowlm-eval runs lightning_modules.vocabulary.check_data_tokens on the loaded module before any sampling."""
    import lightning_modules.vocabulary

    _, ckpt = mdm_run
    seen = []

    def refuse(datamodule, module):
        seen.append(module)
        raise ValueError("checked")

    # evaluate() imports it when it runs (the entry module stays light: tests/runners/test_first_hour.py)
    monkeypatch.setattr(lightning_modules.vocabulary, "check_data_tokens", refuse)
    with pytest.raises(ValueError, match="checked"):
        evaluate(compose_config("eval", overrides=[f"ckpt_path={ckpt}", "eval.nfe=[2]", "logger=none"]))
    assert len(seen) == 1 and isinstance(seen[0], MDMModule)
