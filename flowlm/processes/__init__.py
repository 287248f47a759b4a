"""Noise processes, one interface (base.py): the time law ``process.sample_t(n, generator=, device=, offset=,
count=)`` → t, and the forward process ``process.noise(tokens, times, keep, generator=, draws=, embeddings=,
mask_id=)`` → ``NoisedBatch(state, clean, noised)``.

  masking.py        MDLM's absorbing process, α_t = 1 − t (methods.md §2)
  gaussian_flow.py  Gaussian → one-hot flow and its two-time flow map, the FLM/FMLM/FMLM+ pair kinds (methods.md §3–4)
  bridge.py         the Brownian bridge on embeddings between [MASK] and the token (MLFM, methods.md §6)
"""

from flowlm.processes.base import NoisedBatch, NoiseProcess

__all__ = ["NoisedBatch", "NoiseProcess"]
