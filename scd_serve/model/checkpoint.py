"""A checkpoint's safetensors files: which ones, their tensors memory-mapped, one fingerprint.

Which files: those model.safetensors.index.json names (a directory may hold others, e.g.
Mistral's consolidated.safetensors), else model.safetensors, else every *.safetensors but
consolidated*. Tensors are read through a private memory map: no copy of a tensor used as
stored, and pages the forward never touches are never read.

The fingerprint hashes the spec and every tensor's name, dtype, shape and bytes in name
order (independent of sharding and load dtype), and is cached per (files, sizes, mtimes) in
$SCD_CACHE_DIR (default ~/.cache/scd-serve): a restart does not hash gigabytes again.
"""

from __future__ import annotations

import hashlib
import json
import math
import mmap
import os
import struct
from contextlib import suppress
from pathlib import Path

import torch

from scd_serve.errors import ModelLoadError

Tensor = torch.Tensor
INDEX = "model.safetensors.index.json"
ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}
MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


def weight_files(path: Path) -> list[Path]:
    index = path / INDEX
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index}: unreadable index ({exc})") from None
        if missing := [n for n in names if not (path / n).is_file()]:
            raise ModelLoadError(f"{index} names {', '.join(missing[:3])}, not in {path}")
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    files = sorted(f for f in path.glob("*.safetensors") if not f.name.startswith("consolidated"))
    if not files:
        raise ModelLoadError(f"{path}: no *.safetensors weight files")
    return files


class Checkpoint:
    """Header entries of every file; tensors on demand, backed by the files' maps."""

    def __init__(self, files: list[Path]):
        self.files = files
        self.entries: dict[str, tuple[int, str, list[int], int, int]] = {}  # name -> (file, dtype, shape, start, end)
        self._maps: list[mmap.mmap | None] = [None] * len(files)
        for i, file in enumerate(files):
            for name, (dtype, shape, start, end) in _header(file).items():
                if name in self.entries:
                    raise ModelLoadError(f"{file.name}: tensor {name!r} is also in {files[self.entries[name][0]].name}")
                self.entries[name] = (i, dtype, shape, start, end)

    def tensor(self, name: str) -> Tensor:
        i, dtype, shape, start, end = self.entries[name]
        if dtype not in ST_DTYPES:
            raise ModelLoadError(f"{self.files[i].name}: tensor {name!r} has unsupported dtype {dtype}")
        if start == end:
            return torch.empty(shape, dtype=ST_DTYPES[dtype])
        return torch.frombuffer(self._map(i), dtype=ST_DTYPES[dtype], count=(end - start) // _size(dtype),
                                offset=start).view(shape)

    def raw(self, name: str) -> memoryview:
        i, _, _, start, end = self.entries[name]
        return memoryview(self._map(i))[start:end]

    def _map(self, i: int) -> mmap.mmap:
        if self._maps[i] is None:
            with open(self.files[i], "rb") as f:  # ACCESS_COPY: a private, writable view torch can wrap
                self._maps[i] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        return self._maps[i]

    def fingerprint(self, spec_json: str, names: list[str]) -> str:
        """hex sha256 of the spec and the named tensors (cached per file identity)."""
        stats = [(str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in self.files]
        key = hashlib.sha256(json.dumps([spec_json, sorted(names), stats]).encode()).hexdigest()
        if cached := _cache_get(key):
            return cached
        digest = hashlib.sha256(spec_json.encode())
        for name in sorted(names):
            _, dtype, shape, start, end = self.entries[name]
            digest.update(f"{name}|{ST_DTYPES.get(dtype, dtype)}|{tuple(shape)}".encode())
            if end > start:
                digest.update(self.raw(name))
        _cache_put(key, digest.hexdigest())
        return digest.hexdigest()


def _size(dtype: str) -> int:
    return torch.empty((), dtype=ST_DTYPES[dtype]).element_size()


def _header(file: Path) -> dict[str, tuple[str, list[int], int, int]]:
    """name -> (dtype, shape, absolute start, absolute end) from the file's JSON header."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if not 0 < n <= MAX_HEADER:
                raise ValueError(f"header length {n}")
            header = json.loads(f.read(n))
        size = file.stat().st_size
    except (OSError, ValueError, struct.error) as exc:
        raise ModelLoadError(f"{file}: cannot read safetensors ({exc})") from None
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = (8 + n + int(o) for o in entry["data_offsets"])
            dtype, shape = str(entry["dtype"]), [int(d) for d in entry["shape"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"{file}: bad header entry for {name!r} ({exc})") from None
        if not 8 + n <= start <= end <= size:
            raise ModelLoadError(f"{file}: tensor {name!r} lies outside the file")
        if dtype in ST_DTYPES and (end - start) != _size(dtype) * math.prod(shape):
            raise ModelLoadError(f"{file}: tensor {name!r} has {end - start} bytes, {dtype}{shape} needs "
                                 f"{_size(dtype) * math.prod(shape)}")
        out[name] = (dtype, shape, start, end)
    return out


def cache_dir() -> Path:
    """Where a worker keeps what it computed once: $SCD_CACHE_DIR, default ~/.cache/scd-serve."""
    return Path(os.environ.get("SCD_CACHE_DIR") or Path.home() / ".cache" / "scd-serve")


def _cache_file() -> Path:
    return cache_dir() / "fingerprints.json"


def _cache_get(key: str) -> str | None:
    try:
        return json.loads(_cache_file().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None


def _cache_put(key: str, value: str) -> None:
    """Best effort: a read-only home (a locked-down container) only costs the next start a rehash."""
    path = _cache_file()
    with suppress(OSError, TypeError, ValueError):
        try:
            table = json.loads(path.read_text())
        except (OSError, ValueError):
            table = {}
        table = dict(list(table.items())[-255:]) | {key: value}  # bounded: the newest 256 checkpoints
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(table))
        os.replace(tmp, path)
