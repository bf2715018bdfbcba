"""Drop-in modules for ``LlamaRMSNorm`` and ``LlamaMLP`` backed by the tritonspec kernels.

State names match Hugging Face (``weight`` / ``variance_epsilon``; ``gate_proj`` / ``up_proj`` /
``down_proj``), so checkpoints load unchanged and either class can replace the original module.
"""

from __future__ import annotations

import math
import numbers
import reprlib

import torch
from torch import nn

from ..ops.rms_norm import rms_norm
from ..ops.swiglu import swiglu


class RMSNorm(nn.Module):
    """``LlamaRMSNorm(hidden_size, eps)``: fp32 statistics, output dtype promote(input, weight)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = _checked_eps(eps)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


def _checked_eps(eps) -> float:
    """``eps`` as a float, checked here because the kernel would take a wrong one silently or fail only at the
    first forward (rule files give it as data: YAML 1.1 reads ``1e-6`` as a string, ``1.0e-6`` as a float)."""
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        got = (
            f"the string {reprlib.repr(eps)} (YAML reads 1e-6 as a string; write 1.0e-6)"
            if isinstance(eps, str)
            else type(eps).__name__
        )
        raise TypeError(f"eps: expected a number, got {got}")
    try:
        value = float(eps)
    except OverflowError:  # an int too large for a float
        value = math.inf
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"eps: expected a finite number >= 0, got {value!r}")
    return value


class SwiGLUMLP(nn.Module):
    """``LlamaMLP``: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the fused SwiGLU kernel.

    The gate/up activations are created here and used only by the SwiGLU, so its backward writes
    their gradients into their storage (``in_place_backward``), two activation-sized buffers fewer
    at the peak; pass ``in_place_backward=False`` if a hook keeps those outputs.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, *, in_place_backward: bool = True):
        super().__init__()
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.in_place_backward = in_place_backward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = swiglu(self.gate_proj(x), self.up_proj(x), in_place_backward=self.in_place_backward)
        return self.down_proj(act)
