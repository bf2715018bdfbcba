"""NVIDIA spec: capability-aware launch parameters for tritonspec's kernels, on the stock CUDA backend.

No second CUDA backend and no language or compiler hooks: kernels that do not ask for a config
compile exactly as with stock Triton. ``kernel_config`` / ``attention_config`` return None (the
op's own default) where we have no better choice; ``attention_forward`` and ``attention_backward``
run Hopper's warp-specialized Gluon kernels where they were measured faster and decline everywhere else.
"""
from .attention_sm90 import attention_backward, attention_forward
from .configs import attention_config, kernel_config

_WHERE = "real"  # runs on NVIDIA GPUs through the stock CUDA backend

__all__ = ["kernel_config", "attention_config", "attention_forward", "attention_backward"]
