"""Flow map math, the batch split, the FMLM+ loss at s = t = 0 vs the MDM, MDM initialisation, PR and flow samplers."""

import pytest
import torch
import torch.nn.functional as F

from flowlm.objectives.fmlm_plus import (
    BOUNDARY,
    DIAGONAL,
    DISTILL,
    OFF_DIAGONAL,
    batch_kinds_and_times,
    semigroup_gamma,
    semigroup_target,
    split_counts,
)
from flowlm.processes.gaussian_flow import flow_map
from flowlm.samplers import FlowDenoiser, FlowMapSampler, PosteriorRefinementSampler
from lightning_modules.fmlm_plus import FMLMPlusModule
from lightning_modules.mdm import MDMModule

BACKBONE = {"d_model": 32, "n_layers": 2, "n_heads": 4, "cond_dim": 16}


def _simplex(shape, gen):
    return torch.rand(*shape, generator=gen).softmax(-1)


def test_semigroup_coefficients_and_target():
    gen = torch.Generator().manual_seed(0)
    gap = torch.rand(1000, generator=gen)
    s = torch.rand(1000, generator=gen) * (1 - gap)
    t = s + gap
    u = (s + t) / 2
    gamma = semigroup_gamma(s, u, t)
    assert (gamma >= 0).all() and (gamma <= 1).all()
    d1, d2 = _simplex((1000, 7), gen), _simplex((1000, 7), gen)
    target = semigroup_target(d1, d2, gamma)
    assert (target >= 0).all()
    torch.testing.assert_close(target.sum(-1), torch.ones(1000))
    # at t = 1 the target is δ_{u,1}(X_u) = D2
    one = torch.ones(5)
    s5 = torch.rand(5, generator=gen)
    torch.testing.assert_close(semigroup_target(d1[:5], d2[:5], semigroup_gamma(s5, (s5 + 1) / 2, one)), d2[:5])


def test_semigroup_target_composes_the_two_half_jumps():
    """X_{s,t} built from the target equals X_{u,t}(X_{s,u}(x)) for any D1, D2 (the identity behind the target)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 5, generator=gen, dtype=torch.float64)
    gap = torch.rand(64, generator=gen, dtype=torch.float64) * 0.98 + 0.01
    s = torch.rand(64, generator=gen, dtype=torch.float64) * (1 - gap)
    t, u = s + gap, s + gap / 2
    d1 = _simplex((64, 5), gen).double()
    d2 = _simplex((64, 5), gen).double()
    two_jumps = flow_map(flow_map(x, d1, s, u), d2, u, t)
    one_jump = flow_map(x, semigroup_target(d1, d2, semigroup_gamma(s, u, t)), s, t)
    torch.testing.assert_close(one_jump, two_jumps)


def test_flow_map_identity_and_endpoint():
    gen = torch.Generator().manual_seed(2)
    x, delta = torch.randn(4, 3, 6, generator=gen), _simplex((4, 3, 6), gen)
    s = torch.rand(4, 3, generator=gen) * 0.9
    torch.testing.assert_close(flow_map(x, delta, s, s), x)  # X_{s,s} = id
    torch.testing.assert_close(flow_map(x, delta, s, torch.ones_like(s)), delta)  # X_{s,1} = δ_{s,1}
    done = torch.ones_like(s)
    torch.testing.assert_close(flow_map(x, delta, done, done), x)  # pinned tokens stay


@pytest.mark.parametrize(
    ("batch", "distill", "counts"),
    [(256, 0.0, (128, 4, 124, 0)), (1024, 0.0, (512, 16, 496, 0)), (512, 0.25, (192, 6, 186, 128))],
)
def test_split_counts_match_the_released_recipe(batch, distill, counts):
    assert split_counts(batch, distill=distill) == counts


def test_kinds_and_times_are_exact_over_the_global_batch():
    n, world = 256, 4
    parts = [
        batch_kinds_and_times(n, offset=r * 64, count=64, generator=torch.Generator().manual_seed(5))
        for r in range(world)
    ]
    kinds = torch.cat([p[0] for p in parts])
    s, t = torch.cat([p[1] for p in parts]), torch.cat([p[2] for p in parts])
    assert [(kinds == k).sum().item() for k in (DIAGONAL, BOUNDARY, OFF_DIAGONAL, DISTILL)] == [128, 4, 124, 0]
    assert torch.equal(s[kinds == DIAGONAL], t[kinds == DIAGONAL])
    assert (s[kinds == BOUNDARY] == 0).all() and (t[kinds == BOUNDARY] == 1).all()
    off = kinds == OFF_DIAGONAL
    assert (s[off] >= 0).all() and (s[off] < t[off]).all() and (t[off] <= 1).all()


class _MDMAsFlow(torch.nn.Module):
    """A flow 'model' that hands noised positions (s = 0) to an MDM as [MASK] and records what it saw."""

    def __init__(self, mdm: MDMModule):
        super().__init__()
        self.mdm, self.seen = mdm, []

    def forward(self, x, s, t, pinned=None):
        if pinned is not None:  # the pinned form: per-sequence times, pinned tokens at s = t = 1
            s, t = torch.where(pinned, 1.0, s[:, None]), torch.where(pinned, 1.0, t[:, None])
        ids = torch.where(s == 0, self.mdm.mask_id, x.argmax(-1))
        self.seen.append((ids, s.clone(), t.clone()))
        return F.log_softmax(self.mdm(ids, torch.zeros(x.shape[0]))[..., : self.mdm.mask_id].float(), -1)


def _mdm_and_flow(v: int, length: int, **flow_kwargs) -> tuple[MDMModule, FMLMPlusModule]:
    """A randomly weighted MDM (non-zero output) and a fresh FMLM+ of the same backbone size."""
    torch.manual_seed(0)
    mdm = MDMModule(data_vocab_size=v, seq_len=length, backbone=BACKBONE, optim={})
    for p in mdm.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return mdm, FMLMPlusModule(data_vocab_size=v, seq_len=length, backbone=BACKBONE, optim={}, **flow_kwargs)


def test_diagonal_loss_at_zero_equals_mdm_cross_entropy():
    v, length = 5, 10
    mdm, flow = _mdm_and_flow(v, length)
    wrapper = _MDMAsFlow(mdm)
    flow.forward = wrapper.forward
    tokens = torch.randint(0, v, (6, length))
    prompt = torch.zeros(6, length, dtype=torch.bool)
    prompt[:, :3] = True
    zeros = torch.zeros(6)
    batch = {"tokens": tokens, "prompt_mask": prompt}
    loss = flow.loss(
        batch, flow.draws_at(batch, torch.zeros(6, dtype=torch.long), zeros, zeros, torch.Generator().manual_seed(3))
    ).loss
    ((ids, s, t),) = wrapper.seen
    active = s == 0
    assert active.any() and not active[prompt].any() and (t[active] == 0).all()
    assert (ids[~active] == tokens[~active]).all()  # prompt and context are seen clean
    # the MDM cross-entropy with exactly the active positions masked, averaged over them
    log_p = F.log_softmax(mdm(ids, zeros)[..., :v].float(), -1)
    reference = -log_p.gather(-1, tokens[..., None]).squeeze(-1)[active].mean()
    torch.testing.assert_close(loss, reference)


def test_mdm_initialisation_copies_weights_and_reproduces_the_mdm():
    v, length = 6, 8
    mdm, flow = _mdm_and_flow(v, length, zero_t_embedding=True)  # the released default (False) keeps emb_t random
    report = flow.initialise_from(mdm.state_dict())
    assert set(report["sliced"]) == {"embed.weight", "final.linear.weight", "final.linear.bias"}
    assert report["fresh"] and all(name.startswith("emb_t.") for name in report["fresh"])
    for name, param in flow.net.state_dict().items():
        if name in report["copied"]:
            src = mdm.net.state_dict()[name]
            assert torch.equal(param, src[: param.shape[0]] if name in report["sliced"] else src), name
    # at s = t = 0 the FMLM+ net is the MDM, but for its input: noise·E instead of E[MASK]. With a zero input
    # vector on the noised positions and a zero [MASK] row in the MDM, the logits agree exactly.
    tokens = torch.randint(0, v, (3, length))
    noised = torch.rand(3, length) < 0.5
    with torch.no_grad():
        mdm.net.embed.weight[mdm.mask_id] = 0
        x = torch.where(noised[..., None], torch.zeros(3, length, v), F.one_hot(tokens, v).float())
        s = torch.where(noised, 0.0, 1.0)
        t = s.clone()
        # the MDM is time-agnostic (fed s = 0 everywhere); FMLM+ sees s = t = 1 on clean tokens, so compare with the
        # MDM's own conditioning by giving FMLM+ zeros as well
        ours = flow.net(x, torch.zeros_like(s), torch.zeros_like(t))[..., :v]
        theirs = mdm.net(torch.where(noised, mdm.mask_id, tokens), torch.zeros(3))[..., :v]
    torch.testing.assert_close(ours, theirs)
    with pytest.raises(ValueError, match="another backbone size"):
        FMLMPlusModule(
            data_vocab_size=v, seq_len=length, backbone={**BACKBONE, "d_model": 64}, optim={}
        ).initialise_from(mdm.state_dict())


@pytest.mark.parametrize(
    ("source_layers", "own_layers", "what"), [(2, 1, "no counterpart here"), (1, 2, "source lacks")]
)
def test_initialising_from_an_mdm_of_another_depth_is_refused(source_layers, own_layers, what):
    # was: a 4-block MDM into a 1-block FMLM+ copied block 0 and dropped the others without a word (and a deeper
    # FMLM+ kept its extra blocks random), as the width check looked only at tensors present in both
    v, length = 6, 8
    mdm = MDMModule(data_vocab_size=v, seq_len=length, backbone={**BACKBONE, "n_layers": source_layers}, optim={})
    flow = FMLMPlusModule(data_vocab_size=v, seq_len=length, backbone={**BACKBONE, "n_layers": own_layers}, optim={})
    with pytest.raises(ValueError, match=f"another backbone size: .*{what} \\(blocks\\.1\\."):
        flow.initialise_from(mdm.state_dict())


class _Recorder:
    """A random two-time 'network' whose output depends on its input; records every call."""

    def __init__(self, v=5, length=9, seed=0):
        self.w = torch.randn(v, v, generator=torch.Generator().manual_seed(seed)) * 3
        self.calls = []
        self.v = v

    def __call__(self, x, s, t):
        self.calls.append((x.clone(), s.clone(), t.clone()))
        return F.log_softmax(x @ self.w + 2 * s[..., None] - t[..., None], -1)

    def view(self):
        return FlowDenoiser(fn=self, vocab_size=self.v)


def _prompt(v=5, length=9, batch=4):
    prompt = torch.randint(0, v, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.zeros(batch, length, dtype=torch.bool)
    mask[:, :2] = True
    return prompt, mask


@pytest.mark.parametrize(
    ("rounds", "steps", "confidence"),
    [
        (1, 1, "posterior"),
        (3, 1, "posterior"),
        (4, 2, "posterior"),
        (9, 1, "posterior"),
        (3, 1, "a_priori"),
        (9, 1, "a_priori"),
    ],
)
def test_pr_commits_everything_exactly_r_times_n_and_never_revisits(rounds, steps, confidence):
    net = _Recorder()
    prompt, mask = _prompt()
    sampler = PosteriorRefinementSampler(rounds=rounds, flow_steps=steps, confidence=confidence)
    out = sampler(
        net.view(), prompt=prompt, prompt_mask=mask, nfe=rounds * steps, generator=torch.Generator().manual_seed(0)
    )
    assert out.nfe == len(net.calls) == rounds * steps
    assert (out.tokens[mask] == prompt[mask]).all() and ((out.tokens >= 0) & (out.tokens < 5)).all()
    # once a position is committed (s = 1), every later call sees it committed with the same one-hot token
    first_seen = {}
    for x, s, _ in net.calls:
        for b, pos in (s == 1).nonzero().tolist():
            token = x[b, pos].argmax().item()
            assert first_seen.setdefault((b, pos), token) == token
            assert torch.equal(x[b, pos], F.one_hot(torch.tensor(token), 5).float())
    committed_counts = [(s == 1).sum().item() for _, s, _ in net.calls]
    assert committed_counts == sorted(committed_counts)
    for (b, pos), token in first_seen.items():
        assert out.tokens[b, pos] == token


def test_pr_uniform_budget_and_determinism():
    net = _Recorder()
    prompt, mask = _prompt()
    sampler = PosteriorRefinementSampler(rounds=3, threshold=1.0)  # threshold 1 → only the uniform budget commits
    run = lambda seed: sampler(
        net.view(), prompt=prompt, prompt_mask=mask, nfe=3, generator=torch.Generator().manual_seed(seed)
    )
    a = run(4)
    open_per_call = [(s < 1).sum(-1).tolist() for _, s, _ in net.calls]
    assert open_per_call == [[7] * 4, [4] * 4, [2] * 4]  # ⌈7/3⌉ = 3 committed, then ⌈4/2⌉ = 2, then the rest
    assert torch.equal(a.tokens, run(4).tokens) and torch.equal(a.confidence, run(4).confidence)


@pytest.mark.parametrize(
    ("kwargs", "nfe", "match"),
    [
        ({"rounds": 4, "flow_steps": 2}, 6, "above the budget"),
        ({"rounds": 0}, 4, "rounds ≥ 1"),
        ({"threshold": 0.0}, 4, "threshold"),
        ({"threshold": 1.5}, 4, "threshold"),
        ({"flow_steps": 3}, 2, "below"),
    ],
)
def test_pr_rejects_budgets_and_settings_it_cannot_honour(kwargs, nfe, match):
    net = _Recorder()
    prompt, mask = _prompt()
    with pytest.raises(ValueError, match=match):
        PosteriorRefinementSampler(**kwargs)(net.view(), prompt=prompt, prompt_mask=mask, nfe=nfe, generator=None)
    assert not net.calls


@pytest.mark.parametrize("euler", [False, True])
def test_flow_map_sampler_spends_one_nfe_per_jump(euler):
    net = _Recorder()
    prompt, mask = _prompt()
    out = FlowMapSampler(euler=euler)(
        net.view(), prompt=prompt, prompt_mask=mask, nfe=5, generator=torch.Generator().manual_seed(0)
    )
    assert out.nfe == len(net.calls) == 5
    assert (out.tokens[mask] == prompt[mask]).all()
    ts = [t[~mask].unique() for _, _, t in net.calls]
    assert all(len(t) == 1 for t in ts)  # every non-prompt token jumps together
    expected = [k / 5 for k in range(5)] if euler else [(k + 1) / 5 for k in range(5)]
    assert [t.item() for t in ts] == pytest.approx(expected)


@pytest.mark.parametrize(("block", "steps", "nfe"), [(7, 1, 1), (3, 2, 6), (2, 1, 4), (7, None, 5)])
def test_block_sampler_commits_block_by_block(block, steps, nfe):
    from flowlm.samplers import BlockFlowSampler

    net = _Recorder()
    prompt, mask = _prompt()  # 7 free positions per sequence
    out = BlockFlowSampler(block_size=block, steps_per_block=steps)(
        net.view(), prompt=prompt, prompt_mask=mask, nfe=nfe, generator=torch.Generator().manual_seed(0)
    )
    n_blocks = -(-7 // block)
    assert out.nfe == len(net.calls) == n_blocks * (steps or nfe // n_blocks)
    assert (out.tokens[mask] == prompt[mask]).all()
    committed = [(s == 1).sum(-1)[0].item() - 2 for _, s, _ in net.calls]  # minus the 2 prompt positions
    per_block = out.nfe // n_blocks
    assert committed == [min(b * block, 7) for b in range(n_blocks) for _ in range(per_block)]


def test_block_sampler_budget_error():
    from flowlm.samplers import BlockFlowSampler

    net = _Recorder()
    prompt, mask = _prompt()
    with pytest.raises(ValueError, match="above the budget"):
        BlockFlowSampler(block_size=2, steps_per_block=2)(net.view(), prompt=prompt, prompt_mask=mask, nfe=7)
    assert not net.calls


@pytest.mark.parametrize(
    ("sampler", "nfe"),
    [
        (FlowMapSampler(), 3),
        (FlowMapSampler(euler=True), 2),
        (PosteriorRefinementSampler(rounds=2, flow_steps=2), 4),
        (PosteriorRefinementSampler(rounds=3, confidence="a_priori"), 3),
    ],
)
def test_samplers_on_the_pinned_form_match_dense_per_token_times(sampler, nfe):
    """Flow samplers call the model with times per sequence and pinned tokens (FlowDenoiser.at); a denoiser
    without that form gets the same calls as dense per-token times, with the same samples."""
    torch.manual_seed(0)
    flow = FMLMPlusModule(data_vocab_size=5, seq_len=9, backbone=BACKBONE, optim={}).eval()
    for p in flow.parameters():
        torch.nn.init.normal_(p, std=0.3)
    prompt, mask = _prompt()
    fast, dense = flow.denoiser(), FlowDenoiser(fn=flow, vocab_size=5)
    with torch.no_grad():
        a = sampler(fast, prompt=prompt, prompt_mask=mask, nfe=nfe, generator=torch.Generator().manual_seed(4))
        b = sampler(dense, prompt=prompt, prompt_mask=mask, nfe=nfe, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a.tokens, b.tokens) and a.nfe == b.nfe == nfe
    torch.testing.assert_close(a.confidence, b.confidence, rtol=1e-5, atol=1e-6)
