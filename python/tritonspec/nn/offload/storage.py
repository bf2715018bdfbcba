"""Where offloaded experts live off the GPU: packed rows in host memory, or a safetensors checkpoint on disk.

One expert is one contiguous row, ``[gate_up | down | gate_up_bias | down_bias]`` in the module's own
layouts, so moving an expert to its GPU slot is a single copy and a slot is the same row. The host tier
holds every row of a layer in one tensor, page-locked in place whenever a CUDA device exists (pageable
memory moves about 3.5x slower over PCIe). The disk tier memory-maps a
``save_pretrained`` checkpoint (one file or an index of shards; transformers writes the fused experts
back as per-expert ``gate_proj``/``up_proj``/``down_proj`` or Mixtral's ``w1``/``w3``/``w2``, GPT-OSS as
fused tensors) and copies only the byte ranges of the experts asked for, counting them.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import struct
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}
_PARTS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


@dataclass(frozen=True)
class ExpertLayout:
    """The shapes of one expert's tensors (its slice of each ``(E, ...)`` parameter) and their offsets in a row."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (part name, per-expert shape), in row order
    dtype: torch.dtype

    @classmethod
    def of(cls, experts: torch.nn.Module) -> "ExpertLayout":
        parts = [(n, tuple(getattr(experts, n).shape[1:])) for n in _PARTS
                 if getattr(experts, n, None) is not None and (n in _PARTS[:2] or getattr(experts, "has_bias", False))]
        dtypes = {getattr(experts, n).dtype for n, _ in parts}
        if len(dtypes) != 1:
            raise TypeError(f"experts: parameters {', '.join(n for n, _ in parts)} must share one dtype to be packed "
                            f"into one row per expert, got {sorted(map(str, dtypes))}")
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

    def pack(self, experts: torch.nn.Module, out: torch.Tensor) -> None:
        """Copy the module's experts into ``out`` (E, numel)."""
        for name, view in self.views(out).items():
            view.copy_(getattr(experts, name).detach())


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _pin(t: torch.Tensor) -> bool:
    """Page-lock ``t`` where it lies (``cudaHostRegister``); True when that worked.

    Not ``pin_memory=True``: torch's pinned allocator rounds each block up to a power of two, which for
    Mixtral's 2.8 GB layers would lock 4 GB each, 128 GB for 90 GB of experts.
    """
    if not torch.cuda.is_available():
        return False
    cudart = torch.cuda.cudart()
    if cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0) != cudart.cudaError.success:
        warnings.warn("offloaded experts: page-locking host memory failed; copies run from pageable memory, "
                      "about 3.5x slower", RuntimeWarning, stacklevel=3)
        return False
    return True


def _unpin(t: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


class HostStore:
    """Every expert of one layer as one row of a host tensor; ``row(e)`` is what one copy moves."""

    tier = "cpu"

    def __init__(self, layout: ExpertLayout, num_experts: int):
        self.layout = layout
        self.rows = torch.empty((num_experts, layout.numel), dtype=layout.dtype)
        self.pinned = _pin(self.rows)
        if self.pinned:  # unlocked when the store goes; views of the rows (parameters) stay valid, pageable
            weakref.finalize(self, _unpin, self.rows)
        self.bytes_read = 0

    def row(self, e: int) -> torch.Tensor:
        return self.rows[e]

    def parts(self, e: int) -> dict[str, torch.Tensor]:
        return {n: v[0] for n, v in self.layout.views(self.rows[e:e + 1]).items()}


class Checkpoint:
    """A ``save_pretrained`` safetensors checkpoint (file, or directory with one file or an index), memory-mapped.

    Nothing is read until :meth:`read_into`; ``bytes_read`` counts the bytes copied out of the maps.
    """

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        if path.is_dir():
            index, single = path / "model.safetensors.index.json", path / "model.safetensors"
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                files = {f: path / f for f in sorted(set(weight_map.values()))}
            elif single.is_file():
                files = {single.name: single}
            else:
                raise FileNotFoundError(f"checkpoint: {path} holds neither model.safetensors nor "
                                        "model.safetensors.index.json")
        elif path.is_file():
            files = {path.name: path}
        else:
            raise FileNotFoundError(f"checkpoint: {path} does not exist")
        self.path = path
        self.tensors: dict[str, tuple[str, str, tuple[int, ...], int, int]] = {}
        self._maps: dict[str, mmap.mmap] = {}
        for name, file in files.items():
            if not file.is_file():
                raise FileNotFoundError(f"checkpoint: shard {file} named by the index does not exist")
            with open(file, "rb") as fh:
                (n,) = struct.unpack("<Q", fh.read(8))
                header = json.loads(fh.read(n))
                # copy-on-write: a writable view (torch wants one), never written, so no page is ever copied
                self._maps[name] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            for key, info in header.items():
                if key == "__metadata__":
                    continue
                begin, end = info["data_offsets"]
                self.tensors[key] = (name, info["dtype"], tuple(info["shape"]), 8 + n + begin, 8 + n + end)
        self.bytes_read = 0

    def read_into(self, key: str, out: torch.Tensor, index: int | None = None) -> None:
        """Copy tensor ``key`` (its ``index``-th slice along dim 0 when given) into ``out``, converting the dtype."""
        file, dtype_name, shape, begin, end = self.tensors[key]
        dtype = _SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise TypeError(f"checkpoint: tensor {key} has dtype {dtype_name}; supported: {', '.join(_SAFETENSORS_DTYPES)}")
        if index is not None:
            size = (end - begin) // shape[0]
            begin, shape = begin + index * size, shape[1:]
            end = begin + size
        if _prod(shape) != out.numel():
            raise ValueError(f"checkpoint: tensor {key} has {_prod(shape)} elements, the model expects {out.numel()}")
        src = torch.frombuffer(memoryview(self._maps[file])[begin:end], dtype=torch.uint8)
        out.view(-1).copy_(src.view(dtype))
        self.bytes_read += end - begin


# Per-expert names transformers writes for fused experts (gate, up, down), by family.
_PER_EXPERT = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


class DiskStore:
    """One layer's experts read from a :class:`Checkpoint` on demand, one row at a time."""

    tier = "disk"

    def __init__(self, layout: ExpertLayout, num_experts: int, checkpoint: Checkpoint, module_path: str):
        self.layout, self.checkpoint, self.path = layout, checkpoint, module_path
        self.sources = [self._find(e, module_path) for e in range(num_experts)]

    @property
    def bytes_read(self) -> int:
        return self.checkpoint.bytes_read

    def _find(self, e: int, path: str) -> list[tuple[str, str, int | None]]:
        """(part, key, index) reads that fill expert ``e``'s row, from fused or per-expert tensors."""
        keys = self.checkpoint.tensors
        prefixes = [path]
        parts = path.split(".")
        if len(parts) > 1:
            prefixes.append(".".join(parts[1:]))  # a base-model checkpoint, without the causal LM's "model." root
        for prefix in prefixes:
            if f"{prefix}.gate_up_proj" in keys:
                return [(n, f"{prefix}.{n}", e) for n, _ in self.layout.shapes]
            # Per-expert tensors live under the layer, whatever the block was called when saved
            # (Mixtral writes block_sparse_moe); the layer is the path up to the block.
            layer = prefix.rsplit(".", 2)[0]
            for gate, up, down in _PER_EXPERT:
                pat = re.compile(rf"^{re.escape(layer)}\.(?:\w+\.)?experts\.{e}\.({gate}|{up}|{down})\.weight$")
                found = {m.group(1): k for k in keys if (m := pat.match(k))}
                if len(found) == 3 and len(self.layout.shapes) == 2:
                    return [("gate_up_proj", found[gate], None), ("gate_up_proj", found[up], None),
                            ("down_proj", found[down], None)]
        raise KeyError(f"checkpoint: no tensors for expert {e} of {path} in {self.checkpoint.path} (looked for "
                       f"{path}.gate_up_proj and per-expert gate/up/down weights under its layer)")

    def read_into(self, e: int, row: torch.Tensor) -> None:
        """Fill ``row`` (one expert, ``layout.numel``) from the checkpoint."""
        offsets = self.layout.offsets()
        filled: dict[str, int] = {}
        for part, key, index in self.sources[e]:
            at, shape = offsets[part]
            size = self.checkpoint.tensors[key][2]
            n = _prod(size[1:] if index is not None else size)
            start = at + filled.get(part, 0)
            self.checkpoint.read_into(key, row[start:start + n], index)
            filled[part] = filled.get(part, 0) + n
        for part, (at, shape) in offsets.items():
            if filled.get(part, 0) != _prod(shape):
                raise ValueError(f"checkpoint: expert {e} of {self.path}: {part} read {filled.get(part, 0)} elements, "
                                 f"the model expects {_prod(shape)}")
