"""Loaders of public pretrained masked diffusion models into the suite's backbones."""
