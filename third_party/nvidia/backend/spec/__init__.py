"""NVIDIA spec: capability-aware launch parameters for tritonspec's kernels, on the stock CUDA backend.

No second CUDA backend and no language or compiler hooks: kernels that do not ask for a config
compile exactly as with stock Triton. ``kernel_config`` / ``attention_config`` return None (the
op's own default) where we have no better choice; ``attention_forward`` runs Hopper's
warp-specialized Gluon forward where it was measured faster and declines everywhere else.
"""
from .attention_sm90 import attention_forward
from .configs import attention_config, kernel_config

_WHERE = "real"  # runs on NVIDIA GPUs through the stock CUDA backend

__all__ = ["kernel_config", "attention_config", "attention_forward"]
