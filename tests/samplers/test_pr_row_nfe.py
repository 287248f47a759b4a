"""PR's adaptive mode: with ``early_stop`` the loop ends once the commit threshold has committed every row, each row
reports the calls it needed (row_nfe), and the tokens are those of the full R rounds; without it PR spends R × N."""

import torch

from flowlm.samplers import PosteriorRefinementSampler
from flowlm.samplers.base import FlowDenoiser

V, L = 5, 6


def scripted_model(calls: list[int]) -> FlowDenoiser:
    """log δ fixed per position: row 0 sure everywhere (p ≈ 1), row 1 unsure (uniform) at position 4, row 2 as row 0;
    ``calls`` counts the network evaluations."""
    logits = torch.full((3, L, V), -30.0)
    logits.scatter_(-1, torch.arange(3 * L).remainder(V).view(3, L, 1), 0.0)
    logits[1, 4] = 0.0

    def fn(x, s, t):
        calls.append(1)
        return torch.log_softmax(logits[: x.shape[0]], -1)

    return FlowDenoiser(fn=fn, vocab_size=V)


def run(early_stop: bool, rounds: int = 4, flow_steps: int = 2):
    calls: list[int] = []
    prompt = torch.zeros(3, L, dtype=torch.long)
    prompt_mask = torch.zeros(3, L, dtype=torch.bool)
    prompt_mask[0, :2] = True
    prompt_mask[2] = True  # nothing to generate
    sampler = PosteriorRefinementSampler(rounds=rounds, flow_steps=flow_steps, threshold=0.9, early_stop=early_stop)
    gen = torch.Generator().manual_seed(0)
    out = sampler(scripted_model(calls), prompt=prompt, prompt_mask=prompt_mask, nfe=rounds * flow_steps, generator=gen)
    return out, len(calls)


def test_early_stop_ends_once_every_row_is_committed_and_counts_each_rows_calls():
    out, calls = run(early_stop=True)
    # round 1 commits every sure token (p ≥ 0.9; row 1's top ⌈6 / 4⌉ = 2 are sure ones): row 1's unsure one waits
    assert out.nfe == calls == 2 * 2  # two rounds of N = 2 flow steps, not R × N = 8
    assert out.row_nfe.tolist() == [2, 4, 0]  # row 0 done after round 1, row 1 after round 2, row 2 had nothing
    assert out.mean_nfe() == 2.0
    full, full_calls = run(early_stop=False)
    assert full.nfe == full_calls == 4 * 2 and full.row_nfe is None  # the released loop: R × N, no host read
    assert torch.equal(out.tokens, full.tokens) and torch.equal(out.confidence, full.confidence)
