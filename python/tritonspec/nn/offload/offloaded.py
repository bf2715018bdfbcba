"""transformers' fused experts with their weights off the GPU: a slot cache, prefetch, and CPU compute.

:class:`OffloadedExperts` takes the place of one layer's experts module (same call signature:
``(hidden_states, top_k_index, top_k_weights)``). Per batch it reads the routed ids (one host sync, as
every offloading engine does), serves resident experts from their slots, and for the others either
copies them into slots on a side stream (events order the copies against the kernels; the host never
waits for a copy) or, where the cost model says the CPU is faster, computes them on the CPU from host
memory while the GPU computes the rest. Batches that need more experts than there are slots (prefill)
stream them in waves, each wave's copies overlapping the previous wave's kernel. The resident experts
run through ``ops.moe_experts`` with ids remapped to slots; experts outside the wave get a sentinel id,
which the kernel skips.

Prefetch (Eliseev and Mazur's speculative loading): while layer l runs, layer l+1's router is applied to
layer l's input, and the experts it picks start copying into layer l+1's slots. Which layer follows which
is learned from the order the modules run in, so the same code serves every model, through
``offload_experts`` or a YAML rule.

Compiled or graph-captured steps (:class:`~tritonspec.nn.GraphDecoder`, ``torch.compile``) make no host decision:
the GPU looks each routed expert up in a table (its slot, or its place in host memory mapped into the GPU's
address space) and the decode kernels read it where it lies, a missing one in place over the host link. Between
steps, :meth:`OffloadedExperts.between_steps` promotes the experts read in place most often into slots, copying
on the side stream while the next steps run. No CPU compute there: reading in place needs no host at all.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from ..experts import experts_kind
from ..rules import shown
from .cache import POLICIES, SlotCache, place_after_profile, serve
from .checkpoint import Checkpoint
from .host_compute import Costs, choose_cpu, measure, run_experts, torch_threads
from .storage import DiskStore, ExpertLayout, ExpertSources, HostStore, disk_store, host_store

STORAGES = ("cpu", "disk")
CPU_COMPUTE = ("auto", True, False)
_DEVICES = ("cpu", "cuda")
_STAGING_ROWS = 4  # pinned rows the disk tier reads into, in turn, before each copy to the GPU
# Batches of at most this many tokens are decode: cpu_compute="auto" weighs the CPU against copies for them
# (KTransformers' generate_device); larger ones are prefill and copy (its prefill_device).
DECODE_TOKENS = 16
# What a module holds for the device it runs on: made on first use (``_bind``), dropped by a revert, a
# ``load_state_dict`` and a deep copy (whose slots, events and streams would belong to the original).
_DEVICE_STATE = (
    "_slots",
    "_slot_views",
    "_slot_parts",
    "_cuda",
    "_ready",
    "_free",
    "_waited",
    "_seq",
    "_stream",
    "_staging",
    "_staging_events",
    "_staging_next",
    "_costs",
    "_tier",
    "_uses",
    "_far",
    "_far_error",
    "_shown",
    "_pending",
    "_heat",
)


@dataclass
class Stats:
    """Counters of one offloaded layer; :meth:`OffloadHandle.stats` sums them."""

    batches: int = 0
    tokens: int = 0
    hits: int = 0  # routed experts found in a slot (prefetched ones included)
    misses: int = 0  # routed experts copied in on demand
    cpu_experts: int = 0  # routed experts computed on the CPU
    bytes_to_device: int = 0  # demand and prefetch copies
    prefetched: int = 0  # experts copied ahead of use
    predicted: int = 0  # of the experts a batch needed, how many the prefetch guessed
    needed_after_guess: int = 0  # experts needed by batches that had a guess
    cpu_s: float = 0.0  # host time in CPU expert compute
    mapped: int = 0  # routed experts a graph-captured step read in place from host memory
    bytes_mapped: int = 0  # what those reads moved over the host link
    promoted: int = 0  # experts copied into slots between graph-captured steps (their bytes: bytes_to_device)

    def add(self, other: "Stats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


_LAST = threading.local()  # the offloaded layer that ran last on this thread: how the layer order is learned


@dataclass(frozen=True)
class Plan:
    """What offloading one experts module needs, every check made (:func:`plan_offload`)."""

    kind: tuple
    layout: ExpertLayout
    num_experts: int
    sources: ExpertSources | None  # the checkpoint's tensors for what the store reads from it


def plan_offload(original: nn.Module, *, storage: str, checkpoint: Checkpoint | None, path: str = "") -> Plan:
    """Check everything offloading ``original`` depends on (the module, each expert tensor, the checkpoint's
    tensors it will read) without changing anything: :func:`offload_experts` runs it on every layer before the
    first one changes, and each :class:`OffloadedExperts` before it touches its original."""
    from ...distributed.expert_parallel import is_expert_parallel

    name = path or type(original).__name__
    if is_expert_parallel(original):
        raise ValueError(
            f"{name}: its experts are sharded by tritonspec.distributed.expert_parallel (this rank "
            "holds a slice of them; the others' tokens travel to other ranks); offloading would drop "
            "those tokens. Offload experts of a model that is not expert-parallel"
        )
    kind = experts_kind(original)
    if kind is None:
        raise TypeError(f"{name}: not a fused experts module the Triton kernel computes")
    layout = ExpertLayout.of(original, name)
    num_experts = original._parameters["gate_up_proj"].shape[0]
    # The disk tier reads every expert from the checkpoint (those that differ from it are kept apart); the host
    # tier only those that exist nowhere in memory.
    wanted = tuple(n for n, _ in layout.shapes if storage == "disk" or original._parameters[n].is_meta)
    sources = None
    if wanted:
        if checkpoint is None:
            if storage == "disk":
                raise ValueError(
                    "checkpoint: storage='disk' reads the experts from a save_pretrained checkpoint; "
                    "give its directory or .safetensors file"
                )
            raise ValueError(
                f"{name}: the experts' weights ({', '.join(wanted)}) are on the meta device; give "
                "checkpoint= to read them from"
            )
        sources = ExpertSources(checkpoint, path, layout, num_experts, wanted, kind[0] == "concatenated")
    return Plan(kind, layout, num_experts, sources)


def _router_of(parent: nn.Module | None, num_experts: int):
    gate = getattr(parent, "gate", None)
    weight = getattr(gate, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[0] == num_experts:
        return gate
    return None


class OffloadedExperts(nn.Module):
    """One layer's experts, stored off the GPU (see the module docstring).

    Build it with :func:`tritonspec.nn.offload.offload_experts`, or a YAML rule whose ``replace.class`` is
    this class; its ``kwargs`` are this constructor's (KTransformers' ``generate_device`` /
    ``prefill_device`` are understood too). The original module is kept, outside the module tree, and
    gets its weights back (on their device, bit for bit) when the replacement is reverted. Nothing of the
    original changes before every check passed and the store holds its weights.

    ``state_dict()`` holds the original's entries under their own names, every expert in full (read back from
    disk for the disk tier), so saving an offloaded model saves its weights; ``load_state_dict`` updates the
    host tier (the disk tier refuses). ``copy.deepcopy`` gives an independent module with no device state;
    pickling is refused (the weights live outside the module).
    """

    def __init__(
        self,
        original: nn.Module,
        *,
        experts_per_layer: int,
        storage: str = "cpu",
        checkpoint: str | Path | Checkpoint | None = None,
        policy: str = "lru",
        prefetch: bool = True,
        cpu_compute="auto",
        cpu_threads: int | None = None,
        router: nn.Module | None = None,
        path: str = "",
        spill: int | None = None,
    ):
        super().__init__()
        if storage not in STORAGES:
            raise ValueError(f"storage: expected one of {', '.join(STORAGES)}, got {shown(storage)}")
        if policy not in POLICIES:
            raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {shown(policy)}")
        if cpu_compute not in CPU_COMPUTE or not isinstance(cpu_compute, (str, bool)):
            raise ValueError(f"cpu_compute: expected 'auto', True or False, got {shown(cpu_compute)}")
        if isinstance(experts_per_layer, bool) or not isinstance(experts_per_layer, int) or experts_per_layer < 1:
            raise ValueError(f"experts_per_layer: expected a positive int, got {shown(experts_per_layer)}")
        if cpu_threads is not None and (
            isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int) or cpu_threads < 1
        ):
            raise ValueError(f"cpu_threads: expected a positive int or None, got {shown(cpu_threads)}")
        if storage == "disk" and checkpoint is None:
            raise ValueError(
                "checkpoint: storage='disk' reads the experts from a save_pretrained checkpoint; "
                "give its directory or .safetensors file"
            )
        ckpt = checkpoint if checkpoint is None or isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        plan = plan_offload(original, storage=storage, checkpoint=ckpt, path=path)
        self.kind, self.layout, self.num_experts = plan.kind, plan.layout, plan.num_experts
        self.path = path
        self.policy, self.prefetch = policy, bool(prefetch)
        self.cpu_compute, self.cpu_threads = cpu_compute, cpu_threads
        slots = min(experts_per_layer, self.num_experts)
        # The frequency policy's slots for misses: one batch's worth, but never more than half the slots.
        spill = spill if spill is not None else max(1, min(getattr(router, "top_k", None) or 1, slots // 2))
        self.cache = SlotCache(slots, self.num_experts, policy, spill)
        if storage == "disk":
            store = disk_store(original, self.layout, plan.sources, path)
        else:
            store = host_store(original, self.layout, plan.sources)
        # The original is unchanged up to here; from here on its experts' weights are the store's.
        self.store: HostStore | DiskStore | None = store
        # Not submodules: model.to() must leave the original and the router alone (state_dict: see below).
        self.__dict__["original"] = original
        self.__dict__["router"] = router
        self.__dict__["_home"] = {n: original._parameters[n].device for n, _ in self.layout.shapes}
        self._take_weights()
        self.stats = Stats()
        self._unbind()

    @classmethod
    def from_module(
        cls,
        original: nn.Module,
        *,
        parent: nn.Module | None = None,
        path: str = "",
        generate_device: str | None = None,
        prefill_device: str | None = None,
        **kwargs,
    ):
        """For YAML rules. KTransformers' ``generate_device``/``prefill_device`` say where missing experts run:
        cpu/cuda is the cost model's choice (decode on the CPU, prefill copied), cuda/cuda never the
        CPU, cpu/cpu always the CPU."""
        if generate_device is not None or prefill_device is not None:
            if "cpu_compute" in kwargs:
                raise ValueError("cpu_compute: give it or generate_device/prefill_device, not both")
            pair = tuple(
                (d or "cuda").split(":")[0] if isinstance(d, str) or d is None else None
                for d in (generate_device, prefill_device)
            )
            if any(d not in _DEVICES for d in pair) or pair == ("cuda", "cpu"):
                raise ValueError(
                    f"generate_device/prefill_device: expected cpu/cuda, cuda/cuda or cpu/cpu, got "
                    f"{shown(generate_device)}/{shown(prefill_device)}"
                )
            kwargs["cpu_compute"] = {("cpu", "cuda"): "auto", ("cuda", "cuda"): False, ("cpu", "cpu"): True}[pair]
        gate_up = original._parameters.get("gate_up_proj")
        num_experts = gate_up.shape[0] if isinstance(gate_up, torch.Tensor) and gate_up.dim() else 0
        return cls(original, router=_router_of(parent, num_experts), path=path, **kwargs)

    # ------------------------------------------------------------------------------------------
    # the original's weights: taken on offload, handed back on revert
    # ------------------------------------------------------------------------------------------
    def _take_weights(self) -> None:
        original = self.__dict__["original"]
        for n, _ in self.layout.shapes:
            p = original._parameters[n]
            if p.is_meta:
                continue
            if isinstance(self.store, HostStore):  # the same tensor where it was on the host, else the host copy
                p.data = self.store.parts[n]
            else:  # read back from disk on revert
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def release(self) -> None:
        """Give the original module its weights back (called on revert, and when a rule file fails part-way):
        the host tier's tensors as they are (no copy), moved back to the GPU they came from; the disk tier's
        read back, bit for bit what was taken; those on the meta device stay there. The parameters are plain
        contiguous tensors. Once is enough: a second call does nothing."""
        store = self.store
        if store is None:
            return
        self._drain()
        back = {}
        try:
            for n, device in self.__dict__["_home"].items():
                if device.type == "meta":
                    continue
                t = store.parts[n] if isinstance(store, HostStore) else store.read_part(n, self.num_experts)
                back[n] = t if device.type == "cpu" else t.to(device)
        except (OSError, RuntimeError, ValueError) as e:
            raise RuntimeError(f"{self.path}: its experts' weights could not be given back: {e}") from e
        original = self.__dict__["original"]
        for n, t in back.items():
            original._parameters[n].data = t
        store.release()
        self.store = None
        self._unbind()

    def _drain(self) -> None:
        """Wait for copies in flight out of the store (before its memory is handed back or overwritten)."""
        if self.__dict__.get("_cuda"):
            self._stream.synchronize()

    def _full_parts(self) -> dict[str, torch.Tensor]:
        """Every expert, as ``(E, ...)`` host tensors under the original's parameter names."""
        if isinstance(self.store, HostStore):
            return dict(self.store.parts)
        return {n: self.store.read_part(n, self.num_experts) for n, _ in self.layout.shapes}

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        if self.store is None:
            return
        full = self._full_parts()
        for name, value in self.__dict__["original"].state_dict(keep_vars=keep_vars).items():
            destination[prefix + name] = full.get(name, value)

    def _load_from_state_dict(
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ) -> None:
        if self.store is None:
            return
        original = self.__dict__["original"]
        targets = dict(original.state_dict(keep_vars=True))
        parts = self._full_parts() if isinstance(self.store, HostStore) else {}
        targets.update(parts)
        if strict:
            missing_keys.extend(prefix + n for n in targets if prefix + n not in state_dict)
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix) :] not in targets)
        incoming = {n: state_dict[prefix + n] for n in targets if prefix + n in state_dict}
        if not incoming:
            return
        if isinstance(self.store, DiskStore):
            error_msgs.append(
                f"{prefix[:-1]}: its experts are offloaded to disk (storage='disk'), read from the "
                "checkpoint; revert the offload, load the state dict, then offload again"
            )
            return
        for n, value in incoming.items():
            if value.shape != targets[n].shape:
                error_msgs.append(
                    f"size mismatch for {prefix}{n}: copying a param with shape {tuple(value.shape)} "
                    f"from checkpoint, the shape in current model is {tuple(targets[n].shape)}."
                )
                return
        self._drain()
        with torch.no_grad():
            for n, value in incoming.items():
                targets[n].copy_(value)
        self._unbind()  # the device slots hold the old weights

    def __deepcopy__(self, memo) -> "OffloadedExperts":
        """An independent copy: its own host tensors (the disk tier's checkpoint and row file shared: they are
        only read), its original's parameters views of them as here, and no device state (slots, events,
        streams, the learned next layer: they belong to this module)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        store = copy.deepcopy(self.store, memo)
        if isinstance(store, HostStore):
            for n, t in store.parts.items():
                p = self.__dict__["original"]._parameters[n]
                if type(p) is nn.Parameter and not p.is_meta and id(p) not in memo:
                    memo[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)  # Parameter's own would clone
        skip = {"store", "_device", "_next", "_guess", *_DEVICE_STATE}
        for k, v in self.__dict__.items():
            if k not in skip:
                new.__dict__[k] = copy.deepcopy(v, memo)
        new.store = store
        new._unbind()
        return new

    def __reduce_ex__(self, protocol):
        raise TypeError(
            f"{self.path or type(self).__name__}: a model with offloaded experts cannot be pickled "
            "(torch.save(model), pickle, multiprocessing): the experts' weights live outside the module, "
            "in host memory or a file. Save model.state_dict() (it holds every expert), or revert the "
            "offload first (offload_handle(model).revert())"
        )

    # ------------------------------------------------------------------------------------------
    # device state, made once per device
    # ------------------------------------------------------------------------------------------
    def _unbind(self) -> None:
        for k in _DEVICE_STATE:
            self.__dict__.pop(k, None)
        self._device: torch.device | None = None
        self._next: weakref.ref | None = None
        self._guess: set[int] | None = None

    def _bind(self, device: torch.device) -> None:
        if self._device == device:
            return
        S, numel = self.cache.num_slots, self.layout.numel
        self._slots = torch.empty((S, numel), dtype=self.layout.dtype, device=device)
        self._slot_views = self.layout.views(self._slots)
        self._slot_parts = [self.layout.row_parts(self._slots[s]) for s in range(S)]
        self.cache = SlotCache(S, self.num_experts, self.cache.policy, self.cache.spill)
        self._cuda = device.type == "cuda"
        self._ready: list = [None] * S  # (sequence, event) of the last copy into each slot
        self._free: list = [None] * S  # event after the last kernel that read each slot
        self._waited = 0
        self._seq = 0
        if self._cuda:
            self._stream = _side_stream(device)
        if isinstance(self.store, DiskStore):
            self._staging = torch.empty((_STAGING_ROWS, numel), dtype=self.layout.dtype, pin_memory=self._cuda)
            self._staging_events: list = [None] * _STAGING_ROWS
            self._staging_next = 0
        self._costs: Costs | None = None
        # What graph-captured steps read (see _forward_in_graph): each expert's place in the two stores as the
        # kernels number them (its slot, or S + e: read in place from host memory; entry E: none), what the host
        # last wrote there, the steps' counts of each expert (then steps, tokens), and promotions in flight.
        E = self.num_experts
        self._tier = torch.tensor([S + e for e in range(E + 1)], dtype=torch.int32, device=device)
        self._shown = [-1] * E
        self._uses = torch.zeros(E + 2, dtype=torch.int32, device=device)
        self._pending: list = []
        self._heat = [0.0] * E
        self._far, self._far_error = None, None
        if isinstance(self.store, HostStore):
            try:
                self._far = _kernel_names(self.store.device_views(device))
            except RuntimeError as e:
                self._far_error = str(e)
        else:
            self._far_error = (
                "storage='disk' keeps no expert where the GPU can read it in place; offload with storage='cpu'"
            )
        self._device = device

    def costs(self) -> Costs:
        """Host link and CPU rates for this layer's expert shape (measured on first use, cached per process)."""
        if self._costs is None:
            views, _ = self._host_rows(list(range(min(self.num_experts, 8))))
            self._costs = measure(self._device, views, self.kind, self._flops_per_token(), self.cpu_threads)
        return self._costs

    def _flops_per_token(self) -> float:
        return 2.0 * sum(_numel(s) for n, s in self.layout.shapes if not n.endswith("bias"))

    def _host_rows(self, experts: list[int]) -> tuple[dict[str, torch.Tensor], list[int]]:
        """``(E', ...)`` host tensors holding ``experts``, and the ids to use with them."""
        if isinstance(self.store, HostStore):
            return self.store.parts, experts
        rows = torch.empty((len(experts), self.layout.numel), dtype=self.layout.dtype)
        for i, e in enumerate(experts):
            self.store.read_into(e, rows[i])
        return self.layout.views(rows), list(range(len(experts)))

    # ------------------------------------------------------------------------------------------
    # copies
    # ------------------------------------------------------------------------------------------
    def _load(self, e: int, slot: int) -> None:
        dst = self._slots[slot]
        self.stats.bytes_to_device += self.layout.nbytes
        disk = isinstance(self.store, DiskStore)
        if not self._cuda:  # the CPU standing in for the GPU: copies are plain and synchronous
            if disk:
                self.store.read_into(e, dst)
            else:
                for n, part in self._slot_parts[slot].items():
                    part.copy_(self.store.parts[n][e])
            return
        if disk:
            r = self._staging_next
            self._staging_next = (r + 1) % _STAGING_ROWS
            if self._staging_events[r] is not None:
                self._staging_events[r].synchronize()  # the row's previous copy has left it
            src = self._staging[r]
            self.store.read_into(e, src)
        with torch.cuda.stream(self._stream):
            if self._free[slot] is not None:
                self._stream.wait_event(self._free[slot])  # the kernels reading the old expert are done
            if disk:
                dst.copy_(src, non_blocking=True)
            else:  # one copy per tensor of the expert, each contiguous on both sides
                for n, part in self._slot_parts[slot].items():
                    part.copy_(self.store.parts[n][e], non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._stream)
        self._seq += 1
        self._ready[slot] = (self._seq, event)
        if isinstance(self.store, DiskStore):
            self._staging_events[r] = event

    def _wait_ready(self, slots) -> None:
        """Order the compute stream after the copies into ``slots`` (one wait: the side stream is in order)."""
        if not self._cuda:
            return
        latest = max((self._ready[s] for s in slots if self._ready[s] is not None), default=None, key=lambda r: r[0])
        if latest is not None and latest[0] > self._waited:
            torch.cuda.current_stream(self._device).wait_event(latest[1])
            self._waited = latest[0]

    def _mark_used(self, slots) -> None:
        if self._cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self._device))
            for s in slots:
                self._free[s] = event

    # ------------------------------------------------------------------------------------------
    # prefetch
    # ------------------------------------------------------------------------------------------
    def _next_layer(self) -> "OffloadedExperts | None":
        nxt = self._next() if self._next is not None else None
        ready = nxt is not None and nxt.prefetch and nxt.router is not None and nxt._device == self._device
        return nxt if ready else None

    def _guess_next(self, x: torch.Tensor, top_k: int) -> torch.Tensor | None:
        """Layer l+1's router on layer l's input: the ids it would pick (on the device), or None."""
        nxt = self._next_layer()
        if nxt is None or x.shape[0] * top_k > nxt.cache.num_slots:
            return None  # a batch that needs more experts than fit streams them anyway
        router = nxt.router
        scores = nn.functional.linear(x, router.weight.to(x.dtype), getattr(router, "bias", None)).float()
        bias = getattr(router, "e_score_correction_bias", None)
        if isinstance(bias, torch.Tensor):
            scores = scores.sigmoid() + bias.float()
        return scores.topk(min(getattr(router, "top_k", top_k), nxt.num_experts), dim=-1).indices

    def _prefetch(self, guess: set[int]) -> None:
        self._guess = guess
        keep = {self.cache.lookup(e) for e in guess if self.cache.lookup(e) >= 0}
        for e in sorted(guess):
            if self.cache.lookup(e) >= 0:
                continue
            slot = self.cache.victim(keep)
            if slot < 0:
                break
            self._unmap(self.cache.admit(e, slot))
            keep.add(slot)
            self._load(e, slot)
            self._pending.append((e, slot, self._ready[slot][1] if self._cuda else None))
            self.stats.prefetched += 1

    # ------------------------------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------------------------------
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        # (is_compiling first: Dynamo cannot trace the capture query)
        if torch.compiler.is_compiling() or (hidden_states.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self._forward_in_graph(hidden_states, top_k_index, top_k_weights)
        return self._forward_eager(hidden_states, top_k_index, top_k_weights)

    def _forward_in_graph(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        """A step of a compiled or captured graph: no host decision. Every routed expert is read where it lies,
        its slot or host memory (mapped into the GPU's address space, read in place over the link), through the
        decode kernels' two stores; the step counts each expert it used, for :meth:`between_steps`."""
        from ...ops.moe import moe_experts_tiered

        if self._device != x.device or getattr(self, "_far", None) is None:
            raise RuntimeError(self._graph_refusal(x.device))
        E = self.num_experts
        ids = torch.where((top_k_index >= 0) & (top_k_index < E), top_k_index, E).long()
        seen = torch.zeros_like(self._uses).index_fill_(0, ids.flatten(), 1)
        seen[E] = 1
        seen[E + 1] = x.shape[0]
        self._uses.add_(seen)
        layout, activation, clamp = self.kind
        near = _kernel_names(self._slot_views)
        kw = dict(layout=layout, activation=activation, clamp=clamp)
        return moe_experts_tiered(x, self._tier[ids], top_k_weights, near, self._far, **kw)

    def _graph_refusal(self, device) -> str:
        if getattr(self, "_far_error", None) is not None:
            return f"{self.path}: a compiled or graph-captured step cannot serve these experts: {self._far_error}"
        return (
            f"{self.path}: offloaded experts run eagerly once on {device} (the prompt's forward) before a compiled "
            "or graph-captured step: that first run places them on the device"
        )

    @torch.compiler.disable  # host decisions per batch
    def _forward_eager(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        x = hidden_states
        if self.store is None:
            raise RuntimeError(
                f"{self.path}: these offloaded experts were reverted; the original module has the weights back"
            )
        if x.dtype != self.layout.dtype:
            raise TypeError(
                f"{self.path}: hidden_states have dtype {x.dtype} but the offloaded experts are {self.layout.dtype}"
            )
        self._bind(x.device)
        last = getattr(_LAST, "module", None)
        prev = last() if last is not None else None
        if prev is not None and prev is not self:
            prev._next = weakref.ref(self)
        _LAST.module = weakref.ref(self)
        T, top_k = top_k_index.shape
        guess = self._guess_next(x, top_k) if self.prefetch else None
        flat = top_k_index.reshape(-1)
        host = (torch.cat([flat.long(), guess.reshape(-1)]) if guess is not None else flat).cpu()
        ids = host[: flat.numel()].view(T, top_k)
        needed = [e for e in torch.unique(ids).tolist() if 0 <= e < self.num_experts]
        self.stats.batches += 1
        self.stats.tokens += T
        if self._guess is not None:
            self.stats.predicted += len(self._guess.intersection(needed))
            self.stats.needed_after_guess += len(needed)
            self._guess = None
        self.cache.count(needed)
        missing = [e for e in needed if self.cache.lookup(e) < 0]
        on_cpu = self._choose_cpu(missing, ids)
        if on_cpu:  # start the tokens' trip to the host before queuing the GPU's work
            rows = torch.nonzero(torch.isin(ids, torch.tensor(sorted(on_cpu))).any(dim=1)).flatten()
            rows_dev = rows.to(x.device)
            x_host = x.index_select(0, rows_dev).to("cpu", non_blocking=self._cuda)
            w_host = top_k_weights.index_select(0, rows_dev).to("cpu", non_blocking=self._cuda)
            copied = torch.cuda.Event() if self._cuda else None
            if copied is not None:
                copied.record(torch.cuda.current_stream(self._device))
        out = self._on_device(x, ids, top_k_weights, [e for e in needed if e not in on_cpu])
        nxt = self._next_layer() if guess is not None else None
        if nxt is not None:
            nxt._prefetch(set(host[flat.numel() :].tolist()))
        if on_cpu:
            if copied is not None:
                copied.synchronize()
            t0 = time.perf_counter()
            experts = sorted(on_cpu)
            views, local = self._host_rows(experts)
            remap = torch.full((self.num_experts + 1,), -1, dtype=torch.int64)
            remap[experts] = torch.tensor(local)
            ids_cpu = remap[ids.index_select(0, rows).long().clamp(-1, self.num_experts)]  # -1: the extra entry
            with torch_threads(self.cpu_threads):
                part = run_experts(x_host, top_k, views, local, self.kind, ids_cpu, w_host)
            spent = time.perf_counter() - t0
            self._learn_cpu_rate(spent, ids_cpu)
            self.stats.cpu_s += spent
            self.stats.cpu_experts += len(on_cpu)
            out.index_add_(0, rows_dev, part.to(out.dtype).to(x.device, non_blocking=self._cuda))
        self._publish()
        return out

    # ------------------------------------------------------------------------------------------
    # graph-captured steps
    # ------------------------------------------------------------------------------------------
    def _publish(self) -> None:
        """Make the table graph steps read say what the cache says, for every slot whose copy the compute stream
        has waited for or which has landed: a step never reads a slot being filled, and no stream waits for a
        prefetch nobody used (its expert stays read in place until a later call maps it)."""
        if self.cache.slot_of == self._shown and not self._pending:
            return
        S, E = self.cache.num_slots, self.num_experts
        shown, pending = [-1] * E, []
        for s, e in enumerate(self.cache.expert_in):
            if e < 0:
                continue
            ready = self._ready[s]
            if self._cuda and ready is not None and ready[0] > self._waited and not ready[1].query():
                pending.append((e, s, ready[1]))
            else:
                shown[e] = s
        table = torch.tensor([s if s >= 0 else S + e for e, s in enumerate(shown)] + [S + E], dtype=torch.int32)
        self._tier.copy_(table.pin_memory() if self._cuda else table, non_blocking=self._cuda)
        self._shown, self._pending = shown, pending

    def _unmap(self, e: int) -> bool:
        """Steps queued from now on read expert ``e`` in place (its slot is about to be overwritten); True if the
        table had it in a slot. Steps queued before have run: the host synchronized since (the eager forward's
        ids, between_steps' counts)."""
        if e < 0 or self._shown[e] < 0:
            return False
        self._tier[e] = self.cache.num_slots + e
        self._shown[e] = -1
        return True

    def graph_key(self) -> tuple:
        """The addresses a captured step reads (slots, tables, host views): a captured graph is stale once they
        change (a load_state_dict or a revert drops them)."""
        if self._device is None:
            return ()
        tensors = (self._slots, self._tier, self._uses, *(self._far or {}).values())
        return tuple(t.data_ptr() for t in tensors)

    def count_steps(self) -> list[int]:
        """Fold what the graph steps since the last call counted on the device into :attr:`stats` and the experts'
        recent use; returns the experts they used. Synchronizes with the device."""
        if self._device is None:
            return []
        E = self.num_experts
        counts = self._uses.tolist()
        self._uses.zero_()
        self.stats.batches += counts[E]
        self.stats.tokens += counts[E + 1]
        used = [e for e in range(E) if counts[e]]
        for e in used:
            self._heat[e] += counts[e]
            if self._shown[e] >= 0:
                self.stats.hits += counts[e]
            else:
                self.stats.mapped += counts[e]
                self.stats.bytes_mapped += counts[e] * self.layout.nbytes
        return used

    def between_steps(self) -> None:
        """Host work between graph-captured steps (:class:`~tritonspec.nn.GraphDecoder` calls it every
        ``check_every`` tokens and at the end): count what the steps read, map the experts whose promotion copies
        have landed, and promote the experts read in place most often into slots. A promotion first unmaps its
        victim (steps queued after read that one from host memory), then copies on the side stream while the
        next steps run; the expert is mapped once its copy has landed (by this call or a later one). Promotions go
        by recent use whatever the policy (the counts are halved after each call), an expert in place of a colder
        one, at most an eighth of the slots per call; the frequency policy's pinned slots stay."""
        if self._device is None:
            return
        if self._far is None:
            raise RuntimeError(self._graph_refusal(self._device))
        S = self.cache.num_slots
        used = self.count_steps()
        promote = sorted((e for e in used if self.cache.lookup(e) < 0), key=lambda e: (-self._heat[e], e))
        busy = {slot for _, slot, _ in self._pending}
        for e in promote[: max(1, S // 8)]:
            slot = self._coldest(busy)
            old = self.cache.expert_in[slot] if slot >= 0 else -1
            if slot < 0 or (old >= 0 and self._heat[old] >= self._heat[e]):
                break
            self.cache.admit(e, slot)
            if self._unmap(old):
                self._mark_used([slot])  # the copy waits for the steps before
            self._load(e, slot)
            busy.add(slot)
            self._pending.append((e, slot, self._ready[slot][1] if self._cuda else None))
            self.stats.promoted += 1
        self._heat = [h / 2 for h in self._heat]  # recent use counts most: LFU with aging
        in_flight = []
        for e, slot, event in self._pending:  # those whose copies have landed are read from their slots
            if self.cache.slot_of[e] != slot:  # evicted again since: nothing to map
                continue
            if event is not None and not event.query():
                in_flight.append((e, slot, event))
                continue
            self._tier[e] = slot
            self._shown[e] = slot
        self._pending = in_flight

    def _coldest(self, busy: set[int]) -> int:
        """The slot a promotion takes: a free one, else the unpinned one whose expert is coldest; -1 if none."""
        cache = self.cache
        open_ = [s for s in range(cache.num_slots) if s not in busy and s not in cache.pinned]

        def heat(s: int) -> tuple:
            e = cache.expert_in[s]
            return (e >= 0, self._heat[e] if e >= 0 else 0.0)

        return min(open_, key=heat, default=-1)

    def _choose_cpu(self, missing: list[int], ids: torch.Tensor) -> set[int]:
        if not missing or self.cpu_compute is False:
            return set()
        if self.cpu_compute is True:
            return set(missing)
        if -1 in self.cache.expert_in or ids.shape[0] > DECODE_TOKENS:
            # A free slot: the copy also makes the expert resident, at no one's expense. A prefill batch:
            # many tokens per expert make the CPU's FLOP rate the bottleneck, so its experts stream in.
            return set()
        tokens = {e: int((ids == e).sum()) for e in missing}
        return choose_cpu(tokens, self.layout.nbytes, self._flops_per_token(), self.costs())

    def _learn_cpu_rate(self, spent: float, ids: torch.Tensor) -> None:
        """Tell the cost model how long the CPU really took for these experts."""
        if self.cpu_compute != "auto":
            return
        costs = self.costs()
        counts = torch.bincount(ids[ids >= 0].flatten())
        costs.learn(
            sum(costs.cpu_s(self.layout.nbytes, int(n), self._flops_per_token()) for n in counts if n > 0), spent
        )

    def _on_device(self, x, ids, weights, experts: list[int]) -> torch.Tensor:
        """The experts served from slots, wave by wave as :func:`serve` plans them, summed (``ids`` on the host)."""
        out = None
        for wave in serve(self.cache, experts):
            for e, slot, load in wave:
                if load:
                    self._load(e, slot)
            self.stats.misses += sum(load for _, _, load in wave)
            self.stats.hits += sum(not load for _, _, load in wave)
            y = self._run_slots(x, ids, weights, [(e, slot) for e, slot, _ in wave])
            out = y if out is None else (out.float() + y.float())
        for e, slot in place_after_profile(self.cache):
            self._load(e, slot)
        return torch.zeros_like(x) if out is None else out.to(x.dtype)

    def _run_slots(self, x, ids, weights, members: list[tuple[int, int]]) -> torch.Tensor:
        """The experts of one wave, ``(expert, slot)``, on the device; other ids map to a sentinel slot."""
        from ...ops import moe

        table = torch.full((self.num_experts + 1,), self.cache.num_slots, dtype=torch.int32)
        experts, slots = zip(*members)
        table[list(experts)] = torch.tensor(slots, dtype=torch.int32)
        # ``ids`` are the host copy: remap there, then one asynchronous copy (pinned) to the device.
        slot_ids = table[ids.clamp(-1, self.num_experts)]  # out-of-range ids (sentinels) hit the extra entry
        slot_ids = (slot_ids.pin_memory() if self._cuda else slot_ids).to(x.device, non_blocking=self._cuda)
        self._wait_ready(slots)
        layout, activation, clamp = self.kind
        v = self._slot_views
        y = moe.moe_experts(
            x,
            slot_ids,
            weights,
            v["gate_up_proj"],
            v["down_proj"],
            gate_up_bias=v.get("gate_up_proj_bias"),
            down_bias=v.get("down_proj_bias"),
            layout=layout,
            activation=activation,
            clamp=clamp,
        )
        self._mark_used(slots)
        return y

    def extra_repr(self) -> str:
        tier = self.store.tier if self.store is not None else "reverted"
        return (
            f"experts={self.num_experts}, slots={self.cache.num_slots}, storage={tier}, "
            f"policy={self.policy!r}, prefetch={self.prefetch}, cpu_compute={self.cpu_compute!r}"
        )


def _kernel_names(parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A layer's tensors under :func:`~tritonspec.ops.moe.moe_experts_tiered`'s names."""
    return {n.replace("proj_bias", "bias"): t for n, t in parts.items()}


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One copy stream per device, shared by every offloaded layer: copies queue in one order."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]
