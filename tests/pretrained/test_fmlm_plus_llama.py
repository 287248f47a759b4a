"""FMLM+ on the LLaMA-family backbone (``LlamaFlowNet``, flowlm/backbones/llama.py; docs/pretrained.md "FMLM+ on the
LLaMA family"): the MDM initialisation identity on the SMDM, LLaDA and Dream layouts, the pinned and per-token times,
the state spaces and the chunked/fused head paths with [MASK] inside the vocabulary, the loss and its gradients, a
pretrained source as the initialisation, `flowlm-train` → reload → `flowlm-eval`, and the refusals before compute.
"""

import copy
from pathlib import Path

import pytest
import torch
from conftest import FAST, compose_config, isolate_runs

from flowlm.backbones.llama import BidirectionalLM, LlamaFlowNet, shift_logits
from flowlm.objectives.flow import log_delta
from flowlm.ops.summary import dense_summary
from flowlm.processes.gaussian_flow import EmbeddingSpace, OneHotSpace
from lightning_modules.checkpoints import load_module, read_checkpoint
from lightning_modules.fmlm_plus import FMLMPlusModule
from lightning_modules.mdm import MDMModule
from runners.evaluate import evaluate
from runners.train import train

TARGET = "flowlm.backbones.llama.BidirectionalLM"
# vocabulary layouts over V data ids: SMDM ([MASK] = the extra embedding row V), LLaDA ([MASK] inside), Dream
# ([MASK] inside, shifted logits, Qwen2 with q/k/v biases)
LAYOUTS = {
    "smdm": lambda v: {"arch": "llama", "embed_rows": v + 1, "head_rows": v, "mask_id": v},
    "llada": lambda v: {"arch": "llama", "embed_rows": v, "head_rows": v, "mask_id": 3},
    "dream": lambda v: {"arch": "qwen2", "embed_rows": v, "head_rows": v, "mask_id": 3, "shift_logits": True},
    # a head padded beyond the tokenizer (Dream's: 152 064 rows, its tokenizer's ids fewer; see docs/pretrained.md)
    "llada_padded": lambda v: {"arch": "llama", "embed_rows": v + 4, "head_rows": v + 4, "mask_id": 3},
    "dream_padded": lambda v: {
        "arch": "qwen2",
        "embed_rows": v + 4,
        "head_rows": v + 4,
        "mask_id": 3,
        "shift_logits": True,
    },
}
# the 6×6 Sudoku data have 9 token ids: a tiny random Llama in SMDM's layout (docs/pretrained.md)
LLAMA = ["backbone=llama/tiny", "backbone.embed_rows=10", "backbone.head_rows=9", "backbone.mask_id=9"]
ADAPTER = {"cond_dim": 16}


def tiny_llama(layout: str, vocab: int, hidden: int = 32) -> dict:
    """A 2-layer random bidirectional Llama/Qwen2 config with ``layout`` over ``vocab`` data ids."""
    sizes = {"hidden_size": hidden, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "intermediate_size": 2 * hidden}
    return {"_target_": TARGET, **sizes, **LAYOUTS[layout](vocab)}


def mdm_and_flow(layout: str, vocab: int = 9, hidden: int = 32, **options) -> tuple[MDMModule, FMLMPlusModule]:
    """A random MDM and an FMLM+ initialised from it (``initialise_from``, what ``init_from`` runs)."""
    torch.manual_seed(0)
    mdm = MDMModule(data_vocab_size=vocab, seq_len=12, backbone=tiny_llama(layout, vocab, hidden), optim={})
    with torch.no_grad():  # norm gains away from 1, so that a wrong row or slot shows
        for name, p in mdm.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    flow = FMLMPlusModule(
        data_vocab_size=vocab, seq_len=12, backbone=tiny_llama(layout, vocab, hidden), optim={}, **options
    )
    flow.initialise_from({f"net.{k}": v for k, v in mdm.net.state_dict().items()})
    return mdm.eval(), flow.eval()


def open_adaln(flow: FMLMPlusModule) -> None:
    """Non-zero adaLN, so that the times (and where they sit) change the logits."""
    with torch.no_grad():
        for mod in flow.net.layer_mods:
            mod.weight.normal_(0, 0.3)
            mod.bias.normal_(0, 0.1)


def inputs(vocab: int, batch: int = 3, length: int = 12, seed: int = 1):
    """Noisy flow states x (B, L, |V|), per-sequence times s ≤ t and a pinned set (position 0 pinned)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, length, vocab, generator=gen)
    s, t = torch.rand(batch, generator=gen).sort(0).values, torch.rand(batch, generator=gen)
    t = torch.maximum(s, t)
    pinned = torch.rand(batch, length, generator=gen) < 0.3
    pinned[:, 0] = True
    return x, s, t, pinned


# ------------------------------------------------------------------------------------------------ (a) identity
@pytest.mark.parametrize("layout", ["smdm", "llada", "dream", "llada_padded", "dream_padded"])
def test_initialised_flow_network_computes_the_mdm_logits(layout):
    """Zero-initialised adaLN: at s = t = 0 and at any times (pinned or per token) the network's logits are the MDM's
    on the same input vectors x·E (E = the embedding's data rows); log δ is the soft-capped log-softmax of the MDM's
    data logits ([MASK] inside the vocabulary at −∞). A head padded beyond the data is cut to the data's 9 rows.
    float32, max |Δ| ≤ 1e-5 on logits of order 1."""
    mdm, flow = mdm_and_flow(layout)
    x, s, t, pinned = inputs(9)
    emb = mdm.net.model.embed_tokens.weight
    assert torch.equal(flow.net.token_embeddings, emb[:9])
    assert flow.net.base.head_rows == flow.net.base.lm_head.weight.shape[0] == flow.net.vocab_size == 9
    with torch.no_grad():
        want = mdm.net.forward_embeddings(x @ emb[:9])[..., :9]
        zero = torch.zeros(3)
        for times in ((zero, zero, None), (s, t, pinned), (s[:, None].expand(3, 12), t[:, None].expand(3, 12), None)):
            got = flow.net(x, times[0], times[1], pinned=times[2])
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        log_d = flow(x, s, t, pinned)
        torch.testing.assert_close(log_d, log_delta(mdm.view.data_logits(want)), rtol=0, atol=1e-5)
    if layout != "smdm":  # [MASK] inside the vocabulary: at the cap's floor in training, −∞ where samplers draw
        assert flow.mask_id == 3
        lse = torch.logsumexp(30 * torch.tanh(mdm.view.data_logits(want) / 30), -1)
        torch.testing.assert_close(log_d[..., 3], -30 - lse, rtol=0, atol=1e-5)
        with torch.no_grad():
            drawn = flow.denoiser().at(x, s, t, pinned)
        assert bool((drawn[..., 3] == -torch.inf).all())
        others = torch.arange(9) != 3
        torch.testing.assert_close(drawn[..., others], log_d[..., others], rtol=0, atol=0)


def test_pinned_tokens_sit_at_s_t_1_and_s_t_read_their_own_embeddings():
    _, flow = mdm_and_flow("llada")
    open_adaln(flow)
    x, s, t, pinned = inputs(9)
    net = flow.net
    with torch.no_grad():
        per_token = net(x, torch.where(pinned, 1.0, s[:, None]), torch.where(pinned, 1.0, t[:, None]))
        torch.testing.assert_close(net(x, s, t, pinned=pinned), per_token, rtol=0, atol=1e-5)
        assert (per_token - net(x, s, t)).abs().max() > 1e-2  # the pinned rows do change the logits
        net.emb_t.mlp[-1].weight.zero_()  # emb_t ≡ its bias: the logits now depend on s only
        net.emb_t.mlp[-1].bias.zero_()
        base = net(x, s, t)
        torch.testing.assert_close(net(x, s, t.flip(0)), base, rtol=0, atol=1e-6)
        assert (net(x, s.flip(0), t) - base).abs().max() > 1e-2


def test_dream_conditions_each_hidden_position_on_the_token_it_predicts():
    """Shifted logits: hidden j predicts token j + 1, so it reads that token's times: the Dream network at per-token
    times τ equals Dream's shift of the same network unshifted at times shift_left(τ) (and pinned = per token)."""
    _, flow = mdm_and_flow("dream")
    open_adaln(flow)
    x, s, t, pinned = inputs(9)
    tau_s, tau_t = torch.where(pinned, 1.0, s[:, None]), torch.where(pinned, 1.0, t[:, None])
    unshifted = copy.deepcopy(flow.net)
    unshifted.base.shift_logits = False
    with torch.no_grad():
        got = flow.net(x, tau_s, tau_t)
        left = [torch.cat([tau[:, 1:], tau[:, -1:]], 1) for tau in (tau_s, tau_t)]
        torch.testing.assert_close(got, shift_logits(unshifted(x, *left)), rtol=0, atol=1e-5)
        torch.testing.assert_close(flow.net(x, s, t, pinned=pinned), got, rtol=0, atol=1e-5)


@pytest.mark.parametrize("layout", ["smdm", "llada"])
def test_one_hot_and_embedding_spaces_and_the_chunked_head_agree(layout):
    """|V| = 40 > d = 16: ``state_space=auto`` takes the embedding space over the data rows (SMDM: not the [MASK]
    row); its logits equal the one-hot space's, and the chunked head passes (greedy summary, δ·E) the dense ones."""
    _, flow = mdm_and_flow(layout, vocab=40, hidden=16)
    open_adaln(flow)
    space = flow.view.states()
    assert isinstance(space, EmbeddingSpace) and space.embeddings.shape == (40, 16)
    assert isinstance(flow.view.states("onehot"), OneHotSpace)
    x, s, t, pinned = inputs(40)
    with torch.no_grad():
        dense = flow(x, s, t, pinned)
        h = x @ flow.net.token_embeddings
        torch.testing.assert_close(flow(h, s, t, pinned, embedded=True), dense, rtol=0, atol=1e-5)
        log_max, argmax = flow.view.summary(h, s, t, pinned, embedded=True)
        want_max, want_arg = dense_summary(dense)
        torch.testing.assert_close(log_max, want_max, rtol=0, atol=1e-5)
        assert torch.equal(argmax, want_arg)
        torch.testing.assert_close(
            flow.view.lifted(h, s, t, pinned, embedded=True), space.lift(dense.exp()), atol=1e-5, rtol=1e-5
        )
    assert layout == "smdm" or not bool((argmax == 3).any())


# -------------------------------------------------------------------------------------------------- (b) loss
def batch_of(vocab: int, mask_id: int, batch: int = 4, length: int = 12) -> dict:
    tokens = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(3))
    tokens[tokens == mask_id] = 0  # [MASK] is never data
    prompt = torch.zeros(batch, length, dtype=torch.bool)
    prompt[:, :2] = True
    return {"tokens": tokens, "prompt_mask": prompt}


@pytest.mark.parametrize("layout", ["smdm", "dream", "dream_padded"])
def test_loss_is_finite_and_trains_the_whole_network(layout):
    _, flow = mdm_and_flow(layout)
    flow.train()
    kinds, s, t = flow.sample_pairs(4, 0)
    batch = batch_of(9, flow.mask_id)
    out = flow.loss(batch, flow.draws_at(batch, kinds, s, t, torch.Generator().manual_seed(0)))
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = {n: p.grad for n, p in flow.named_parameters()}
    assert all(p.requires_grad for p in flow.parameters())  # default: base + time adaLN, as the released DiT init
    for name in (
        "net.base.model.layers.0.self_attn.q_proj.weight",
        "net.base.lm_head.weight",
        "net.layer_mods.1.weight",
    ):
        assert grads[name] is not None and grads[name].abs().sum() > 0, name
    emb = grads["net.base.model.embed_tokens.weight"]
    assert emb[:9].abs().sum() > 0 and all(torch.isfinite(g).all() for g in grads.values() if g is not None)
    if layout == "smdm":  # the [MASK] row is never read by a flow state
        assert emb[9].abs().sum() == 0
    # no prompt, no context (rate 0): Dream's position 0, which its shifted logits predict nothing at, stays pinned
    # and unscored (as the MDM loss keeps it); an unshifted backbone scores it
    free = {**batch_of(9, flow.mask_id), "prompt_mask": torch.zeros(4, 12, dtype=torch.bool)}
    with torch.no_grad():
        out = flow.loss(free, flow.draws_at(free, kinds, s, t, torch.Generator().manual_seed(0), rates=torch.zeros(4)))
    assert bool((out.per_token[:, 0] == 0).all()) == layout.startswith("dream") and (out.per_token[:, 1:] != 0).all()


def test_a_padded_head_is_cut_and_the_checkpoint_reloads_at_its_size():
    """LLaDA/Dream's head has rows past the tokenizer: the flow's head is the MDM's first |V| rows (reported as
    sliced), the saved record says so (head 9 rows, embedding 13), and a module rebuilt from it loads the saved
    tensors strictly and computes the same log δ; a cut that would drop [MASK] or add rows is refused."""
    mdm, flow = mdm_and_flow("dream_padded")
    assert mdm.net.head_rows == 13 and "base.lm_head.weight" in flow.init_report["sliced"]
    assert torch.equal(flow.net.base.lm_head.weight, mdm.net.lm_head.weight[:9])
    saved: dict = {"state_dict": flow.state_dict()}
    flow.on_save_checkpoint(saved)
    record = flow._backbone_record
    assert record["head_rows"] == 9 and record["embed_rows"] == 13 and record["mask_id"] == 3
    again = FMLMPlusModule(data_vocab_size=9, seq_len=12, backbone=record, optim={})
    again.load_state_dict(saved["state_dict"], strict=True)
    x, s, t, pinned = inputs(9)
    with torch.no_grad():
        torch.testing.assert_close(again.eval()(x, s, t, pinned), flow(x, s, t, pinned), rtol=0, atol=0)
    smdm = BidirectionalLM(**{k: v for k, v in tiny_llama("smdm", 9).items() if k != "_target_"})
    with pytest.raises(ValueError, match="cannot cut a head of 9 rows"):
        smdm.cut_head(8)  # SMDM's [MASK] is the extra embedding row: every head row is a data id
    with pytest.raises(ValueError, match="cannot cut a head of 9 rows"):
        smdm.cut_head(10)


def test_fused_loss_equals_the_dense_one_with_mask_inside_the_vocabulary():
    """|V| = 40 > d = 16: ``fused_loss=auto`` runs the student's CE from the head's chunks with the [MASK] column at
    −∞ through the head bias; loss and gradients equal the dense path's (float32)."""
    _, fused = mdm_and_flow("llada", vocab=40, hidden=16)
    open_adaln(fused)
    dense = copy.deepcopy(fused)
    dense.fused_loss = False
    assert fused.fused_head() is not None and dense.fused_head() is None
    kinds, s, t = fused.sample_pairs(4, 0)
    batch = batch_of(40, 3)
    losses = []
    for module in (fused, dense):
        module.train()
        loss = module.loss(batch, module.draws_at(batch, kinds, s, t, torch.Generator().manual_seed(0))).loss
        loss.backward()
        losses.append(loss)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    for (name, a), b in zip(fused.named_parameters(), dense.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_lora_option_freezes_the_base_and_starts_as_the_mdm():
    adapter = {**ADAPTER, "train": ["time_adaln", "lora"], "lora_rank": 4}
    mdm, flow = mdm_and_flow("smdm", adapter=adapter)
    assert set(flow.init_report["copied"]) == {f"base.{n}" for n in flow.net.base_state_names()}
    trainable = {n for n, p in flow.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or "layer_mods" in n or ".emb_" in n for n in trainable)
    x, s, t, pinned = inputs(9)
    with torch.no_grad():
        want = mdm.net.forward_embeddings(x @ mdm.net.model.embed_tokens.weight[:9])
        torch.testing.assert_close(flow.net(x, s, t, pinned=pinned), want, rtol=0, atol=1e-5)


def test_a_pretrained_source_is_the_initialisation():
    """``backbone`` = a pretrained SMDM file (the shipped tiny one, 512 ids + [MASK] 512, d 32) with init_from null:
    the FMLM+ network computes the loaded SMDM's logits; the embedding space and the fused loss apply (|V| > d)."""
    from fixtures.tiny_smdm.make import CONFIG, PATH

    from flowlm.pretrained.smdm import load_smdm

    cfg = {"_target_": "flowlm.pretrained.smdm.load_smdm", "source": str(PATH), "config": CONFIG}
    flow = FMLMPlusModule(data_vocab_size=512, seq_len=8, backbone=cfg, optim={}, adapter=ADAPTER).eval()
    mdm = load_smdm(PATH, config=CONFIG).eval()
    assert flow.mask_id == 512 and isinstance(flow.view.states(), EmbeddingSpace) and flow.fused_head() is not None
    x, s, t, pinned = inputs(512, length=8)
    with torch.no_grad():
        want = mdm.forward_embeddings(x @ mdm.model.embed_tokens.weight[:512])
        torch.testing.assert_close(flow.net(x, s, t, pinned=pinned), want, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------- (c) the entry points
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An MDM on llama/tiny (2 steps through flowlm-train), then FMLM+ `init_from` it (2 steps, PR + a-priori)."""
    root = tmp_path_factory.mktemp("fmlm_llama_runs")
    mp = pytest.MonkeyPatch()
    isolate_runs(mp, root)
    base = ["scale=cpu", *FAST, *LLAMA, "logger=none"]
    mdm = train(compose_config(overrides=["experiment=sudoku_mdm_easy", *base]))
    mdm_ckpt = Path(mdm["run_dir"], "checkpoints", "last.ckpt")
    over = [
        "experiment=sudoku_fmlm_plus_init_easy",
        *base,
        "+method.adapter.cond_dim=32",
        f"method.init_from={mdm_ckpt}",
    ]
    flow = train(compose_config(overrides=over))
    yield mdm_ckpt, flow
    mp.undo()


def test_flowlm_train_initialises_from_the_llama_mdm_and_saves_a_reloadable_checkpoint(runs):
    mdm_ckpt, result = runs
    assert {r["sampler"] for r in result["rows"]} == {"pr", "a_priori"}
    ckpt = Path(result["run_dir"], "checkpoints", "last.ckpt")
    saved = read_checkpoint(ckpt)
    record = saved["hyper_parameters"]["backbone"]
    assert record["_target_"] == TARGET and record["device"] == "meta" and record["mask_id"] == 9
    assert saved["hyper_parameters"]["adapter"] == {"cond_dim": 32}
    module = load_module(ckpt).eval()
    assert isinstance(module.net, LlamaFlowNet) and not any(p.is_meta for p in module.parameters())
    state = module.state_dict()
    assert state.keys() == saved["state_dict"].keys()
    assert all(torch.equal(state[k], v) for k, v in saved["state_dict"].items())
    # an independent rebuild from the record and the saved tensors computes the same logits, bit for bit
    spec = {k: v for k, v in record.items() if k not in ("_target_", "device")}
    tensors = {k[len("net.") :]: v for k, v in saved["state_dict"].items()}
    base = BidirectionalLM.from_state(spec, {k[len("base.") :]: v for k, v in tensors.items() if k.startswith("base.")})
    rebuilt = LlamaFlowNet(base, cond_dim=32)
    rebuilt.load_state_dict(tensors)
    x, s, t, pinned = inputs(9, length=36)
    with torch.no_grad():
        torch.testing.assert_close(
            module.net(x, s, t, pinned=pinned), rebuilt.eval()(x, s, t, pinned=pinned), rtol=0, atol=0
        )
    # the MDM's decoder and head were copied, the adaLN and the time embeddings were fresh (then trained 2 steps)
    mdm_state = read_checkpoint(mdm_ckpt)["state_dict"]
    assert {f"net.base.{k[len('net.') :]}" for k in mdm_state} <= state.keys()


def test_flowlm_eval_runs_the_flow_samplers_on_the_checkpoint(runs):
    _, result = runs
    ckpt = Path(result["run_dir"], "checkpoints", "last.ckpt")
    over = [f"ckpt_path={ckpt}", "eval=sudoku_flow", "eval.nfe=[2]", "eval.max_batches=1", "logger=none"]
    rows = evaluate(compose_config("eval", overrides=[*over, "+sampler@eval.samplers.flow_map=flow_map"]))["rows"]
    assert {r["sampler"] for r in rows} == {"pr", "a_priori", "flow_map"}
    for row in rows:
        assert 1 <= row["nfe"] <= row["nfe_budget"] == 2 and 0 <= row["accuracy"] <= 100


def test_distilled_fmlm_plus_takes_the_llama_mdm_as_teacher(runs, tmp_path, monkeypatch):
    mdm_ckpt, _ = runs
    isolate_runs(monkeypatch, tmp_path)
    over = ["experiment=sudoku_fmlm_plus_distill_easy", "scale=cpu", *FAST, *LLAMA, "logger=none"]
    result = train(compose_config(overrides=[*over, f"method.teacher={mdm_ckpt}"]))
    assert {r["sampler"] for r in result["rows"]} == {"pr", "a_priori"}


# ---------------------------------------------------------------------------------------------- (d) refusals
def fake_checkpoint(path: Path, backbone: dict, state: dict, family: str = "mdm") -> Path:
    """A checkpoint file with the record ``validate_inputs`` reads (family, vocabulary, backbone, EMA weights)."""
    torch.save(
        {
            "flowlm": {"family": family, "data_vocab_size": 9},
            "hyper_parameters": {"backbone": backbone, "time_conditioning": False},
            "state_dict": {f"net.{k}": v for k, v in state.items()},
        },
        path,
    )
    return path


def test_bad_init_sources_and_options_are_refused_before_compute(runs, tmp_path, monkeypatch):
    mdm_ckpt, _ = runs
    shallow = MDMModule(data_vocab_size=9, seq_len=12, backbone={**tiny_llama("smdm", 9), "n_layers": 1}, optim={})
    dit = MDMModule(data_vocab_size=9, seq_len=12, backbone={"size": "tiny"}, optim={})
    cases = {
        "another backbone size": fake_checkpoint(
            tmp_path / "a.ckpt", shallow._backbone_record, shallow.net.state_dict()
        ),
        "another backbone family": fake_checkpoint(tmp_path / "b.ckpt", {"size": "tiny"}, dit.net.state_dict()),
        "'mlfm' checkpoint": fake_checkpoint(tmp_path / "c.ckpt", {}, {}, family="mlfm"),
    }
    lora = {"train": ["time_adaln", "lora"], "lora_rank": 2}  # PEFT renames the base: the shallow MDM still fails
    flow = FMLMPlusModule(
        data_vocab_size=9,
        seq_len=12,
        backbone=tiny_llama("smdm", 9),
        optim={},
        adapter=lora,
        init_from=str(cases["another backbone size"]),
    )
    with pytest.raises(ValueError, match="another backbone size"):
        flow.validate_inputs()
    for message, path in cases.items():
        flow = FMLMPlusModule(
            data_vocab_size=9, seq_len=12, backbone=tiny_llama("smdm", 9), optim={}, init_from=str(path)
        )
        with pytest.raises(ValueError, match=message):
            flow.validate_inputs()
    isolate_runs(monkeypatch, tmp_path)
    over = ["experiment=sudoku_fmlm_plus_init_easy", "scale=cpu", *FAST, *LLAMA, "logger=none"]
    with pytest.raises(ValueError, match="another backbone size"):  # through flowlm-train: nothing written
        train(compose_config(overrides=[*over, "backbone.n_layers=3", f"method.init_from={mdm_ckpt}"]))
    assert not (tmp_path / "runs").exists()
    with pytest.raises(ValueError, match="method.adapter configures"):
        FMLMPlusModule(data_vocab_size=9, seq_len=12, backbone={"size": "tiny"}, optim={}, adapter=ADAPTER)
    with pytest.raises(ValueError, match="lora_head=true is not supported"):
        FMLMPlusModule(
            data_vocab_size=9, seq_len=12, backbone=tiny_llama("smdm", 9), optim={}, adapter={"lora_head": True}
        )
    with pytest.raises(ValueError, match="vocabulary of 9 tokens but backbone .* predicts 8"):
        FMLMPlusModule(data_vocab_size=9, seq_len=12, backbone=tiny_llama("smdm", 8), optim={})
