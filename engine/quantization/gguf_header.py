"""A GGUF file's architecture and tensor table, read from its header alone.

gguf's own GGUFReader turns every metadata value into numpy views, a vocabulary's tens of thousands of strings
included, which costs seconds a start; the block products need only the tensors' names, types and bytes. This
walks the metadata by its lengths, keeps `general.architecture` and `general.alignment`, and maps the tensors'
data from the file as GGUFReader shapes it (the block types as rows of bytes). Layout: the GGUF specification
(ggml's docs/gguf.md); the type sizes come from the gguf package."""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# GGUF metadata value types: sizes of the fixed-width ones, by type code.
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_DENSE = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    n_bytes: int
    data: np.ndarray  # read-only view of the file


class _Cursor:
    def __init__(self, buffer):
        self.buffer, self.at = buffer, 0

    def take(self, fmt: str):
        values = struct.unpack_from("<" + fmt, self.buffer, self.at)
        self.at += struct.calcsize("<" + fmt)
        return values[0] if len(values) == 1 else values

    def string(self) -> bytes:
        length = self.take("Q")
        self.at += length
        return bytes(self.buffer[self.at - length:self.at])

    def skip_string(self) -> None:
        self.at += 8 + struct.unpack_from("<Q", self.buffer, self.at)[0]

    def value(self, kind: int, keep: bool):
        """One metadata value: returned where `keep`, else only stepped over."""
        if kind in _FIXED:
            size = _FIXED[kind]
            raw = self.buffer[self.at:self.at + size]
            self.at += size
            return int.from_bytes(raw, "little") if keep else None
        if kind == _STRING:
            return self.string().decode("utf-8") if keep else self.skip_string()
        if kind == _ARRAY:
            item, count = self.take("IQ")
            if item in _FIXED:
                self.at += _FIXED[item] * count
            else:
                for _ in range(count):
                    self.value(item, False)
            return None
        raise ValueError(f"unknown GGUF metadata type {kind}")


def read(path: Path) -> tuple[str, list[HeaderTensor]]:
    """The file's architecture name and its tensors, in the file's order."""
    import gguf

    mapped = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(mapped))
    magic, version = cursor.take("4sI")
    if magic != b"GGUF" or version < 2:
        raise ValueError(f"{path}: not a GGUF file of version 2 or later")
    n_tensors, n_kv = cursor.take("QQ")
    metadata = {}
    for _ in range(n_kv):
        key = cursor.string().decode("utf-8")
        kind = cursor.take("I")
        value = cursor.value(kind, keep=key in ("general.architecture", "general.alignment"))
        if value is not None:
            metadata[key] = value
    infos = []
    for _ in range(n_tensors):
        name = cursor.string().decode("utf-8")
        n_dims = cursor.take("I")
        dims = struct.unpack_from(f"<{n_dims}Q", cursor.buffer, cursor.at)
        cursor.at += 8 * n_dims
        kind, offset = cursor.take("IQ")
        infos.append((name, dims, gguf.GGMLQuantizationType(kind), offset))
    alignment = metadata.get("general.alignment") or gguf.GGUF_DEFAULT_ALIGNMENT
    start = -(-cursor.at // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        shape = tuple(reversed(dims))
        elements = int(np.prod(dims))
        block_size, type_size = gguf.GGML_QUANT_SIZES[kind]
        n_bytes = elements * type_size // block_size
        at = start + offset
        if kind.name in _DENSE:
            data = mapped[at:at + n_bytes].view(_DENSE[kind.name]).reshape(shape)
        else:
            data = mapped[at:at + n_bytes].reshape(gguf.quant_shape_to_byte_shape(shape, kind))
        tensors.append(HeaderTensor(name, kind, n_bytes, data))
    return metadata.get("general.architecture") or "", tensors
