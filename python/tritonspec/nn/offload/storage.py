"""Where offloaded experts live off the GPU: the model's own tensors in host memory, or a checkpoint on disk.

The model's weights are the truth. The host tier keeps each ``(E, ...)`` expert tensor of a layer as one
contiguous host tensor, page-locked in place whenever a CUDA device exists (pageable memory moves about 3.5x
slower over PCIe): a host tensor the model already holds whole is used as it is, with no copy, one on a GPU is
moved, and only one on the meta device (a model built empty) is read from the checkpoint. Host memory the tier
allocates itself lies on 2 MB pages where Linux allows it (:func:`host_empty`); a tensor kept as it is keeps
its pages (``MADV_COLLAPSE`` moved them at about 0.4 GB/s on a CPU box). So reverting hands the same tensors
back, and ``state_dict()`` writes them without a copy. One expert moves to its GPU slot in one copy per tensor.

The disk tier reads a ``save_pretrained`` checkpoint (:class:`~.checkpoint.Checkpoint`; transformers writes
fused experts back as per-expert ``gate_proj``/``up_proj``/``down_proj`` or Mixtral's ``w1``/``w3``/``w2``,
GPT-OSS as fused tensors) and copies only the byte ranges of the experts asked for, counting them. Each expert
the model holds is compared with the checkpoint's, bit for bit after the same dtype conversion; experts that
differ (fine-tuned since saving) go to a :class:`RowFile` the project owns and are read from there, so the disk
tier serves exactly the model's weights and a revert restores them.
"""

from __future__ import annotations

import copy
import mmap
import os
import tempfile
import warnings
import weakref
from dataclasses import dataclass

import torch

from .checkpoint import FLOAT_DTYPES, Checkpoint, read_exact

PARTS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")
_EXPERT_DTYPES = tuple(FLOAT_DTYPES.values())
# Per-expert names transformers writes for fused experts (gate, up, down), by family.
_PER_EXPERT = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


@dataclass(frozen=True)
class ExpertLayout:
    """The shapes of one expert's tensors (its slice of each ``(E, ...)`` parameter) and their offsets in a row:
    ``[gate_up | down | gate_up_bias | down_bias]``, the layout of a GPU slot, a staging row and a :class:`RowFile`."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (part name, per-expert shape), in row order
    dtype: torch.dtype

    @classmethod
    def of(cls, experts: torch.nn.Module, path: str = "") -> "ExpertLayout":
        """The layout of a fused experts module, every tensor checked: present, a plain strided tensor of a
        float dtype on the CPU, a GPU or the meta device, one count of experts, one dtype."""
        name = path or type(experts).__name__
        has_bias = bool(getattr(experts, "has_bias", False))
        parts, counts = [], set()
        for n in PARTS[: 4 if has_bias else 2]:
            p = experts._parameters.get(n)
            where = f"{name}.{n}"
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"{where}: missing (a fused experts module{' with has_bias' if has_bias else ''} "
                    f"has {', '.join(PARTS[: 4 if has_bias else 2])} parameters)"
                )
            if type(p.detach()) is not torch.Tensor or p.layout != torch.strided:
                raise TypeError(
                    f"{where}: a {type(p.detach()).__name__} ({p.layout}); experts are offloaded from "
                    "plain dense tensors, not distributed, quantized or sparse ones"
                )
            if p.dtype not in _EXPERT_DTYPES:
                raise TypeError(
                    f"{where}: dtype {p.dtype}; offloaded experts are float16, bfloat16, float32 or float64"
                )
            if p.device.type not in ("cpu", "cuda", "meta"):
                raise TypeError(f"{where}: on {p.device}; offloaded experts come from the CPU, a CUDA GPU or meta")
            if p.dim() != (3 if n in PARTS[:2] else 2) or p.shape[0] == 0:
                raise TypeError(
                    f"{where}: shape {tuple(p.shape)}; expected (experts, ...) with "
                    f"{3 if n in PARTS[:2] else 2} dimensions"
                )
            parts.append((n, tuple(p.shape[1:])))
            counts.add(p.shape[0])
        if len(counts) != 1:
            raise TypeError(f"{name}: its tensors disagree on the number of experts ({sorted(counts)})")
        dtypes = {experts._parameters[n].dtype for n, _ in parts}
        if len(dtypes) != 1:
            raise TypeError(
                f"{name}: parameters {', '.join(n for n, _ in parts)} must share one dtype to be packed "
                f"into one row per expert, got {sorted(map(str, dtypes))}"
            )
        return cls(tuple(parts), dtypes.pop())

    @property
    def numel(self) -> int:
        return sum(_prod(s) for _, s in self.shapes)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def offsets(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        out, at = {}, 0
        for name, shape in self.shapes:
            out[name] = (at, shape)
            at += _prod(shape)
        return out

    def views(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """``(N, numel)`` rows -> each part as an ``(N, *shape)`` strided view (no copy)."""
        n, stride = rows.shape[0], rows.stride(0)
        out = {}
        for name, (at, shape) in self.offsets().items():
            inner = [1] * len(shape)
            for i in range(len(shape) - 2, -1, -1):
                inner[i] = inner[i + 1] * shape[i + 1]
            out[name] = rows.as_strided((n, *shape), (stride, *inner), rows.storage_offset() + at)
        return out

    def row_parts(self, row: torch.Tensor) -> dict[str, torch.Tensor]:
        """One ``(numel,)`` row -> each part as a contiguous ``shape`` view."""
        return {n: v[0] for n, v in self.views(row.view(1, -1)).items()}


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def host_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized host tensor on 2 MB pages where the kernel allows it (Linux's transparent huge pages, in
    the ``madvise`` or ``always`` mode), else on ordinary pages: why the host tier allocates this way.

    A graph-captured step reads missing experts in place from page-locked memory, through the GPU's own mapping
    of it: over 4 KB pages the decode kernels read at 38-41 GB/s, over 2 MB pages at 50-51 (H100, 54 GB/s link,
    all of a token's experts read in place). The memory is an anonymous mapping advised before its first
    touch (huge pages are chosen when a page first faults); the tensor keeps the mapping alive and unmapping
    follows the last tensor over it."""
    numel = _prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared memory has its own THP mode
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # huge pages off (mode never, or not built in): ordinary pages, the same memory
        pass
    return torch.frombuffer(region, dtype=dtype, count=numel).view(shape)


def _pin(t: torch.Tensor) -> bool:
    """Page-lock ``t`` where it lies (``cudaHostRegister``); True when that worked.

    Not ``pin_memory=True``: torch's pinned allocator rounds each block up to a power of two, which for
    Mixtral's 2.8 GB layers would lock 4 GB each, 128 GB for 90 GB of experts.
    """
    if not torch.cuda.is_available() or t.is_pinned():
        return False
    cudart = torch.cuda.cudart()
    if cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0) != cudart.cudaError.success:
        warnings.warn(
            "offloaded experts: page-locking host memory failed; copies run from pageable memory, about 3.5x slower",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


def _unpin(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class _DeviceMemory:
    """``__cuda_array_interface__`` of ``nbytes`` bytes at a device address: how torch wraps memory it did not
    allocate (the owner here is the host tensor; the mapped tensor must not outlive it)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = dict(shape=(nbytes,), typestr="|u1", data=(address, False), version=3)


def _mapped(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The page-locked host tensor ``t`` as a CUDA tensor over the same memory (no copy)."""
    import ctypes

    address = ctypes.c_uint64(0)
    try:  # CU_POINTER_ATTRIBUTE_DEVICE_POINTER: where the GPU sees the registered host memory
        rc = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute(ctypes.byref(address), 3, ctypes.c_uint64(t.data_ptr()))
    except OSError as e:
        rc = str(e)
    if rc != 0:
        raise RuntimeError(
            f"offloaded experts: host memory at {t.data_ptr():#x} is not mapped into the GPU's address space "
            f"(cuPointerGetAttribute: {rc}); graph-captured steps read missing experts in place from page-locked "
            "memory, which this host could not lock"
        )
    with torch.cuda.device(device):
        raw = torch.as_tensor(_DeviceMemory(address.value, t.numel() * t.element_size()), device=device)
    return raw.view(t.dtype).view(t.shape)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers: equal bits compare equal (NaNs and -0.0 included), unlike the values."""
    return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class HostStore:
    """Every expert of one layer in host memory: ``parts[name]`` is the layer's contiguous ``(E, ...)`` tensor."""

    tier = "cpu"

    def __init__(self, parts: dict[str, torch.Tensor]):
        self.parts = parts
        # unlocked on release, or when the store goes without one; the tensors themselves may live on
        self._unpin = [weakref.finalize(self, _unpin, t) for t in parts.values() if _pin(t)]
        self.bytes_read = 0

    def release(self) -> None:
        for unpin in self._unpin:
            unpin()

    def device_views(self, device: torch.device) -> dict[str, torch.Tensor]:
        """Each part as a tensor of ``device`` that aliases its host memory: on CUDA, the page-locked memory as
        the GPU addresses it (unified addressing), so a kernel reads an expert in place over the host link, with
        no copy and no host decision; on the CPU, the parts themselves."""
        if device.type != "cuda":
            return dict(self.parts)
        return {n: _mapped(t, device) for n, t in self.parts.items()}

    def __deepcopy__(self, memo) -> "HostStore":
        new = HostStore({n: copy.deepcopy(t, memo) for n, t in self.parts.items()})
        memo[id(self)] = new
        return new


def host_store(experts: torch.nn.Module, layout: ExpertLayout, sources: "ExpertSources | None") -> HostStore:
    """The host tier of ``experts``: each tensor it holds whole on the CPU as it is, one on a GPU or only part of
    a larger storage copied, one on the meta device read from ``sources``. Changes nothing in ``experts``."""
    parts = {}
    for n, shape in layout.shapes:
        p = experts._parameters[n].detach()
        if p.is_meta:
            t = host_empty(p.shape, layout.dtype)
            for e in range(p.shape[0]):
                sources.read_part_into(e, n, t[e])
        elif (
            p.device.type == "cpu"
            and p.is_contiguous()
            and p.storage_offset() == 0
            and p.untyped_storage().nbytes() == p.numel() * p.element_size()
        ):
            t = p
        else:
            t = host_empty(p.shape, layout.dtype)
            t.copy_(p)
        parts[n] = t
    return HostStore(parts)


class ExpertSources:
    """Where each expert of one layer is in a :class:`Checkpoint`: fused ``(E, ...)`` tensors under the module's
    path, or transformers' per-expert ``gate``/``up``/``down`` weights under its layer. Every tensor is checked
    (present, a float dtype, the shape the model's layout needs) when this is built."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        path: str,
        layout: ExpertLayout,
        num_experts: int,
        parts: tuple[str, ...],
        concatenated: bool,
    ):
        self.checkpoint, self.path, self.layout = checkpoint, path, layout
        self.reads = self._find(parts, num_experts, concatenated)

    def __deepcopy__(self, memo) -> "ExpertSources":
        return self  # read-only

    def _check(self, key: str, shape: tuple[int, ...], part: str) -> None:
        info = self.checkpoint.tensors[key]
        if info.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"checkpoint: {info.file}: {key} has dtype {info.dtype}; experts are read from "
                f"{', '.join(FLOAT_DTYPES)}"
            )
        if info.shape != shape:
            raise ValueError(
                f"checkpoint: {info.file}: {key} has shape {list(info.shape)}, but {self.path}.{part} "
                f"of the model needs {list(shape)} (a checkpoint of another model?)"
            )

    def _find(self, parts, num_experts: int, concatenated: bool) -> list[dict[str, list[tuple[str, int | None]]]]:
        """Per expert, per part: the (key, index along dim 0 or None) reads that fill it, in order."""
        keys, shapes = self.checkpoint.tensors, dict(self.layout.shapes)
        prefixes = [self.path]
        if "." in self.path:
            prefixes.append(self.path.split(".", 1)[1])  # a base-model checkpoint, without the causal LM's "model."
        for prefix in prefixes:
            fused = [n for n in parts if f"{prefix}.{n}" in keys]
            if fused:
                missing = [f"{prefix}.{n}" for n in parts if n not in fused]
                if missing:
                    raise ValueError(
                        f"checkpoint: {self.checkpoint.path} has {prefix}.{fused[0]} but not {', '.join(missing)}"
                    )
                for n in parts:
                    self._check(f"{prefix}.{n}", (num_experts, *shapes[n]), n)
                return [{n: [(f"{prefix}.{n}", e)] for n in parts} for e in range(num_experts)]
            found = self._per_expert(prefix, parts, num_experts, concatenated)
            if found is not None:
                return found
        raise ValueError(
            f"checkpoint: no tensors for expert 0 of {self.path} in {self.checkpoint.path} (looked for "
            f"{self.path}.{parts[0]} and per-expert gate/up/down weights under its layer)"
        )

    def _per_expert(self, prefix: str, parts, num_experts: int, concatenated: bool):
        # Per-expert tensors live under the layer, whatever the block was called when saved (Mixtral writes
        # block_sparse_moe); the layer is the path up to the block.
        layer = prefix.rsplit(".", 2)[0]
        shapes = dict(self.layout.shapes)
        for container, experts in sorted(self.checkpoint.per_expert_keys().items()):
            if container != layer and container.rpartition(".")[0] != layer:
                continue
            for gate, up, down in _PER_EXPERT:
                if not any({gate, up, down} & set(names) for names in experts.values()):
                    continue
                if not set(parts) <= {"gate_up_proj", "down_proj"} or not concatenated:
                    raise ValueError(
                        f"checkpoint: {self.checkpoint.path} holds {container}'s experts one by one "
                        f"({gate}/{up}/{down}); {self.path} needs {', '.join(parts)} in its own layout, "
                        "which only fused tensors give"
                    )
                extra = sorted(e for e in experts if e >= num_experts)
                if extra:
                    raise ValueError(
                        f"checkpoint: {self.checkpoint.path} has expert {extra[0]} under {container}; "
                        f"{self.path} has {num_experts} experts (a checkpoint of another model?)"
                    )
                reads = []
                for e in range(num_experts):
                    names = experts.get(e, {})
                    if not {gate, up, down} <= set(names):
                        raise ValueError(
                            f"checkpoint: no tensors for expert {e} of {self.path} in "
                            f"{self.checkpoint.path} (expected {container}.experts.{e}.{{{gate},{up},"
                            f"{down}}}.weight)"
                        )
                    read = {}
                    if "gate_up_proj" in parts:
                        rows, cols = shapes["gate_up_proj"]
                        for proj in (gate, up):
                            self._check(names[proj], (rows // 2, cols), "gate_up_proj")
                        if rows % 2:
                            raise ValueError(f"{self.path}.gate_up_proj: {rows} rows cannot hold gate and up halves")
                        read["gate_up_proj"] = [(names[gate], None), (names[up], None)]
                    if "down_proj" in parts:
                        self._check(names[down], shapes["down_proj"], "down_proj")
                        read["down_proj"] = [(names[down], None)]
                    reads.append(read)
                return reads
        return None

    def read_part_into(self, e: int, part: str, out: torch.Tensor) -> int:
        """Fill ``out`` (expert ``e``'s ``part``, contiguous, on the host) from the checkpoint; the bytes read."""
        flat, at, nbytes = out.view(-1), 0, 0
        for key, index in self.reads[e][part]:
            shape = self.checkpoint.tensors[key].shape
            n = _prod(shape[1:] if index is not None else shape)
            nbytes += self.checkpoint.read_into(key, flat[at : at + n], index)
            at += n
        return nbytes


class RowFile:
    """Expert rows the model holds and its checkpoint does not (experts fine-tuned since saving): an anonymous
    temporary file (unlinked at once, so it goes with its last user or the process, however that ends), in
    ``tempfile.gettempdir()`` (``TMPDIR``). Written while offloading, then only read; copies of a model share it."""

    def __init__(self, layout: ExpertLayout, path: str):
        self.layout, self.path = layout, path
        self.file = tempfile.TemporaryFile(prefix="tritonspec-experts-")
        self.name = f"the temporary file of {path}'s experts that differ from the checkpoint"
        self.rows = 0

    def __deepcopy__(self, memo) -> "RowFile":
        return self

    def append(self, row: torch.Tensor) -> int:
        """Write one ``(numel,)`` row; its index."""
        data = memoryview(row.contiguous().view(torch.uint8).numpy())
        offset = self.rows * self.layout.nbytes
        try:
            done = 0
            while done < len(data):
                done += os.pwrite(self.file.fileno(), data[done:], offset + done)
        except OSError as e:
            raise OSError(
                e.errno,
                f"{self.path}: writing its experts that differ from the checkpoint to a temporary "
                f"file in {tempfile.gettempdir()} failed ({e.strerror}); free space there or point TMPDIR "
                "elsewhere",
            ) from None
        self.rows += 1
        return self.rows - 1

    def read_part_into(self, i: int, part: str, out: torch.Tensor) -> int:
        at, _ = self.layout.offsets()[part]
        read_exact(self.file.fileno(), out, (i * self.layout.numel + at) * self.layout.dtype.itemsize, self.name)
        return out.numel() * out.element_size()


class DiskStore:
    """One layer's experts read on demand: from the checkpoint, or from the :class:`RowFile` for those that
    differ from it."""

    tier = "disk"

    def __init__(self, layout: ExpertLayout, sources: ExpertSources, owned: dict[int, int], rowfile: RowFile | None):
        self.layout, self.sources, self.owned, self.rowfile = layout, sources, owned, rowfile
        self.bytes_read = 0

    @property
    def checkpoint(self) -> Checkpoint:
        return self.sources.checkpoint

    def release(self) -> None:
        pass

    def __deepcopy__(self, memo) -> "DiskStore":
        new = copy.copy(self)  # the checkpoint and the row file are shared, the counter is not
        new.bytes_read = 0
        memo[id(self)] = new
        return new

    def read_part_into(self, e: int, part: str, out: torch.Tensor) -> None:
        if e in self.owned:
            self.bytes_read += self.rowfile.read_part_into(self.owned[e], part, out)
        else:
            self.bytes_read += self.sources.read_part_into(e, part, out)

    def read_into(self, e: int, row: torch.Tensor) -> None:
        """Fill ``row`` (one expert, ``layout.numel``, contiguous on the host)."""
        for part, view in self.layout.row_parts(row).items():
            self.read_part_into(e, part, view)

    def read_part(self, part: str, num_experts: int) -> torch.Tensor:
        """Every expert's ``part`` as one new contiguous ``(E, ...)`` host tensor."""
        shape = dict(self.layout.shapes)[part]
        out = torch.empty((num_experts, *shape), dtype=self.layout.dtype)
        for e in range(num_experts):
            self.read_part_into(e, part, out[e])
        return out


def disk_store(experts: torch.nn.Module, layout: ExpertLayout, sources: ExpertSources, path: str) -> DiskStore:
    """The disk tier of ``experts``: every expert it holds compared with the checkpoint's (bitwise, after the
    same dtype conversion); those that differ written to a :class:`RowFile`. Changes nothing in ``experts``."""
    params = {n: experts._parameters[n].detach() for n, _ in layout.shapes}
    held = [n for n, p in params.items() if not p.is_meta]
    owned, rowfile = {}, None
    if held:
        row = torch.empty(layout.numel, dtype=layout.dtype)
        views = layout.row_parts(row)
        for e in range(next(iter(params.values())).shape[0]):
            for n, view in views.items():
                sources.read_part_into(e, n, view)
            same = True
            for n in held:
                mine = params[n][e].cpu()
                if not torch.equal(_bits(views[n]), _bits(mine)):
                    views[n].copy_(mine)
                    same = False
            if not same:
                rowfile = rowfile or RowFile(layout, path)
                owned[e] = rowfile.append(row)
    return DiskStore(layout, sources, owned, rowfile)
