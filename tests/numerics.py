"""Checking kernels against their float64 references, shared by the tests and the benchmarks.

Tolerances follow an error model instead of being tuned to pass: the kernels compute in float32
and round to the output dtype once, or twice where Hugging Face rounds an intermediate (the
normalized x before the weight, silu before the multiply, x + residual). So an element may be off
by a few units of roundoff ``u`` of its dtype relative to its own size, plus the same relative to
the largest element where a sum cancels (dx of RMSNorm, dW partial sums, rotations).
"""

from __future__ import annotations

import contextlib

import torch

# rtol per output dtype: 4u for the half types (two roundings plus float32 noise); float32 results
# carry float32 reduction error over up to ~1e5 terms, far below 1e-5 relative.
RTOL = {torch.float16: 4 * 2.0**-11, torch.bfloat16: 4 * 2.0**-8, torch.float32: 1e-5}


def assert_close(
    actual: torch.Tensor,
    expected: torch.Tensor,
    name: str,
    dtype: torch.dtype | None = None,
    scale: float | None = None,
):
    """``actual`` (any dtype) matches the float64 ``expected`` within the model above; NaN never matches.

    ``scale`` overrides the magnitude the absolute tolerance is relative to: for a sum over rows
    (a weight gradient) pass the largest sum of absolute terms, since the rounding of each term
    survives cancellation in the result.
    """
    dtype = dtype or actual.dtype
    rtol = RTOL[dtype]
    expected = expected.detach().double()
    if scale is None:
        scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.detach().double(),
        expected,
        rtol=rtol,
        atol=rtol * max(scale, 1e-30),
        msg=lambda m: f"{name} ({dtype}): {m}",
    )


@contextlib.contextmanager
def poisoned_allocations():
    """``torch.empty`` / ``torch.empty_like`` return NaN-filled tensors, so an output element that a
    kernel never writes shows up as NaN in the comparison instead of passing by luck."""
    empty, empty_like = torch.empty, torch.empty_like

    def poison(t):
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(torch.iinfo(t.dtype).max)
        return t

    torch.empty = lambda *a, **k: poison(empty(*a, **k))
    torch.empty_like = lambda *a, **k: poison(empty_like(*a, **k))
    try:
        yield
    finally:
        torch.empty, torch.empty_like = empty, empty_like
