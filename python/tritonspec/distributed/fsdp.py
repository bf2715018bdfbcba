"""FSDP2 (``torch.distributed.fsdp.fully_shard``) applied the usual way, aware of expert parallelism.

Why a helper at all: the common recipe (each decoder layer, then the root, so a layer's parameters are
gathered just before it runs) is a few lines, but an expert-parallel model needs two more things FSDP2 cannot
guess. Its experts are distinct per rank of the expert dimension, so they must be sharded only over the
*other* mesh dimensions; and each rank's experts collect gradients from the tokens of the whole expert group,
so their gradients are divided by the full mesh size (``set_gradient_divide_factor``), exactly as FSDP2
averages every other gradient over the ranks. Kernelized modules need nothing: FSDP2 hands their forwards
plain, unsharded tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def _default_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    device = "cuda" if torch.cuda.is_available() and dist.get_backend() == "nccl" else "cpu"
    return init_device_mesh(device, (dist.get_world_size(),))


def _decoder_layers(model: nn.Module) -> list[nn.Module]:
    """transformers' decoder layers (the classes a model declares in ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def fully_shard_model(
    model: nn.Module, mesh=None, *, mp_policy=None, reshard_after_forward: bool = True, ep_dim: str = "ep"
) -> nn.Module:
    """``fully_shard`` every decoder layer, then ``model``; returns ``model`` (now an ``FSDPModule``).

    ``mesh``: a 1-D DeviceMesh (default: every rank), or, for a model made expert-parallel over
    ``mesh[ep_dim]``, the 2-D (or larger) mesh holding that dimension: the experts are then sharded over the
    other dimensions (size 1 is fine), everything else over all of them. ``mp_policy``: FSDP2's
    ``MixedPrecisionPolicy``, for every group.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .expert_parallel import is_expert_parallel

    mesh = _default_mesh() if mesh is None else mesh
    kwargs = dict(mp_policy=mp_policy or MixedPrecisionPolicy(), reshard_after_forward=reshard_after_forward)
    experts = [m for m in model.modules() if is_expert_parallel(m)]
    if experts:
        names = mesh.mesh_dim_names or ()
        if mesh.ndim < 2 or ep_dim not in names:
            raise ValueError(
                f"fully_shard_model: the model is expert-parallel; pass the mesh with its expert "
                f"dimension {ep_dim!r} and the data-parallel one(s), e.g. init_device_mesh(device, "
                f"(dp, ep), mesh_dim_names=('dp', '{ep_dim}')) with dp = 1 when every rank holds "
                f"different experts (got mesh dims {names or mesh.ndim})"
            )
        others = tuple(n for n in names if n != ep_dim)
        expert_mesh = mesh[others] if len(others) == 1 else mesh[others]._flatten()
        for module in experts:
            fully_shard(module, mesh=expert_mesh, **kwargs)
            module.set_gradient_divide_factor(float(mesh.size()))
    dense_mesh = mesh if mesh.ndim == 1 else mesh._flatten()
    for layer in _decoder_layers(model):
        fully_shard(layer, mesh=dense_mesh, **kwargs)
    fully_shard(model, mesh=dense_mesh, **kwargs)
    return model
