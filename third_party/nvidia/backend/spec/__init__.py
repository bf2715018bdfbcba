"""NVIDIA spec: capability-aware launch parameters for tritonspec's kernels, on the stock CUDA backend.

No second CUDA backend and no language or compiler hooks: kernels that do not ask for a config
compile exactly as with stock Triton. Only ``kernel_config`` / ``attention_config`` are
specialized, and both return None (the op's own default) where we have no better choice.
"""
from .configs import attention_config, kernel_config

_WHERE = "real"  # runs on NVIDIA GPUs through the stock CUDA backend

__all__ = ["kernel_config", "attention_config"]
