"""Noise processes, one call shape: ``process.noise(tokens, times, keep, generator=, draws=, embeddings=)`` →
``NoisedBatch(state, clean, noised)`` (base.py).

  masking.py        MDLM's absorbing process, α_t = 1 − t (methods.md §2)
  gaussian_flow.py  Gaussian → one-hot flow and its two-time flow map, the FLM/FMLM/FMLM+ pair kinds (methods.md §3–4)
  bridge.py         the Brownian bridge on embeddings between [MASK] and the token (MLFM, methods.md §6)
"""

from flowlm.processes.base import NoisedBatch, NoiseProcess

__all__ = ["NoisedBatch", "NoiseProcess"]
