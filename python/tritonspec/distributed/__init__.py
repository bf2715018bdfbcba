"""tritonspec.distributed: tritonspec's kernels and models on PyTorch's own distributed stack.

Why a package and not a communication layer: everything here runs on ``torch.distributed`` (FSDP2's
``fully_shard``, ``DeviceMesh``, ``all_to_all_single``; NCCL on GPUs, gloo on CPU). Our ops take the plain
tensors FSDP2 hands a module's forward, so kernelized models (``kernelize``, ``apply_available_kernels``,
``apply_rules``) shard unchanged; what this package adds is what FSDP2 does not do for MoE:

- :func:`expert_parallel`: each rank of one mesh dimension keeps E/ep experts; tokens go to the rank owning
  their expert after routing and come back for the weighted combine (:func:`dispatch`, :func:`combine`).
- :func:`fully_shard_model`: FSDP2 per decoder layer then the root, with expert-parallel experts sharded over
  the mesh dimensions other than the expert one and their gradients averaged like everyone else's.

``tritonspec.nn`` may import this package; ``tritonspec.ops`` never does.
"""

from .expert_parallel import DispatchPlan, combine, dispatch, expert_parallel, is_expert_parallel
from .fsdp import fully_shard_model

__all__ = ["expert_parallel", "is_expert_parallel", "dispatch", "combine", "DispatchPlan", "fully_shard_model"]
