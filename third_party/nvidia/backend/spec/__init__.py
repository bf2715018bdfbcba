"""NVIDIA spec: capability-aware launch parameters for tritonspec's kernels, on the stock CUDA backend.

No second CUDA backend and no language or compiler hooks: kernels that do not ask for a config
compile exactly as with stock Triton. ``kernel_config`` (a table by kernel, ``configs.py``) returns
None (the op's own default) where we have no better choice; ``attention_forward`` and ``attention_backward``
run Hopper's warp-specialized Gluon kernels where they were measured faster and decline everywhere else.

Cheap to import: it is loaded on a process's first CUDA compile, so the Gluon kernels (and the
torch they need) are imported on the first attention call, not here.
"""

from tritonspec import BackendInfo

from .configs import kernel_config

backend_info = BackendInfo(
    runs="real",
    targets=("cuda",),
    devices=("cuda",),
    check_target=("cuda", 90, 32),
    note="NVIDIA GPUs through the stock CUDA backend",
)


def attention_forward(q, k, v, o, lse, causal, scale):
    """Hopper's warp-specialized forward, or False to keep the portable kernel."""
    from .attention_sm90.launchers import attention_forward as forward

    return forward(q, k, v, o, lse, causal, scale)


def attention_backward(q, k, v, do, dqa, dk, dv, lse, delta, causal, scale):
    """Hopper's one-pass warp-specialized backward, or False to keep the portable kernels."""
    from .attention_sm90.launchers import attention_backward as backward

    return backward(q, k, v, do, dqa, dk, dv, lse, delta, causal, scale)


__all__ = ["backend_info", "kernel_config", "attention_forward", "attention_backward"]
