"""A lean reader of GGUF files: header metadata and tensor locations over one memory map.

`gguf.GGUFReader` materializes every array in the header as numpy views, which for a tokenizer of
50k tokens and merges takes seconds per open. Model loading needs only the scalar settings, the
length of the token list and where each tensor's bytes are, so this reader skips array contents.
Dequantization is still `gguf.quants.dequantize`.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, quant_shape_to_byte_shape, quants
from gguf.quants import dequantize

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_DEFAULT_ALIGNMENT = 32
# Block formats that gguf dequantizes without lookup grids (the i-quants set theirs up in `dequantize`).
_WHOLE_TENSOR_TYPES = frozenset(
    {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
)


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

    def dequantize(self, info: GGUFTensorInfo) -> np.ndarray:
        """The tensor as float32 in numpy order (a fresh, writable array)."""
        byte_shape = quant_shape_to_byte_shape(info.shape, info.qtype)
        raw = np.frombuffer(self._map, dtype=np.uint8, count=int(np.prod(byte_shape)), offset=info.offset)
        if info.qtype.name in _WHOLE_TENSOR_TYPES:
            # The whole tensor in one numpy pass: gguf's own `dequantize` goes 16 rows at a time, a
            # third of a load's seconds in Python overhead for a small model.
            values = getattr(quants, info.qtype.name).dequantize_rows(raw.reshape(byte_shape))
        else:
            values = dequantize(raw.reshape(byte_shape), info.qtype)
        return values if values.flags.writeable else values.copy()

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
