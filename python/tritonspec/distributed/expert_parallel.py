"""Expert parallelism for transformers' fused MoE experts, on ``torch.distributed.all_to_all_single``.

Why: the experts hold most of an MoE model's weights, and FSDP would all-gather every one of them on every
rank. Here each rank of the expert mesh dimension keeps a contiguous slice of E/ep experts for good; after
routing, every (token, expert) pair travels to the rank owning its expert (:func:`dispatch`), runs there as a
top-1 pair through the same experts function as a single GPU (``tritonspec_experts_forward``: the Triton
kernel, or transformers' ``grouped_mm`` where the kernel does not apply), and comes back to be weighted and
summed in a fixed order (:func:`combine`: a gather and a sum, no atomics, so results are deterministic).

The routing weights never leave their rank: the remote experts compute unweighted outputs and the combine
applies the weights, so the router's gradient is computed where the router lives. Ids outside [0, E)
(transformers' expert-parallel sentinels) are dropped at dispatch: they contribute nothing. The sharded module
gets ``num_experts = E/ep``, transformers' own expert-parallel convention, so its ``grouped_mm`` path (and
anything reading ``num_experts``) treats ids ``>= E/ep`` as sentinels.

Gradients: a rank's experts collect the gradients of every token routed to them, from the whole expert group;
:func:`tritonspec.distributed.fully_shard_model` reduces them over the other mesh dimensions and averages
them like the rest of the model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

_STATE = "_tritonspec_expert_parallel"
_EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with its gradient: the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        out = grad.new_empty((sum(send_splits),) + tuple(grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return out, None, None, None


@dataclass
class DispatchPlan:
    """What :func:`combine` needs to bring a dispatch's results home.

    ``order``: the positions (in the flattened (T, k) pairs) of the pairs sent, sorted by destination rank,
    sentinels left out. ``send_splits``/``recv_splits``: rows sent to / received from each rank of the group.
    """

    order: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    tokens: int
    top_k: int
    group: object


def dispatch(
    hidden_states: torch.Tensor, top_k_index: torch.Tensor, num_experts: int, group=None
) -> tuple[torch.Tensor, torch.Tensor, DispatchPlan]:
    """Send each (token, expert) pair to the rank owning the expert; ``(rows, local ids, plan)`` received.

    Collective over ``group`` (every rank calls it). Rank ``r`` owns experts ``[r * E/ep, (r + 1) * E/ep)``.
    ``hidden_states`` (T, H), ``top_k_index`` (T, k) global ids; ids outside [0, E) are not sent. The rows
    received come source rank by source rank, each source's pairs in their (token, slot) order; the local ids
    are in [0, E/ep). Differentiable in ``hidden_states``.
    """
    ep = dist.get_world_size(group)
    if num_experts % ep:
        raise ValueError(f"dispatch: {num_experts} experts cannot be split evenly over {ep} ranks")
    per_rank = num_experts // ep
    tokens, top_k = top_k_index.shape
    ids = top_k_index.reshape(-1).long()
    valid = (ids >= 0) & (ids < num_experts)
    dest = torch.where(valid, torch.div(ids, per_rank, rounding_mode="floor"), ep)  # sentinels sort last
    counts = torch.bincount(dest, minlength=ep + 1)[:ep]
    order = torch.sort(dest, stable=True).indices[: int(counts.sum())]
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    send_splits, recv_splits = counts.tolist(), recv_counts.tolist()
    local_ids = ids[order] - dest[order] * per_rank
    recv_ids = local_ids.new_empty(sum(recv_splits))
    dist.all_to_all_single(recv_ids, local_ids, recv_splits, send_splits, group=group)
    rows = _AllToAll.apply(
        hidden_states[torch.div(order, top_k, rounding_mode="floor")], send_splits, recv_splits, group
    )
    return rows, recv_ids, DispatchPlan(order, send_splits, recv_splits, tokens, top_k, group)


def combine(expert_out: torch.Tensor, top_k_weights: torch.Tensor | None, plan: DispatchPlan) -> torch.Tensor:
    """Send :func:`dispatch`'s rows back and sum each token's pairs: ``out[t] = sum_j w[t, j] * y[t, j]``.

    Collective over the plan's group. ``expert_out`` holds one row per received row, in the order received;
    ``top_k_weights`` (T, k) (None: every weight 1). Sentinel pairs contribute zero. The sum runs over the k
    slots in order (a gather, then ``sum``): the same result on every run.
    """
    back = _AllToAll.apply(expert_out, plan.recv_splits, plan.send_splits, plan.group)
    pairs = plan.tokens * plan.top_k
    slot = torch.full((pairs,), back.shape[0], dtype=torch.long, device=back.device)  # sentinels: the zero row
    slot[plan.order] = torch.arange(back.shape[0], device=back.device)
    padded = torch.cat([back, back.new_zeros((1,) + tuple(back.shape[1:]))])
    per_pair = padded[slot].view(plan.tokens, plan.top_k, *back.shape[1:])
    if top_k_weights is None:
        return per_pair.sum(1)
    dtype = torch.promote_types(per_pair.dtype, top_k_weights.dtype)
    return (per_pair.to(dtype) * top_k_weights.to(dtype).unsqueeze(-1)).sum(1).to(expert_out.dtype)


def _forward(self, hidden_states, top_k_index, top_k_weights):
    """The expert-parallel forward of a fused experts module (transformers' experts-function signature)."""
    from ..nn.experts import tritonspec_experts_forward

    num_experts, group = getattr(self, _STATE)
    rows, ids, plan = dispatch(hidden_states, top_k_index, num_experts, group)
    ones = rows.new_ones((rows.shape[0], 1))
    out = tritonspec_experts_forward(self, rows, ids[:, None], ones)
    if rows.shape[0] == 0 and rows.requires_grad:  # keep the dispatch in the graph: its backward is collective
        out = out + rows.sum(0) * 0
    return combine(out, top_k_weights, plan)


def _gather_experts(module: nn.Module, names: list[str], had_count: bool, old_count, group, ep: int) -> None:
    """Undo :func:`expert_parallel` on one module (collective: every rank's slice comes back)."""
    for n in names:
        local = module._parameters[n].detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(ep)]
        dist.all_gather(parts, local, group=group)
        module._parameters[n] = nn.Parameter(torch.cat(parts), requires_grad=module._parameters[n].requires_grad)
    if had_count:
        module.num_experts = old_count
    else:
        del module.num_experts
    delattr(module, _STATE)


def is_expert_parallel(module: nn.Module) -> bool:
    return hasattr(module, _STATE)


def expert_parallel(model: nn.Module, mesh, mesh_dim: str | None = None) -> list[str]:
    """Shard every fused experts module of ``model`` over ``mesh[mesh_dim]`` (the whole ``mesh`` when it is
    1-D and ``mesh_dim`` is None); returns the paths sharded.

    Each rank keeps its contiguous slice of E/ep experts (the others are freed) and its forward becomes
    dispatch -> experts -> combine. Every rank of the group must call it, and every forward is collective.
    ``tritonspec.nn.revert(model)`` undoes it (collective too: the slices are all-gathered back).
    Compose with FSDP2 through :func:`tritonspec.distributed.fully_shard_model`.
    """
    from ..nn import engine
    from ..nn.detectors import is_fused_experts
    from ..nn.experts import dispatched, pinned

    ep_mesh = mesh if mesh_dim is None else mesh[mesh_dim]
    if ep_mesh.ndim != 1:
        raise ValueError(
            f"expert_parallel: name the expert dimension of the {ep_mesh.ndim}-D mesh "
            f"{ep_mesh.mesh_dim_names} (mesh_dim=...)"
        )
    group, rank, ep = ep_mesh.get_group(), ep_mesh.get_local_rank(), ep_mesh.size()
    found = [(p, m) for p, m in engine.iter_modules(model) if is_fused_experts(m) and not is_expert_parallel(m)]
    for path, module in found:  # every check before any change: a model is sharded whole or not at all
        if module.gate_up_proj.shape[0] % ep:
            raise ValueError(
                f"expert_parallel: {path} has {module.gate_up_proj.shape[0]} experts, not divisible "
                f"by the {ep} ranks of mesh dimension {mesh_dim or ep_mesh.mesh_dim_names}"
            )
    done = []
    for path, module in found:
        num_experts = module.gate_up_proj.shape[0]
        per_rank = num_experts // ep
        names = [n for n in _EXPERT_PARAMS if module._parameters.get(n) is not None]
        for n in names:
            full = module._parameters[n]
            local = full.detach()[rank * per_rank : (rank + 1) * per_rank].clone()
            module._parameters[n] = nn.Parameter(local, requires_grad=full.requires_grad)
        had_count = "num_experts" in vars(module)
        old_count = vars(module).get("num_experts")
        module.num_experts = per_rank
        setattr(module, _STATE, (num_experts, group))

        detail = f"experts {rank * per_rank}..{(rank + 1) * per_rank - 1} of {num_experts}"
        undo = functools.partial(_gather_experts, module, names, had_count, old_count, group, ep)
        engine.record_custom(
            model,
            module,
            _STATE,
            undo,
            path=path,
            what="experts",
            kernel="expert_parallel",
            source="distributed",
            detail=detail,
        )
        # sharded experts have no transformers implementation: switching experts_implementation away raises
        forward = _forward
        if dispatched(module):
            forward = pinned(_forward, module.config._experts_implementation, f"expert parallel, {detail}")
        engine.replace_forward(
            model, module, forward, path=path, kernel=engine.qualname(_forward), source="distributed", detail=detail
        )
        done.append(path)
    return done
