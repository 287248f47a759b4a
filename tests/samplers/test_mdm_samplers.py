"""MDM samplers: honest NFE, prompts untouched, masks never grow, determinism, budget checks."""

import pytest
import torch

from flowlm.samplers import AncestralSampler, ConfidenceSampler, MaskedDenoiser

V, MASK, L = 6, 6, 12


class CountingNet:
    """A fixed random 'network' that records every call and the inputs it saw."""

    def __init__(self, time_conditioned=False, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(V + 1, L, V, generator=g)
        self.calls = 0
        self.inputs = []
        self.time_conditioned = time_conditioned

    def __call__(self, x, t):
        self.calls += 1
        self.inputs.append(x.clone())
        # logits depend on the tokens present (so outputs change as tokens are committed)
        return self.table[x, torch.arange(L)] + x.float().mean(-1, keepdim=True)[..., None]

    def view(self):
        return MaskedDenoiser(fn=self, mask_id=MASK, time_conditioned=self.time_conditioned)


def _prompt(batch=5):
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (batch, L), generator=g)
    prompt_mask = torch.zeros(batch, L, dtype=torch.bool)
    prompt_mask[:, :4] = True
    return prompt, prompt_mask


SAMPLERS = [
    AncestralSampler(),
    AncestralSampler(cache=False),
    ConfidenceSampler(),
    ConfidenceSampler(temperature=1),
]


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["anc", "anc-nocache", "conf", "conf-t1"])
@pytest.mark.parametrize("nfe", [1, 3, 8, 50])
def test_nfe_prompt_masks_and_completion(sampler, nfe):
    net = CountingNet()
    prompt, prompt_mask = _prompt()
    out = sampler(
        net.view(),
        prompt=prompt,
        prompt_mask=prompt_mask,
        nfe=nfe,
        generator=torch.Generator().manual_seed(0),
    )
    assert out.nfe == net.calls <= nfe  # NFE reported = network calls made, within budget
    assert (out.tokens[prompt_mask] == prompt[prompt_mask]).all()  # prompt untouched
    assert (out.tokens != MASK).all() and out.tokens.max() < V  # everything decoded
    # each call's rows (the ancestral sampler's: the rows that need it), told apart by their prompts
    assert len({tuple(p) for p in prompt[:, :4].tolist()}) == len(prompt)
    masked_counts = {}
    for x in net.inputs:  # the prompt is visible at every call
        for row in x:
            (b,) = (row[:4] == prompt[:, :4]).all(-1).nonzero()[0].tolist()
            assert (row[prompt_mask[b]] == prompt[b, prompt_mask[b]]).all()
            masked_counts.setdefault(b, []).append(int((row == MASK).sum()))
    for counts in masked_counts.values():
        assert counts == sorted(counts, reverse=True)  # a row's masked tokens never increase
    assert ((out.confidence > 0) & (out.confidence <= 1)).all()


def test_ancestral_cache_saves_calls_only_when_nothing_changed():
    net = CountingNet()
    prompt, prompt_mask = _prompt(batch=1)
    out = AncestralSampler()(
        net.view(), prompt=prompt, prompt_mask=prompt_mask, nfe=64, generator=torch.Generator().manual_seed(0)
    )
    assert out.nfe == net.calls < 64  # 8 tokens over 64 steps: many steps change nothing
    # consecutive calls never see identical inputs (otherwise a call was wasted)
    assert all(not torch.equal(a, b) for a, b in zip(net.inputs, net.inputs[1:], strict=False))
    timed = CountingNet(time_conditioned=True)
    out_t = AncestralSampler()(
        timed.view(),
        prompt=prompt,
        prompt_mask=prompt_mask,
        nfe=64,
        generator=torch.Generator().manual_seed(0),
    )
    assert out_t.nfe == timed.calls  # a time-conditioned net cannot reuse outputs across times
    assert out_t.nfe > out.nfe


def test_confidence_commits_uniform_budget():
    net = CountingNet()
    prompt, prompt_mask = _prompt(batch=2)
    ConfidenceSampler()(
        net.view(), prompt=prompt, prompt_mask=prompt_mask, nfe=3, generator=torch.Generator().manual_seed(0)
    )
    masked = [(x == MASK).sum(-1).tolist() for x in net.inputs]
    assert masked == [[8, 8], [5, 5], [2, 2]]  # ⌈8/3⌉ = 3, then ⌈5/2⌉ = 3, then 2


@pytest.mark.parametrize("sampler", SAMPLERS, ids=["anc", "anc-nocache", "conf", "conf-t1"])
def test_same_seed_same_samples(sampler):
    prompt, prompt_mask = _prompt()
    run = lambda seed: (
        sampler(
            CountingNet().view(),
            prompt=prompt,
            prompt_mask=prompt_mask,
            nfe=4,
            generator=torch.Generator().manual_seed(seed),
        ).tokens
    )
    assert torch.equal(run(7), run(7))
    if not (isinstance(sampler, ConfidenceSampler) and sampler.temperature == 0):
        assert not torch.equal(run(7), run(8))


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_budget_the_sampler_cannot_honour(bad):
    net = CountingNet()
    prompt, prompt_mask = _prompt()
    for sampler in SAMPLERS:
        with pytest.raises(ValueError, match="NFE budget"):
            sampler(net.view(), prompt=prompt, prompt_mask=prompt_mask, nfe=bad, generator=None)
    assert net.calls == 0
