"""Argument checks shared by the ops: every error names the op and the argument.

Checks run before any reshaping or launching, so a wrong shape, dtype or device fails with a
message about the caller's tensor rather than with a Triton compile or pointer error.
"""

from __future__ import annotations

import sys

import torch

from ..devices import check_launchable

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DTYPE_NAMES = "float16, bfloat16 or float32"


def check_tensor(op: str, name: str, t, *, ndim: int | None = None, min_ndim: int = 1) -> torch.Tensor:
    """``t`` is a floating tensor of a supported dtype and rank, on a device Triton can run on."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(t).__name__}")
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
        check_not_dtensor(op, name, t)
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{op}: argument '{name}' has dtype {t.dtype}; expected {_DTYPE_NAMES}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{op}: argument '{name}' must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dim() < min_ndim:
        raise ValueError(f"{op}: argument '{name}' must have at least {min_ndim} dimension(s), got a scalar")
    check_launchable(op, name, t)
    return t


def check_not_dtensor(op: str, name: str, t) -> None:
    """Our kernels index raw memory: a DTensor's local shard is not the tensor the op computes on.

    FSDP2 hands a module's forward plain unsharded tensors, so a DTensor here is a layout we do not support
    (tensor parallelism, a DTensor the user built); every layout fails, Replicate included, so no result ever
    silently depends on one rank's shard.
    """
    if "torch.distributed.tensor" not in sys.modules:  # no DTensor can exist yet
        return
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        raise TypeError(
            f"{op}: argument '{name}' is a DTensor with placements {tuple(t.placements)} on mesh "
            f"{t.device_mesh.mesh_dim_names or tuple(t.device_mesh.shape)}; tritonspec ops take plain "
            "tensors: shard with FSDP2 (fully_shard hands the forward plain tensors), or pass "
            "t.full_tensor() (the whole tensor) or t.to_local() (this rank's shard)"
        )


def check_same_device(op: str, **tensors: torch.Tensor) -> None:
    (ref_name, ref), *rest = tensors.items()
    for name, t in rest:
        if t.device != ref.device:
            raise ValueError(f"{op}: argument '{name}' is on {t.device} but '{ref_name}' is on {ref.device}")


def check_same_dtype(op: str, **tensors: torch.Tensor) -> None:
    (ref_name, ref), *rest = tensors.items()
    for name, t in rest:
        if t.dtype != ref.dtype:
            raise TypeError(f"{op}: argument '{name}' has dtype {t.dtype} but '{ref_name}' has {ref.dtype}")


def check_same_shape(op: str, **tensors: torch.Tensor) -> None:
    (ref_name, ref), *rest = tensors.items()
    for name, t in rest:
        if t.shape != ref.shape:
            raise ValueError(
                f"{op}: argument '{name}' has shape {tuple(t.shape)} but '{ref_name}' has {tuple(ref.shape)}"
            )


def check_eps(op: str, eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise TypeError(f"{op}: argument 'eps' must be a float, got {type(eps).__name__}")
    if not eps >= 0.0:
        raise ValueError(f"{op}: argument 'eps' must be >= 0, got {eps}")
    return float(eps)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 2-D (rows, last dim) tensor whose last dim has unit stride: a view when one exists.

    Rows may keep any stride (a slice of a fused projection stays a view); anything else is copied,
    since the kernels vectorize along the last dim.
    """
    n = t.shape[-1]
    try:
        rows = t.view(-1, n)
    except RuntimeError:
        rows = t.reshape(-1, n)
    if rows.stride(1) != 1 and n > 1:
        rows = rows.contiguous()
    return rows


def rows_of(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(t or a copy, row stride)`` for kernels that take rows as a pointer plus a row stride.

    A contiguous tensor needs no view (its row stride is its last dim); others go through
    ``as_rows``. Saves a view per tensor on the eager hot path.
    """
    if t.is_contiguous():
        return t, t.shape[-1]
    rows = as_rows(t)
    return rows, rows.stride(0)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dim is contiguous, else a contiguous copy."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()
