"""Run MoE models larger than GPU memory: experts off the GPU, KTransformers-style.

``offload_experts(model, gpu_budget="16GiB")`` replaces every fused experts module (the kernel table's
``moe`` kernel recognizes them) with an :class:`OffloadedExperts` that keeps its weights in host memory
(``storage="cpu"``, page-locked in place) or in the model's ``save_pretrained`` checkpoint (``storage="disk"``,
read by byte range), holds ``experts_per_layer`` of them in fixed GPU slots chosen by a policy, prefetches
the next layer's experts with its router, and computes what is missing on the CPU when that beats
copying it. It is one YAML rule, applied through :func:`tritonspec.nn.apply_rules`; a rule file can say
the same thing::

    - match: {kernel: moe}
      replace:
        class: tritonspec.nn.offload.OffloadedExperts
        kwargs: {experts_per_layer: 16, generate_device: cpu, prefill_device: cuda, policy: lru}

The returned :class:`OffloadHandle` (or ``offload_handle(model)`` after a rule file) reports hits,
misses, bytes moved and read, prefetch recall and CPU time, and ``revert()`` puts the original experts
back with their weights on their devices.

What it guarantees about weights: the model's own weights are the truth. The host tier keeps the very tensors
the model held (a GPU's moved, only meta ones read from ``checkpoint``); the disk tier serves the checkpoint's
experts only where they equal the model's bit for bit, and the others from a temporary file of its own. So the
offloaded model computes with exactly the model's weights, ``state_dict()``/``save_pretrained`` write them in
full, and a revert restores them bit for bit as plain contiguous tensors. Everything (arguments, device, every
expert tensor, the checkpoint's files and tensors) is checked before the first layer changes, and an error
part-way leaves the model as it was.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from .. import engine
from ..rules import apply_rules, shown
from ..detectors import is_fused_experts
from .cache import POLICIES
from .checkpoint import Checkpoint
from .offloaded import CPU_COMPUTE, STORAGES, OffloadedExperts, Stats, plan_offload

__all__ = ["offload_experts", "offload_handle", "OffloadHandle", "OffloadedExperts", "parse_bytes"]

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_bytes(value) -> int:
    """``16 * 2**30``, ``"16GiB"``, ``"500 MB"`` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", value, re.I) if isinstance(value, str) else None
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"gpu_budget: expected a positive byte count such as 16GiB or 500MB, got {shown(value)}")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])


class OffloadHandle:
    """What :func:`offload_experts` did to a model: its statistics, and how to undo it."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.layers = [(path, m) for path, m in model.named_modules() if isinstance(m, OffloadedExperts)]
        if not self.layers:
            raise ValueError("model: no offloaded experts in it (run offload_experts or a rule with OffloadedExperts)")

    def _live(self, what: str) -> None:
        if not self.layers or any(m.store is None for _, m in self.layers):
            raise RuntimeError(
                f"offload handle: {what} after the offload was reverted; the statistics went with the offloaded layers"
            )

    def stats(self) -> dict:
        """Totals over the layers: counters of :class:`Stats`, plus ``hit_rate``, ``prefetch_recall`` and
        ``bytes_read`` (from the checkpoint or the file of experts that differ from it, disk tier)."""
        self._live("stats()")
        total = Stats()
        for _, m in self.layers:
            m.count_steps()  # what compiled or captured steps counted on the device
            total.add(m.stats)
        out = asdict(total)
        served = total.hits + total.misses + total.cpu_experts + total.mapped
        out["hit_rate"] = total.hits / served if served else 0.0
        out["prefetch_recall"] = total.predicted / total.needed_after_guess if total.needed_after_guess else 0.0
        out["bytes_read"] = sum(m.store.bytes_read for _, m in self.layers)
        out["layers"] = len(self.layers)
        out["slots_per_layer"] = self.layers[0][1].cache.num_slots
        return out

    def reset_stats(self) -> None:
        self._live("reset_stats()")
        for _, m in self.layers:
            m.count_steps()
            m.stats = Stats()
            m.store.bytes_read = 0

    def revert(self) -> None:
        """Put the original experts modules back (their weights, bit for bit, on their original devices)."""
        for path, m in self.layers:
            parent_path, _, name = path.rpartition(".")
            parent = self.model.get_submodule(parent_path) if parent_path else self.model
            if not engine.restore(self.model, parent, name) and parent._modules.get(name) is m:
                raise RuntimeError(
                    f"{path}: the model has no record of this offload (tritonspec.nn.report(model) "
                    "lists what it has), so it cannot be reverted"
                )
        self.layers = []


def offload_handle(model: nn.Module) -> OffloadHandle:
    """The handle of a model whose experts were offloaded (by :func:`offload_experts` or a YAML rule)."""
    return OffloadHandle(model)


def offload_experts(
    model: nn.Module,
    *,
    gpu_budget: int | str | None = None,
    experts_per_layer: int | None = None,
    storage: str = "cpu",
    checkpoint: str | Path | None = None,
    policy: str = "lru",
    prefetch: bool = True,
    cpu_compute="auto",
    cpu_threads: int | None = None,
    device: torch.device | str | None = None,
) -> OffloadHandle:
    """Offload every fused experts module of ``model``; returns its :class:`OffloadHandle`.

    Args:
        gpu_budget: bytes of GPU slots for all layers together (``"16GiB"``); or ``experts_per_layer``.
        storage: ``"cpu"`` (host memory, pinned when CUDA is present) or ``"disk"`` (``checkpoint``).
        checkpoint: a ``save_pretrained`` directory or ``.safetensors`` file; required for ``"disk"``, and
            the source of weights still on the meta device for ``"cpu"``.
        policy: ``"lru"``, ``"lfu"`` or ``"frequency"`` (static placement by measured frequency).
        prefetch: guess the next layer's experts with its router and copy them ahead.
        cpu_compute: ``"auto"`` (the measured cost model picks per batch), True (missing experts always
            on the CPU), False (always copied).
        device: where the rest of the model goes afterwards (``model.to(device)``; the experts stay put).

    Nothing is changed when an argument is wrong or a module cannot be offloaded: every check (the
    device first) runs before the first layer changes, and a failure part-way undoes what was done.
    """
    device = _device(device)
    if policy not in POLICIES:
        raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {shown(policy)}")
    if storage not in STORAGES:
        raise ValueError(f"storage: expected one of {', '.join(STORAGES)}, got {shown(storage)}")
    if cpu_compute not in CPU_COMPUTE or not isinstance(cpu_compute, (str, bool)):
        raise ValueError(f"cpu_compute: expected 'auto', True or False, got {shown(cpu_compute)}")
    if (gpu_budget is None) == (experts_per_layer is None):
        raise ValueError("gpu_budget / experts_per_layer: give exactly one")
    found = [(p, m) for p, m in model.named_modules() if not isinstance(m, OffloadedExperts) and is_fused_experts(m)]
    if not found:
        raise ValueError("model: no fused MoE experts module the Triton kernel computes was found")
    if checkpoint is not None:
        checkpoint = Checkpoint(checkpoint)  # a missing or malformed file fails here, before anything changes
    plans = [plan_offload(m, storage=storage, checkpoint=checkpoint, path=p) for p, m in found]
    if gpu_budget is not None:
        budget = parse_bytes(gpu_budget)
        per_expert = plans[0].layout.nbytes
        experts_per_layer = budget // (per_expert * len(found))
        if experts_per_layer < 1:
            raise ValueError(
                f"gpu_budget: {budget} bytes is less than one expert per layer ({per_expert} bytes per "
                f"expert, {len(found)} offloaded layers need {per_expert * len(found)})"
            )
    rule = {
        "match": {"kernel": "moe"},
        "replace": {
            "class": f"{OffloadedExperts.__module__}.OffloadedExperts",
            "kwargs": dict(
                experts_per_layer=experts_per_layer,
                storage=storage,
                checkpoint=checkpoint,
                policy=policy,
                prefetch=prefetch,
                cpu_compute=cpu_compute,
                cpu_threads=cpu_threads,
            ),
        },
    }
    made = apply_rules(model, [rule])
    handle = OffloadHandle(model)
    if device is not None:
        try:
            _move(model, device)
        except BaseException:
            mine = set(made.paths())
            handle.layers = [(p, m) for p, m in handle.layers if p in mine]
            handle.revert()
            raise
    return handle


def _device(device) -> torch.device | None:
    """``device=`` checked before anything changes: a device torch knows, of a kind offloading runs on, present."""
    if device is None:
        return None
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"device: expected a device such as 'cuda', 'cuda:1' or 'cpu', got {shown(device)}") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = "torch was built without CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ValueError(f"device: {device!r} asks for CUDA, but {why}; use device='cpu' or run where a GPU is")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {device!r}, but only {torch.cuda.device_count()} CUDA devices are visible")
    elif dev.type != "cpu":
        raise ValueError(f"device: offloaded experts run on 'cpu' or 'cuda', got {shown(device)}")
    return dev


def _move(model: nn.Module, device: torch.device) -> None:
    """``model.to(device)``, all or nothing: when it fails (out of GPU memory) every tensor goes back where it was."""
    where = [
        (mod, name, t.device)
        for mod in model.modules()
        for tensors in (mod._parameters, mod._buffers)
        for name, t in tensors.items()
        if t is not None
    ]
    try:
        model.to(device)
    except BaseException:
        for mod, name, dev in where:
            if name in mod._parameters and mod._parameters[name] is not None:
                p = mod._parameters[name]
                if p.device != dev:
                    p.data = p.data.to(dev)
            elif mod._buffers.get(name) is not None and mod._buffers[name].device != dev:
                mod._buffers[name] = mod._buffers[name].to(dev)
        raise
