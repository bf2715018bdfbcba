"""A ``save_pretrained`` safetensors checkpoint as untrusted input, read with positioned reads.

Why a parser of our own: byte-range reads need each tensor's offsets, which the ``safetensors`` library does
not expose. It applies that library's rules (``safetensors/src/tensor.rs``): an 8-byte little-endian header
length of at most 100 MB that fits in the file, a UTF-8 JSON object, per tensor a known dtype, a shape of
non-negative ints and ``data_offsets`` ``[begin, end]`` that, sorted, tile the data from byte 0 to the end of
the file, each span as long as its dtype and shape say. An index json names its shards by relative paths that
stay inside the checkpoint folder (checked lexically: the Hugging Face cache's snapshots are symlinks into its
``blobs/``, and those are the folder owner's choice). Every error names the file and the problem.

Why not ``mmap``: a mapped file truncated under a running model kills the process with SIGBUS at the next
access to a lost page. ``os.preadv`` reads straight into the destination (a pinned staging row, a slot), no
extra copy, and every read first checks the open file's size and mtime against what was validated, so a file
that changed gives an error naming it.
"""

from __future__ import annotations

import json
import math
import os
import stat
import weakref
from dataclasses import dataclass
from pathlib import Path, PurePath

import torch

MAX_HEADER_BYTES = 100_000_000  # safetensors' MAX_HEADER_SIZE
MAX_INDEX_BYTES = 100_000_000  # an index json of a trillion-parameter model is a few MB
_U64 = 2**64
# Bits per element of every dtype the safetensors format knows (F4/F6 are packed sub-byte types).
DTYPE_BITS = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}
# The dtypes experts can be read from (converted to the model's dtype on the way).
FLOAT_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets in the file (header included)
    end: int


@dataclass(frozen=True)
class _Identity:
    """What a file looked like when validated; a read compares the open file's against it."""

    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> "_Identity":
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def changes(self, now: "_Identity") -> str:
        what = [
            f"{name} {getattr(self, name)} -> {getattr(now, name)}"
            for name in ("size", "mtime_ns", "inode")
            if getattr(self, name) != getattr(now, name)
        ]
        return ", ".join(what)


def _open(file: Path) -> int:
    try:
        return os.open(file, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise FileNotFoundError(f"checkpoint: {file} does not exist") from None
    except OSError as e:
        raise ValueError(f"checkpoint: cannot open {file}: {e.strerror}") from None


def read_exact(fd: int, out: torch.Tensor, offset: int, file: Path | str) -> None:
    """Fill contiguous host tensor ``out`` with the file's bytes from ``offset`` (positioned reads: no shared file
    position, no mapping); a file that ends early is an error naming it."""
    buf = memoryview(out.view(-1).view(torch.uint8).numpy())  # view: a copy would take the bytes elsewhere
    done = 0
    while done < len(buf):
        if hasattr(os, "preadv"):
            n = os.preadv(fd, [buf[done:]], offset + done)
        else:  # no preadv (macOS before 11): one copy more
            chunk = os.pread(fd, len(buf) - done, offset + done)
            n = len(chunk)
            buf[done : done + n] = chunk
        if n == 0:
            raise RuntimeError(
                f"checkpoint: {file} ends at byte {offset + done}, inside data the checkpoint's header "
                f"places at bytes {offset}..{offset + len(buf)}: the file was truncated"
            )
        done += n


def _read_bytes(fd: int, n: int, offset: int, file: Path) -> bytes:
    out = torch.empty(n, dtype=torch.uint8)
    read_exact(fd, out, offset, file)
    return out.numpy().tobytes()


def _no_duplicates(pairs):
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key {next(k for k in keys if keys.count(k) > 1)!r}")
    return dict(pairs)


def _json(raw: bytes, file: Path, what: str):
    try:
        return json.loads(raw.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except UnicodeDecodeError as e:
        raise ValueError(f"checkpoint: {file}: the {what} is not UTF-8 ({e.reason} at byte {e.start})") from None
    except (ValueError, RecursionError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"checkpoint: {file}: the {what} is not valid JSON ({type(e).__name__}: {e})") from None


def _is_uints(value) -> bool:
    return isinstance(value, list) and all(type(v) is int and v >= 0 for v in value)


def _nbytes(dtype: str, shape: tuple[int, ...], where: str) -> int:
    """Bytes of a tensor, with safetensors' overflow rule (64-bit element and bit counts) and byte alignment."""
    n = 1
    for s in shape:
        n *= s
        if n >= _U64:
            raise ValueError(f"{where}: shape {list(shape)} overflows a 64-bit element count")
    bits = n * DTYPE_BITS[dtype]
    if bits >= _U64:
        raise ValueError(f"{where}: shape {list(shape)} of {dtype} overflows a 64-bit bit count")
    if bits % 8:
        raise ValueError(f"{where}: {n} elements of {dtype} do not end on a byte boundary")
    return bits // 8


def read_header(file: Path) -> tuple[dict[str, TensorInfo], _Identity]:
    """The tensors of one safetensors file, validated as the ``safetensors`` library validates them."""
    fd = _open(file)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"checkpoint: {file} is not a regular file")
        size = st.st_size
        if size < 8:
            raise ValueError(
                f"checkpoint: {file} is not a safetensors file: {size} bytes, less than the 8-byte header length"
            )
        n = int.from_bytes(_read_bytes(fd, 8, 0, file), "little")
        if n > MAX_HEADER_BYTES:
            raise ValueError(
                f"checkpoint: {file}: header length {n} exceeds safetensors' limit of "
                f"{MAX_HEADER_BYTES} bytes (not a safetensors file, or a corrupt one)"
            )
        if 8 + n > size:
            raise ValueError(
                f"checkpoint: {file}: header length {n} runs past the end of the file ({size} bytes; truncated?)"
            )
        header = _json(_read_bytes(fd, n, 8, file), file, "header")
    finally:
        os.close(fd)
    if not isinstance(header, dict):
        raise ValueError(f"checkpoint: {file}: the header is a JSON {type(header).__name__}, not an object")
    entries = []
    for key, info in header.items():
        if key == "__metadata__":
            if info is not None and not (isinstance(info, dict) and all(isinstance(v, str) for v in info.values())):
                raise ValueError(f"checkpoint: {file}: __metadata__ must map strings to strings")
            continue
        where = f"checkpoint: {file}: tensor {key!r}"
        if not isinstance(info, dict):
            raise ValueError(f"{where}: expected an object with dtype, shape and data_offsets")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            raise ValueError(f"{where}: unknown dtype {dtype!r} (safetensors knows {', '.join(DTYPE_BITS)})")
        if not _is_uints(shape):
            raise ValueError(f"{where}: shape must be a list of non-negative ints, got {shape!r}")
        if not (_is_uints(offsets) and len(offsets) == 2):
            raise ValueError(f"{where}: data_offsets must be two non-negative ints [begin, end], got {offsets!r}")
        entries.append((offsets[0], offsets[1], key, dtype, tuple(shape)))
    entries.sort(key=lambda t: (t[0], t[1]))
    tensors, at, base = {}, 0, 8 + n
    for begin, end, key, dtype, shape in entries:
        where = f"checkpoint: {file}: tensor {key!r}"
        if begin != at or end < begin:
            raise ValueError(
                f"{where}: data_offsets [{begin}, {end}] do not start where the previous tensor ends "
                f"({at}): the tensors' data must tile the file without gaps or overlaps"
            )
        if end - begin != _nbytes(dtype, shape, where):
            raise ValueError(
                f"{where}: data_offsets [{begin}, {end}] hold {end - begin} bytes, but {dtype} of "
                f"shape {list(shape)} needs {_nbytes(dtype, shape, where)}"
            )
        tensors[key] = TensorInfo(file, dtype, shape, base + begin, base + end)
        at = end
    if base + at != size:
        raise ValueError(
            f"checkpoint: {file}: the header places the data in bytes {base}..{base + at}, but the file "
            f"has {size} bytes ({'truncated' if base + at > size else 'trailing bytes'})"
        )
    return tensors, _Identity.of(st)


def _inside(folder: Path, name, index: Path) -> Path:
    """A shard named by an index: a relative path with no ``..``, so it stays inside the checkpoint folder."""
    if not isinstance(name, str) or not name or "\0" in name or os.path.isabs(name) or ".." in PurePath(name).parts:
        raise ValueError(f"checkpoint: {index} names shard {name!r}; shards must be relative paths inside {folder}")
    return folder / name


def _read_index(index: Path) -> dict[str, str]:
    fd = _open(index)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_INDEX_BYTES:
            raise ValueError(f"checkpoint: {index} has {size} bytes, more than an index's limit of {MAX_INDEX_BYTES}")
        data = _json(_read_bytes(fd, size, 0, index), index, "index")
    finally:
        os.close(fd)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise ValueError(f"checkpoint: {index} has no weight_map object (tensor name -> shard file)")
    return weight_map


def _int_or(text: str, default: int) -> int:
    return int(text) if text.isascii() and text.isdigit() else default


def _close_all(fds: dict) -> None:
    for fd in fds.values():
        os.close(fd)
    fds.clear()


class Checkpoint:
    """A ``save_pretrained`` safetensors checkpoint: a directory holding ``model.safetensors`` or
    ``model.safetensors.index.json`` and its shards, or one ``.safetensors`` file.

    Only headers are read here. :meth:`read_into` copies one tensor, or one slice along its first dimension,
    into a host tensor; read-only and shared by every layer and every copy of a model (``deepcopy`` keeps it).
    """

    def __init__(self, path: str | os.PathLike):
        if not isinstance(path, (str, os.PathLike)) or "\0" in os.fspath(path):
            raise ValueError(
                f"checkpoint: expected the path of a save_pretrained directory or a .safetensors file, got {path!r}"
            )
        path = Path(path)
        weight_map: dict[str, str] = {}
        if path.is_dir():
            index, single = path / "model.safetensors.index.json", path / "model.safetensors"
            if index.is_file():
                weight_map = _read_index(index)
                bad = next((v for v in weight_map.values() if not isinstance(v, str)), None)
                if bad is not None:
                    raise ValueError(f"checkpoint: {index} names shard {bad!r}; shards are file names")
                files = list(dict.fromkeys(_inside(path, name, index) for name in sorted(set(weight_map.values()))))
                for file in files:
                    if not file.is_file():
                        raise FileNotFoundError(f"checkpoint: shard {file} named by {index} does not exist")
            elif single.is_file():
                files = [single]
            else:
                raise FileNotFoundError(
                    f"checkpoint: {path} holds neither model.safetensors nor model.safetensors.index.json"
                )
        elif path.exists():
            files = [path]
        else:
            raise FileNotFoundError(f"checkpoint: {path} does not exist")
        self.path = path
        self.tensors: dict[str, TensorInfo] = {}
        self._identity: dict[Path, _Identity] = {}
        for file in files:
            found, self._identity[file] = read_header(file)
            for key, info in found.items():
                if key in self.tensors:
                    raise ValueError(f"checkpoint: tensor {key!r} is in both {self.tensors[key].file} and {file}")
                self.tensors[key] = info
        for key, name in weight_map.items():
            info = self.tensors.get(key)
            if info is None or info.file != path / name:
                raise ValueError(
                    f"checkpoint: {path / 'model.safetensors.index.json'} places tensor {key!r} in "
                    f"{name}, but {'no shard holds it' if info is None else f'{info.file} does'}"
                )
        self._fds: dict[Path, int] = {}
        self._closer = weakref.finalize(self, _close_all, self._fds)
        self._per_expert: dict[str, dict[int, dict[str, str]]] | None = None

    def __deepcopy__(self, memo) -> "Checkpoint":
        return self  # read-only: copies of a model share it

    def _fd(self, file: Path) -> int:
        """The open file, checked against the file validated: a file that changed is an error naming it."""
        fd = self._fds.get(file)
        if fd is None:
            fd = self._fds[file] = _open(file)
        was, now = self._identity[file], _Identity.of(os.fstat(fd))
        if now != was:
            raise RuntimeError(
                f"checkpoint: {file} changed since it was opened ({was.changes(now)}); the experts "
                "it holds are no longer the ones validated. Restore the file, or revert and offload "
                "again from a checkpoint that stays in place"
            )
        return fd

    def read_into(self, key: str, out: torch.Tensor, index: int | None = None) -> int:
        """Copy tensor ``key`` (its ``index``-th slice along dim 0 when given) into contiguous host tensor
        ``out``, converting the dtype; returns the bytes read. The tensor's dtype is one of FLOAT_DTYPES and
        its shape fits ``out`` (the caller validated both)."""
        info = self.tensors[key]
        begin, end, shape = info.begin, info.end, info.shape
        if index is not None:
            size = (end - begin) // shape[0]
            begin, end, shape = begin + index * size, begin + (index + 1) * size, shape[1:]
        if math.prod(shape) != out.numel():
            raise ValueError(
                f"checkpoint: {info.file}: tensor {key!r} has {math.prod(shape)} elements where {out.numel()} are read"
            )
        dtype = FLOAT_DTYPES[info.dtype]
        fd = self._fd(info.file)
        if dtype == out.dtype:
            read_exact(fd, out, begin, info.file)
        else:
            raw = torch.empty(end - begin, dtype=torch.uint8)
            read_exact(fd, raw, begin, info.file)
            out.view(-1).copy_(raw.view(dtype))
        self._fd(info.file)  # unchanged during the read, too
        return end - begin

    def per_expert_keys(self) -> dict[str, dict[int, dict[str, str]]]:
        """transformers' per-expert weights ``<container>.experts.<e>.<proj>.weight`` as
        ``{container: {e: {proj: key}}}``: one pass over the keys, however many layers look them up."""
        if self._per_expert is None:
            found: dict[str, dict[int, dict[str, str]]] = {}
            for key in self.tensors:
                head, sep, tail = key.rpartition(".experts.")
                parts = tail.split(".")
                if sep and len(parts) == 3 and parts[2] == "weight" and parts[0] == str(_int_or(parts[0], -1)):
                    found.setdefault(head, {}).setdefault(int(parts[0]), {})[parts[1]] = key
            self._per_expert = found
        return self._per_expert
