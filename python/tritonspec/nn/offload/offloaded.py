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
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from torch import nn

from ..experts import experts_kind
from .cache import SlotCache, place_after_profile, serve
from .host_compute import Costs, choose_cpu, measure, run_experts, torch_threads
from .storage import Checkpoint, DiskStore, ExpertLayout, HostStore

STORAGES = ("cpu", "disk")
CPU_COMPUTE = ("auto", True, False)
_DEVICES = ("cpu", "cuda")
_STAGING_ROWS = 4  # pinned rows the disk tier reads into, in turn, before each copy to the GPU
# Batches of at most this many tokens are decode: cpu_compute="auto" weighs the CPU against copies for them
# (KTransformers' generate_device); larger ones are prefill and copy (its prefill_device).
DECODE_TOKENS = 16


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

    def add(self, other: "Stats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


_LAST = threading.local()  # the offloaded layer that ran last on this thread: how the layer order is learned


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
    gets its weights back (on their device) when the replacement is reverted.
    """

    def __init__(self, original: nn.Module, *, experts_per_layer: int, storage: str = "cpu",
                 checkpoint: str | Path | Checkpoint | None = None, policy: str = "lru", prefetch: bool = True,
                 cpu_compute="auto", cpu_threads: int | None = None, router: nn.Module | None = None,
                 path: str = "", spill: int | None = None):
        super().__init__()
        kind = experts_kind(original)
        if kind is None:
            raise TypeError(f"{path or type(original).__name__}: not a fused experts module the Triton kernel computes")
        if storage not in STORAGES:
            raise ValueError(f"storage: expected one of {', '.join(STORAGES)}, got {storage!r}")
        if cpu_compute not in CPU_COMPUTE or not isinstance(cpu_compute, (str, bool)):
            raise ValueError(f"cpu_compute: expected 'auto', True or False, got {cpu_compute!r}")
        if isinstance(experts_per_layer, bool) or not isinstance(experts_per_layer, int) or experts_per_layer < 1:
            raise ValueError(f"experts_per_layer: expected a positive int, got {experts_per_layer!r}")
        if cpu_threads is not None and (isinstance(cpu_threads, bool) or not isinstance(cpu_threads, int)
                                        or cpu_threads < 1):
            raise ValueError(f"cpu_threads: expected a positive int or None, got {cpu_threads!r}")
        if storage == "disk" and checkpoint is None:
            raise ValueError("checkpoint: storage='disk' reads the experts from a save_pretrained checkpoint; "
                             "give its directory or .safetensors file")
        self.kind = kind
        self.layout = ExpertLayout.of(original)
        self.num_experts = original.gate_up_proj.shape[0]
        self.path = path
        self.policy, self.prefetch, self.cpu_compute, self.cpu_threads = policy, bool(prefetch), cpu_compute, cpu_threads
        slots = min(experts_per_layer, self.num_experts)
        # The frequency policy's slots for misses: one batch's worth, but never more than half the slots.
        spill = spill if spill is not None else max(1, min(getattr(router, "top_k", None) or 1, slots // 2))
        self.cache = SlotCache(slots, self.num_experts, policy, spill)
        ckpt = None
        if checkpoint is not None:
            ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else Checkpoint(checkpoint)
        params = [(n, getattr(original, n)) for n, _ in self.layout.shapes]
        on_meta = any(p.is_meta for _, p in params)
        if on_meta and ckpt is None:
            raise ValueError(f"{path}: the experts' weights are on the meta device; give checkpoint= to read them from")
        disk = DiskStore(self.layout, self.num_experts, ckpt, path) if ckpt is not None else None
        if storage == "disk":
            self.store = disk
        else:
            self.store = HostStore(self.layout, self.num_experts)
            if disk is not None:
                for e in range(self.num_experts):
                    disk.read_into(e, self.store.rows[e])
            else:
                self.layout.pack(original, self.store.rows)
        # Not submodules: model.to() and state_dict() must leave the original and the router alone.
        self.__dict__["original"] = original
        self.__dict__["router"] = router
        self.__dict__["_home"] = {n: p.device for n, p in params}
        self._take_weights(params)
        self.stats = Stats()
        self._next: weakref.ref | None = None
        self._guess: set[int] | None = None
        self._device: torch.device | None = None

    @classmethod
    def from_module(cls, original: nn.Module, *, parent: nn.Module | None = None, path: str = "",
                    generate_device: str | None = None, prefill_device: str | None = None, **kwargs):
        """For YAML rules. KTransformers' ``generate_device``/``prefill_device`` say where missing experts run:
        cpu/cuda is the cost model's choice (decode on the CPU, prefill copied), cuda/cuda never the
        CPU, cpu/cpu always the CPU."""
        if generate_device is not None or prefill_device is not None:
            if "cpu_compute" in kwargs:
                raise ValueError("cpu_compute: give it or generate_device/prefill_device, not both")
            pair = (str(generate_device or "cuda").split(":")[0], str(prefill_device or "cuda").split(":")[0])
            if any(d not in _DEVICES for d in pair) or pair == ("cuda", "cpu"):
                raise ValueError(f"generate_device/prefill_device: expected cpu/cuda, cuda/cuda or cpu/cpu, got "
                                 f"{generate_device}/{prefill_device}")
            kwargs["cpu_compute"] = {("cpu", "cuda"): "auto", ("cuda", "cuda"): False, ("cpu", "cpu"): True}[pair]
        num_experts = original.gate_up_proj.shape[0]
        return cls(original, router=_router_of(parent, num_experts), path=path, **kwargs)

    # ------------------------------------------------------------------------------------------
    # the original's weights: taken on offload, handed back on revert
    # ------------------------------------------------------------------------------------------
    def _take_weights(self, params) -> None:
        if isinstance(self.store, HostStore):  # the packed rows hold the values: the parameters become views of them
            views = self.layout.views(self.store.rows)
            for n, p in params:
                p.data = views[n]
        else:  # read back from the checkpoint on revert
            for n, p in params:
                if not p.is_meta:
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)

    def release(self) -> None:
        """Give the original module its weights back (called on revert): those from a GPU go back there,
        those from host memory stay the packed rows' views (no second copy of the experts), those on the
        meta device stay there; the disk tier's are read from the checkpoint again."""
        original = self.__dict__["original"]
        if isinstance(self.store, HostStore):
            rows = self.store.rows
        else:
            rows = torch.empty((self.num_experts, self.layout.numel), dtype=self.layout.dtype)
            for e in range(self.num_experts):
                self.store.read_into(e, rows[e])
        views = self.layout.views(rows)
        for n, device in self.__dict__["_home"].items():
            p = getattr(original, n)
            if device.type == "cpu" and isinstance(self.store, HostStore):
                continue  # already views of the rows: no second copy of the experts in host memory
            if device.type != "meta":
                p.data = views[n].to(device).contiguous()
        self._slots = self._slot_views = None  # the slots' device memory goes back to the allocator
        self._device = None

    # ------------------------------------------------------------------------------------------
    # device state, made once per device
    # ------------------------------------------------------------------------------------------
    def _bind(self, device: torch.device) -> None:
        if self._device == device:
            return
        S, numel = self.cache.num_slots, self.layout.numel
        self._slots = torch.empty((S, numel), dtype=self.layout.dtype, device=device)
        self._slot_views = self.layout.views(self._slots)
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
        self._device = device

    def costs(self) -> Costs:
        """Host link and CPU rates for this layer's expert shape (measured on first use, cached per process)."""
        if self._costs is None:
            views, rows, _ = self._host_rows(list(range(min(self.num_experts, 8))))
            self._costs = measure(self._device, views, rows, self.kind, self._flops_per_token(), self.cpu_threads)
        return self._costs

    def _flops_per_token(self) -> float:
        return 2.0 * sum(_numel(s) for n, s in self.layout.shapes if not n.endswith("bias"))

    def _host_rows(self, experts: list[int]) -> tuple[dict[str, torch.Tensor], torch.Tensor, list[int]]:
        """Views of host rows holding ``experts``, the rows, and the ids to use with them."""
        if isinstance(self.store, HostStore):
            return self.layout.views(self.store.rows), self.store.rows, experts
        rows = torch.empty((len(experts), self.layout.numel), dtype=self.layout.dtype)
        for i, e in enumerate(experts):
            self.store.read_into(e, rows[i])
        return self.layout.views(rows), rows, list(range(len(experts)))

    # ------------------------------------------------------------------------------------------
    # copies
    # ------------------------------------------------------------------------------------------
    def _load(self, e: int, slot: int) -> None:
        dst = self._slots[slot]
        nbytes = self.layout.nbytes
        self.stats.bytes_to_device += nbytes
        if not self._cuda:  # the CPU standing in for the GPU: copies are plain and synchronous
            if isinstance(self.store, DiskStore):
                self.store.read_into(e, dst)
            else:
                dst.copy_(self.store.row(e))
            return
        if isinstance(self.store, DiskStore):
            r = self._staging_next
            self._staging_next = (r + 1) % _STAGING_ROWS
            if self._staging_events[r] is not None:
                self._staging_events[r].synchronize()  # the row's previous copy has left it
            src = self._staging[r]
            self.store.read_into(e, src)
        else:
            src = self.store.row(e)
        with torch.cuda.stream(self._stream):
            if self._free[slot] is not None:
                self._stream.wait_event(self._free[slot])  # the kernels reading the old expert are done
            dst.copy_(src, non_blocking=True)
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
        return nxt if nxt is not None and nxt.prefetch and nxt.router is not None and nxt._device == self._device else None

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
            self.cache.admit(e, slot)
            keep.add(slot)
            self._load(e, slot)
            self.stats.prefetched += 1

    # ------------------------------------------------------------------------------------------
    # forward
    # ------------------------------------------------------------------------------------------
    @torch.compiler.disable  # host decisions per batch: a graph break, the model around it still compiles
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        x = hidden_states
        if x.dtype != self.layout.dtype:
            raise TypeError(f"{self.path}: hidden_states have dtype {x.dtype} but the offloaded experts are "
                            f"{self.layout.dtype}")
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
        ids = host[:flat.numel()].view(T, top_k)
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
            nxt._prefetch(set(host[flat.numel():].tolist()))
        if on_cpu:
            if copied is not None:
                copied.synchronize()
            t0 = time.perf_counter()
            experts = sorted(on_cpu)
            views, _, local = self._host_rows(experts)
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
        return out

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
        costs.learn(sum(costs.cpu_s(self.layout.nbytes, int(n), self._flops_per_token()) for n in counts if n > 0),
                    spent)

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
        y = moe.moe_experts(x, slot_ids, weights, v["gate_up_proj"], v["down_proj"], gate_up_bias=v.get("gate_up_proj_bias"),
                            down_bias=v.get("down_proj_bias"), layout=layout, activation=activation, clamp=clamp)
        self._mark_used(slots)
        return y

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, slots={self.cache.num_slots}, storage={self.store.tier}, "
                f"policy={self.policy!r}, prefetch={self.prefetch}, cpu_compute={self.cpu_compute!r}")


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
