"""Gaussian → one-hot flow (t = 0 noise, t = 1 data) and its two-time flow map (methods.md §3–4).

The recipe built on them (pair kinds, time and context-rate draws, semigroup targets, the loss) is
flowlm/objectives/fmlm_plus.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from flowlm.processes.base import NoisedBatch, NoiseProcess, stratified_uniforms


def one_hot(ids: Tensor, num_classes: int) -> Tensor:
    """Float one-hot vectors (…, num_classes) of ids, zero for ids outside [0, num_classes). By comparison:
    ``F.one_hot`` range-checks the ids by reading their min and max back to the host (two syncs per call on a GPU,
    every round of a sampler)."""
    return (ids[..., None] == torch.arange(num_classes, device=ids.device)).float()


def noisy_state(onehot: Tensor, noise: Tensor, time: Tensor) -> Tensor:
    """x_t = (1 − t)·ε + t·onehot(y), with per-token times (B, L)."""
    time = time[..., None].to(onehot.dtype)
    return (1 - time) * noise + time * onehot


STATE_SPACES = ("auto", "onehot", "embedding")


class OneHotSpace:
    """Flow states over the vocabulary, x ∈ R^{L×|V|} (the released code's representation; the network projects
    them, h = x·E). Noise: ε ~ N(0, I_|V|) drawn in float64 (methods.md §9), used in float32."""

    embedded = False

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @property
    def width(self) -> int:
        """|V|: the dimension of the draws ε."""
        return self.vocab_size

    def noise(self, shape: tuple[int, int], generator: torch.Generator | None, device) -> Tensor:
        """ε (B, L, |V|)."""
        return torch.randn((*shape, self.vocab_size), generator=generator, device=device, dtype=torch.float64).float()

    def project(self, z: Tensor) -> Tensor:
        """Standard normal draws ε (…, |V|) as noise: ε itself."""
        return z

    def data(self, tokens: Tensor) -> Tensor:
        """onehot(y) (B, L, |V|)."""
        return one_hot(tokens, self.vocab_size)

    def lift(self, probs: Tensor) -> Tensor:
        """A point of the simplex (a denoiser output δ) as a state: δ itself."""
        return probs


class EmbeddingSpace:
    """Flow states as the network reads them, h = x·E ∈ R^{L×d}, for a vocabulary larger than the width.

    Every state the flow models build is linear in noise, one-hot rows and denoiser outputs, so it can be carried
    projected: onehot(y)·E = E[y], δ·E (``lift``), and the noise ε·E with ε ~ N(0, I_|V|) is N(0, EᵀE): it has the
    law of z·R with z ~ N(0, I_d) and RᵀR = EᵀE (R from a Cholesky factor, computed in float64; differentiable, so
    a training loss keeps unbiased gradients with respect to E). A draw then costs O(L·d²) instead of O(L·|V|), and
    the network skips its (B·L) × |V| × d input product. Exact in distribution, not in the random stream: the
    one-hot space reproduces the released code's draws. EᵀE is singular when |V| < d: there the one-hot space is
    also the cheaper one (``choose_space``).
    """

    embedded = True

    def __init__(self, embeddings: Tensor) -> None:
        if embeddings.dim() != 2 or embeddings.shape[0] < embeddings.shape[1]:
            raise ValueError(
                f"the embedding space needs an embedding matrix (|V|, d) with |V| ≥ d, got {tuple(embeddings.shape)}"
            )
        self.embeddings = embeddings
        self.vocab_size = embeddings.shape[0]
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            e64 = embeddings.double()
            gram = e64.mT @ e64
        # R (d, d), upper: RᵀR = EᵀE. Without the error check: raising would read the status back from the device;
        # EᵀE is positive definite for any E of full column rank (every initialised or trained embedding here).
        self.factor = torch.linalg.cholesky_ex(gram, check_errors=False).L.mT

    @property
    def width(self) -> int:
        """d: the dimension of the draws z."""
        return self.factor.shape[0]

    def noise(self, shape: tuple[int, int], generator: torch.Generator | None, device) -> Tensor:
        """z·R (B, L, d), z ~ N(0, I_d) drawn in float64: the law of ε·E."""
        return self.project(torch.randn((*shape, self.width), generator=generator, device=device, dtype=torch.float64))

    def project(self, z: Tensor) -> Tensor:
        """z·R for standard normal draws z (…, d): noise of the law of ε·E (differentiable in E through R)."""
        with torch.autocast(device_type=z.device.type, enabled=False):
            return (z.to(self.factor.dtype) @ self.factor).to(self.embeddings.dtype)

    def data(self, tokens: Tensor) -> Tensor:
        """E[y] (B, L, d) = onehot(y)·E."""
        return self.embeddings[tokens]

    def lift(self, probs: Tensor) -> Tensor:
        """δ·E (B, L, d): one (B·L) × |V| × d product (what a flow-map sub-step needs by its definition), in the
        embedding's precision as the network's own input product (``input_fp32``, the released code)."""
        with torch.autocast(device_type=probs.device.type, enabled=False):
            return probs.to(self.embeddings.dtype) @ self.embeddings


def choose_space(kind: str, embeddings: Tensor) -> OneHotSpace | EmbeddingSpace:
    """The state space of a flow model with input embedding E (|V|, d): ``auto`` takes the embedding space when
    |V| > d (text vocabularies: its draws and input are d-dimensional) and the one-hot space otherwise (Sudoku:
    there the direct draw is cheaper and EᵀE is singular); ``onehot`` / ``embedding`` force one."""
    if kind not in STATE_SPACES:
        raise ValueError(f"state_space must be one of {STATE_SPACES}, got {kind!r}")
    vocab, width = embeddings.shape
    if kind == "embedding" or (kind == "auto" and vocab > width):
        return EmbeddingSpace(embeddings)
    return OneHotSpace(vocab)


def flow_map(x: Tensor, delta: Tensor, s: Tensor, t: Tensor) -> Tensor:
    """X_{s,t}(x) = ((1−t)/(1−s))·x + ((t−s)/(1−s))·δ_{s,t}(x); per-token (B, L) times.

    Tokens at s = 1 (prompt, context, committed) are already data and stay where they are: X_{1,1} = identity.
    """
    s, t = s[..., None].to(x.dtype), t[..., None].to(x.dtype)
    done = s >= 1
    denom = torch.where(done, torch.ones_like(s), 1 - s)
    out = ((1 - t) / denom) * x + ((t - s) / denom) * delta
    return torch.where(done, x, out)


@dataclass(frozen=True)
class GaussianFlowProcess(NoiseProcess):
    """The flow's state operations on one-hot vectors of a ``vocab_size`` vocabulary: the noisy state and the flow
    map (an objective calls these two). With an embedding ``space`` the same operations act on h = x·E: clean rows
    E[y], noise z·R, the flow map's δ lifted to δ·E (exact in law, see ``EmbeddingSpace``)."""

    vocab_size: int
    space: EmbeddingSpace | None = None

    @property
    def states(self) -> OneHotSpace | EmbeddingSpace:
        """The state space: over the vocabulary unless an embedding ``space`` is given."""
        return self.space if self.space is not None else OneHotSpace(self.vocab_size)

    @property
    def embedded(self) -> bool:
        """Whether states are h = x·E (the network reads them with ``embedded=True``)."""
        return self.space is not None

    def time_uniforms(self, n: int, generator: torch.Generator | None) -> Tensor:
        """One uniform per stratum [i/n, (i + 1)/n), in random order (the released code's antithetic sampling)."""
        return stratified_uniforms(n, generator=generator, shuffle=True)

    def time_quantile(self, u: Tensor) -> Tensor:
        """t ~ U(0, 1): the flow's time (FLM; the diagonal pairs s = t of FMLM+)."""
        return u

    def draw(self, tokens: Tensor, generator: torch.Generator | None, embeddings: Tensor | None) -> Tensor:
        """ε ~ N(0, I) of ``draw_shape`` (float32)."""
        return torch.randn(self.draw_shape(tokens), generator=generator, device=tokens.device)

    def noise_from(
        self, tokens: Tensor, times: Tensor, keep: Tensor, draws: Tensor, embeddings: Tensor | None, mask_id: int | None
    ) -> NoisedBatch:
        """x_t = (1 − t)·ε + t·onehot(y) off ``keep``, the exact one-hot on it; times (B, L) per token or (B,). In the
        embedding space: (1 − t)·z·R + t·E[y], the draws being z (B, L, d)."""
        space = self.states
        clean = space.data(tokens)
        times = times if times.dim() == tokens.dim() else times[:, None]
        noisy = noisy_state(clean, space.project(draws), times)
        return NoisedBatch(state=torch.where(keep[..., None], clean, noisy), clean=clean, noised=~keep)

    def draw_shape(self, tokens: Tensor) -> tuple[int, ...]:
        """The shape of the standard normal draws ``noise`` reads: (B, L, |V|), or (B, L, d) in the embedding space."""
        return (*tokens.shape, self.states.width)

    def flow_map(self, x: Tensor, delta: Tensor, s: Tensor, t: Tensor) -> Tensor:
        """X_{s,t}(x) (``flow_map``), δ a point of the simplex (lifted to δ·E in the embedding space)."""
        return flow_map(x, self.states.lift(delta), s, t)
