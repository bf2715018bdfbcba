"""LLM kernels written once in Triton: forward and backward, autograd-aware."""
from .attention import attention
from .rms_norm import add_rms_norm, rms_norm
from .rope import rope
from .swiglu import swiglu

__all__ = ["add_rms_norm", "attention", "rms_norm", "rope", "swiglu"]
