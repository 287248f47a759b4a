"""Pretrained models from outside the suite (docs/pretrained.md): hub names or paths resolved through the Hugging
Face cache (``hub``), readers of foreign checkpoint layouts into the suite's DiT (``formats`` registry, ``mdlm``),
loaders of the LLaMA-family MDMs into ``flowlm.backbones.llama`` (``smdm``, ``llada``, ``dream``) and the suite's
own portable folder (``export``)."""

from flowlm.pretrained import mdlm  # noqa: E402,F401 - registers MDLM's readers in formats.FORMATS
