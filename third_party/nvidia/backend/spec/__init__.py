"""NVIDIA spec: capability-aware launch parameters for tritonspec's kernels, on the stock CUDA backend.

No second CUDA backend and no language or compiler hooks: kernels that do not ask for a config
compile exactly as with stock Triton. ``kernel_config`` (a table by kernel, ``configs.py``) returns
None (the op's own default) where we have no better choice; ``attention_forward`` and ``attention_backward``
run Hopper's warp-specialized Gluon kernels where they were measured faster and decline everywhere else,
as ``moe_experts_gemm`` and ``moe_weight_grad`` do with Hopper's grouped GEMMs of the experts.

Cheap to import: it is loaded on a process's first CUDA compile, so the Gluon kernels (and the
torch they need) are imported on the first attention call, not here.
"""

from tritonspec import BackendInfo, CheckTarget

from .configs import kernel_config

backend_info = BackendInfo(
    runs="real",
    targets=("cuda",),
    devices=("cuda",),
    check_targets=(
        CheckTarget("sm90", ("cuda", 90, 32), shared_memory=232448, registers=255, units=132, part="H100 SXM"),
        CheckTarget("sm80", ("cuda", 80, 32), shared_memory=166912, registers=255, units=108, part="A100"),
    ),
    note="NVIDIA GPUs through the stock CUDA backend",
)


def attention_forward(q, k, v, o, lse, causal, scale, *, bounds):
    """Hopper's warp-specialized forward, or False to keep the portable kernel."""
    from .attention_sm90.launchers import attention_forward as forward

    return forward(q, k, v, o, lse, causal, scale, bounds=bounds)


def attention_backward(q, k, v, do, dk, dv, lse, causal, scale, *, bounds):
    """Hopper's one-pass warp-specialized backward as ``run(dqa, delta)``, or False to keep the portable
    kernels (asked before the op allocates the dQ accumulator that only a run needs)."""
    from .attention_sm90.launchers import attention_backward as backward

    return backward(q, k, v, do, dk, dv, lse, causal, scale, bounds=bounds)


def moe_experts_gemm(b, c, block_expert, *, gate_up, gu=None):
    """Hopper's grouped GEMM of the experts as ``run(a)``, or None to keep the portable kernels (asked
    before the op gathers the sorted rows that only a run reads)."""
    from .moe_sm90 import moe_experts_gemm as gemm

    return gemm(b, c, block_expert, gate_up=gate_up, gu=gu)


def moe_weight_grad(lhs, rhs, dw, row_pair, expert_start, expert_rows, block_m, *, gather_l, gather_r, top_k):
    """Hopper's weight gradients of the experts (gathering the tokens' rows as it goes), or False to keep the
    portable kernel."""
    from .moe_sm90 import moe_weight_grad as weight_grad

    return weight_grad(
        lhs, rhs, dw, row_pair, expert_start, expert_rows, block_m, gather_l=gather_l, gather_r=gather_r, top_k=top_k
    )


__all__ = [
    "backend_info",
    "kernel_config",
    "attention_forward",
    "attention_backward",
    "moe_experts_gemm",
    "moe_weight_grad",
]
