"""Speed kernels: the same values as the readable math in objectives/ and samplers/, computed without a (B, L, |V|)
tensor or in fewer passes. Each names the reference it equals (and is tested against it); measured figures live here
and in docs/performance.md, not in the math files.

- ``fused_ce``: FMLM+'s soft-capped cross-entropy from the head's input, in blocks of rows, its gradient made in the
  forward pass (the reference: ``log_delta`` then the dense cross-entropy in objectives/fmlm_plus.py);
- ``summary``: per position the argmax and log max δ (or the head's expectation) over vocabulary chunks;
- ``compiled``: ``torch.compile`` of the elementwise tails a sampler runs over the logits (off by default);
- ``draws``: categorical draws in float64, the two-level inverse CDF (one uniform per row) and Gumbel-max.
"""
