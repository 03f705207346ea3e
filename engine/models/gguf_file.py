"""A lean reader of GGUF files: header metadata and tensor locations over one memory map.

`gguf.GGUFReader` materializes every array in the header as numpy views, which for a tokenizer of
50k tokens and merges takes seconds per open. Model loading needs only the scalar settings, the
length of the token list and where each tensor's bytes are, so this reader skips array contents.
Dequantization is gguf-py's (kernels/gguf_blocks.py).
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, quant_shape_to_byte_shape

from kernels.gguf_blocks import dequantize_blocks

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_DEFAULT_ALIGNMENT = 32


@dataclasses.dataclass(frozen=True)
class GGUFArray:
    """An array in the header, known by its element type and length only."""

    element_type: int
    length: int

    def __len__(self) -> int:
        return self.length


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    """Name, numpy-order shape, quantization type and absolute byte offset of one tensor."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int


class GGUFFile:
    """Metadata and tensors of one GGUF file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open("rb") as file:
            self._map = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        if self._map[:4] != _MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic number)")
        self._pos = 4
        version, tensor_count, kv_count = self._read("I"), self._read("Q"), self._read("Q")
        if version < 2:
            raise ValueError(f"{self.path}: GGUF version {version} is too old (2 or newer is supported)")
        self.metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._read_string()
            self.metadata[key] = self._read_value(self._read("I"))
        infos = []
        for _ in range(tensor_count):
            name = self._read_string()
            dims = [self._read("Q") for _ in range(self._read("I"))]
            infos.append(
                (name, tuple(reversed(dims)), GGMLQuantizationType(self._read("I")), self._read("Q"))
            )
        alignment = self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT)
        data_start = -(-self._pos // alignment) * alignment
        self.tensors = [
            GGUFTensorInfo(name, shape, qtype, data_start + offset) for name, shape, qtype, offset in infos
        ]

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw_blocks(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor's bytes as stored (uint8, its rows in numpy order, a view of the file's map);
        ValueError naming the tensor where the file ends before them."""
        byte_shape = quant_shape_to_byte_shape(info.shape, info.qtype)
        size = int(np.prod(byte_shape))
        if info.offset + size > len(self._map):
            raise ValueError(
                f"{self.path}: tensor {info.name!r} ({info.qtype.name}, shape {list(info.shape)}) needs "
                f"bytes up to {info.offset + size}, but the file ends at {len(self._map)} (truncated?)"
            )
        return np.frombuffer(self._map, dtype=np.uint8, count=size, offset=info.offset).reshape(byte_shape)

    def dequantize(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor as float32 in numpy order (a fresh, writable array)."""
        return dequantize_blocks(self.raw_blocks(info), info.qtype)

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _read_string(self) -> str:
        length = self._read("Q")
        text = self._map[self._pos : self._pos + length].decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _read_value(self, value_type: int) -> Any:
        if value_type == _STRING:
            return self._read_string()
        if value_type == _ARRAY:
            element_type, length = self._read("I"), self._read("Q")
            self._skip_array(element_type, length)
            return GGUFArray(element_type, length)
        if value_type not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {value_type}")
        return self._read(_SCALARS[value_type])

    def _skip_array(self, element_type: int, length: int) -> None:
        if element_type in _SCALARS:
            self._pos += struct.calcsize("<" + _SCALARS[element_type]) * length
        elif element_type == _STRING:
            for _ in range(length):
                self._pos += 8 + struct.unpack_from("<Q", self._map, self._pos)[0]
        else:
            for _ in range(length):
                self._read_value(element_type)
