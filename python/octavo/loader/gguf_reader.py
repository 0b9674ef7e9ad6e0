"""A GGUF file's header: its metadata and its tensor table, with each tensor's data a numpy view
of the mapped file (nothing is read until used).

The gguf package's GGUFReader builds numpy views for every part of every metadata value, the
tokenizer's 100k strings included: 2.1 s of the default model's 2.4 s load (bench/RESULTS.md). Octavo reads the
tokenizer through transformers once and caches it (loader/__init__.py), and needs only the
number of strings here, so arrays of strings are walked and kept as their length. Format:
ggml's docs/gguf.md (versions 2 and 3: little-endian, 64-bit counts). The tensor types' names
and block sizes are the gguf package's.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Metadata value types (gguf.md, gguf_metadata_value_type) -> struct format of one value; an
# array of them is read as the numpy dtype of the same format.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
_MAX_DIMS = 4  # GGML_MAX_DIMS


@dataclass
class StringArray:
    """An array of strings in the metadata, kept as its length."""
    count: int

    def __len__(self) -> int:
        return self.count


@dataclass
class Tensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    data: np.ndarray     # rows first; block formats as uint8 [..., bytes per row]


class GgufReader:
    """``fields``: metadata key -> int, float, bool, str, numpy array of numbers or StringArray;
    ``tensors``: in the file's order. Raises ValueError for a file that is not GGUF v2 / v3."""

    def __init__(self, path: str | Path):
        self._bytes = np.memmap(path, dtype=np.uint8, mode="r")
        self._at = 0
        try:
            self._read_header()
        except (struct.error, UnicodeDecodeError, OverflowError) as e:
            raise ValueError(f"truncated or corrupt GGUF header ({e})") from None

    def _read_header(self) -> None:
        if bytes(self._bytes[:4]) != _MAGIC:
            raise ValueError("not a GGUF file (no GGUF magic)")
        self._at = 4
        version = self._scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (Octavo reads versions 2 and 3)")
        tensor_count, field_count = self._scalar("<Q"), self._scalar("<Q")
        self.fields = {}
        for _ in range(field_count):
            key = self._string()
            self.fields[key] = self._value(self._scalar("<I"))
        infos = [self._tensor_info() for _ in range(tensor_count)]
        alignment = self.fields.get("general.alignment", _DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment <= 0 or alignment % 8:
            raise ValueError(f"general.alignment must be a positive multiple of 8, got {alignment!r}")
        start = -(-self._at // alignment) * alignment
        self.tensors = [self._tensor(name, dims, type_id, start + offset) for name, dims, type_id, offset in infos]

    def _scalar(self, fmt: str):
        value = struct.unpack_from(fmt, self._bytes, self._at)[0]
        self._at += struct.calcsize(fmt)
        return value

    def _expect(self, n: int) -> None:
        """n more bytes must lie in the file (a corrupt count or length stops here, not after
        reading or looping through it)."""
        if n > len(self._bytes) - self._at:
            raise ValueError(f"truncated or corrupt GGUF header ({n} bytes wanted at offset {self._at}, "
                             f"{len(self._bytes) - self._at} left)")

    def _claim(self, n: int) -> int:
        """The offset of the next n bytes; moves past them."""
        self._expect(n)
        at, self._at = self._at, self._at + n
        return at

    def _string(self) -> str:
        n = self._scalar("<Q")
        at = self._claim(n)
        return bytes(self._bytes[at:at + n]).decode("utf-8")

    def _value(self, kind: int):
        if kind in _SCALARS:
            return self._scalar(_SCALARS[kind])
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF metadata type {kind}")
        item_kind, count = self._scalar("<I"), self._scalar("<Q")
        if item_kind in _SCALARS:
            dtype = np.dtype(_SCALARS[item_kind])
            return np.frombuffer(self._bytes, dtype, count, self._claim(count * dtype.itemsize)).copy()
        self._expect(8 * count)  # a string or an array takes 8 bytes at least
        if item_kind == _STRING:  # skipped: each is a 64-bit length and its bytes
            for _ in range(count):
                self._claim(self._scalar("<Q"))
            return StringArray(count)
        return [self._value(item_kind) for _ in range(count)]  # arrays of arrays

    def _tensor_info(self) -> tuple[str, list[int], int, int]:
        name = self._string()
        n_dims = self._scalar("<I")
        if n_dims > _MAX_DIMS:
            raise ValueError(f"GGUF tensor {name!r} has {n_dims} dimensions (at most {_MAX_DIMS})")
        dims = [self._scalar("<Q") for _ in range(n_dims)]
        return name, dims, self._scalar("<I"), self._scalar("<Q")

    def _tensor(self, name: str, dims: list[int], type_id: int, start: int) -> Tensor:
        import gguf

        try:
            kind = gguf.GGMLQuantizationType(type_id)
        except ValueError:
            raise ValueError(f"GGUF tensor {name!r} has unknown type {type_id}") from None
        shape = list(reversed(dims))  # GGUF lists the fastest dimension first
        if kind.name in ("F32", "F16", "F64", "I8", "I16", "I32", "I64"):
            dtype = np.dtype({"F32": "<f4", "F16": "<f2", "F64": "<f8", "I8": "<i1", "I16": "<i2", "I32": "<i4",
                              "I64": "<i8"}[kind.name])
        else:  # blocks (BF16 too: numpy has no bfloat16) as their bytes, row by row
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            if shape[-1] % block:
                raise ValueError(f"GGUF tensor {name!r}: rows of {shape[-1]} are not whole blocks of {block}")
            shape[-1] = shape[-1] // block * block_bytes
            dtype = np.dtype(np.uint8)
        count = math.prod(shape)
        if start + count * dtype.itemsize > len(self._bytes):
            raise ValueError(f"GGUF tensor {name!r} runs past the end of the file")
        return Tensor(name, kind, np.frombuffer(self._bytes, dtype, count, start).reshape(shape))
