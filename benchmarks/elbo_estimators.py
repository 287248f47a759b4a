"""The MDM ELBO estimators of the lm-eval model (flowlm/metrics/likelihood.py) against exact enumeration, on a tiny
MDM trained for seconds on a sharp Markov chain (so the network's predictions carry the structure a real model's do):
per continuation length n, the exact ELBO and, over seeds, the mean and sd of each estimator's estimate at S terms.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/elbo_estimators.py            # 30 seeds × 128 terms
"""

from __future__ import annotations

import argparse
import statistics

import torch

from flowlm.metrics.likelihood import mdm_elbo_exact, mdm_elbo_samples
from lightning_modules.mdm import MDMModule

BACKBONE = {"d_model": 64, "n_layers": 2, "n_heads": 4, "cond_dim": 16}


def markov_rows(n: int, length: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` sequences of a fixed sharp Markov chain over ``vocab`` tokens (each token's likely successor at ≈ 80 %)."""
    chain = torch.Generator().manual_seed(0)
    logits = torch.randn(vocab, vocab, generator=chain) + 4.0 * torch.eye(vocab).roll(1, 1)
    probs = logits.softmax(-1)
    rows = torch.empty(n, length, dtype=torch.long)
    rows[:, 0] = torch.randint(0, vocab, (n,), generator=generator)
    for i in range(1, length):
        rows[:, i] = torch.multinomial(probs[rows[:, i - 1]], 1, generator=generator).squeeze(-1)
    return rows


def trained_mdm(vocab: int = 8, length: int = 10, steps: int = 400, seed: int = 0) -> MDMModule:
    """A time-agnostic MDM (tiny DiT) trained ``steps`` AdamW steps of its ELBO loss on ``markov_rows``."""
    torch.manual_seed(seed)
    module = MDMModule(data_vocab_size=vocab, seq_len=length, backbone=BACKBONE, optim={})
    opt = torch.optim.AdamW(module.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        tokens = markov_rows(64, length, vocab, gen)
        batch = {"tokens": tokens, "prompt_mask": torch.zeros_like(tokens, dtype=torch.bool)}
        draws = {"t": module.process.sample_t(64, generator=gen), "u": torch.rand(tokens.shape, generator=gen)}
        loss = module.loss(batch, draws).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return module.eval()


def item(module: MDMModule, n: int, context: int = 2, seed: int = 99) -> tuple[torch.Tensor, ...]:
    """One held-out row: ``context`` pinned tokens, the next ``n`` scored, the rest of the row masked (the tail)."""
    tokens = markov_rows(1, module.seq_len, module.data_vocab_size, torch.Generator().manual_seed(seed))
    positions = torch.arange(module.seq_len)
    return tokens, (positions < context)[None], ((positions >= context) & (positions < context + n))[None]


def estimates(module: MDMModule, row, estimator: str, eps: float, samples: int, seeds: int) -> list[float]:
    """The estimate (the mean of ``samples`` terms) under each of ``seeds`` seeds."""
    model = module.denoiser()
    out = []
    for s in range(seeds):
        terms = mdm_elbo_samples(
            model, *row, samples=samples, generators=[torch.Generator().manual_seed(s)], estimator=estimator, eps=eps
        )
        out.append(float(terms.mean()))
    return out


ESTIMATORS = [("count", "count", 0.0), ("time, ε = 10⁻³ (default floor)", "time", 1e-3), ("time, ε = 0", "time", 0.0)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lengths", type=int, nargs="*", default=[1, 2, 4, 6, 8])
    args = ap.parse_args()
    torch.set_num_threads(1)
    module = trained_mdm(steps=args.steps)
    print(f"# ELBO estimators: {args.seeds} seeds × {args.samples} terms, tiny DiT MDM trained {args.steps} steps")
    print("| n scored | exact ELBO | " + " | ".join(f"{name}: mean ± sd" for name, _, _ in ESTIMATORS) + " |")
    print("|---|---|" + "---|" * len(ESTIMATORS))
    with torch.no_grad():
        for n in args.lengths:
            row = item(module, n)
            exact = float(mdm_elbo_exact(module.denoiser(), *row)[0])
            cells = []
            for _, estimator, eps in ESTIMATORS:
                got = estimates(module, row, estimator, eps, args.samples, args.seeds)
                cells.append(f"{statistics.mean(got):.3f} ± {statistics.stdev(got):.3f}")
            print(f"| {n} | {exact:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
