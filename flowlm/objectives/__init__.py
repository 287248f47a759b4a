"""Losses, pure: tensors (and the model as a callable where a loss calls it more than once) in, ``LossOutput`` out.

mdm.py        MDLM's SUBS ELBO (methods.md §2)
fmlm_plus.py  FLM / FMLM / FMLM+: the context set, semigroup self-distillation, MDM distillation (methods.md §3–4)
flow.py       the soft-capped log δ head FLM/FMLM/FMLM+ share, and its in-place inference form (methods.md §1, §3)
mlfm.py       MLFM's masked cross-entropy (+ embedding MSE) (methods.md §6)
ar.py         next-token cross-entropy (the AR baseline)
"""

from flowlm.objectives.base import LossOutput

__all__ = ["LossOutput"]
