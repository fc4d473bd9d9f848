"""The GGUF file format (llama.cpp's): header, tensor table, and tensors dequantised to fp32.

The header (metadata and tensor table) is parsed here with `struct` against gguf's own enums and
block sizes, and each tensor is dequantised by `gguf.quants.dequantize` (vectorised numpy), or, for
Q8_0/Q4_0/Q4_1, by the same arithmetic in torch (below, ~1.8x faster). We do not use
`gguf.GGUFReader` because it builds a numpy view per metadata element: ~100k views for
SmolLM2's vocabulary and merges, ~5 s on this machine against ~0.2 s for a plain parse.

GGUF writes shapes fastest-moving dimension first (ggml's `ne`), the reverse of numpy/torch;
every shape in this module is in numpy order.
"""
from __future__ import annotations

import mmap
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

# struct formats of the fixed-size metadata value types (little-endian)
_SCALAR_FORMATS = {
    gguf.GGUFValueType.UINT8: "<B", gguf.GGUFValueType.INT8: "<b",
    gguf.GGUFValueType.UINT16: "<H", gguf.GGUFValueType.INT16: "<h",
    gguf.GGUFValueType.UINT32: "<I", gguf.GGUFValueType.INT32: "<i",
    gguf.GGUFValueType.UINT64: "<Q", gguf.GGUFValueType.INT64: "<q",
    gguf.GGUFValueType.FLOAT32: "<f", gguf.GGUFValueType.FLOAT64: "<d",
    gguf.GGUFValueType.BOOL: "<?",
}

class GGUFError(ValueError):
    """A GGUF file that cannot be read or does not match what the model it declares needs."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]      # numpy order (GGUF's ne reversed)
    qtype: gguf.GGMLQuantizationType
    start: int                  # absolute byte offset in the file
    nbytes: int


@dataclass
class GGUFFile:
    """A parsed GGUF header plus a read-only map of the file (tensor bytes are read on demand)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    _map: mmap.mmap

    @property
    def architecture(self) -> str:
        return self.metadata.get("general.architecture", "<none>")

    def raw(self, name: str) -> np.ndarray:
        """The stored bytes of one tensor as uint8, shaped (*rows, bytes_per_row)."""
        info = self.tensor_info(name)
        data = np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.start)
        return data.reshape(*info.shape[:-1], -1)

    def tensor_info(self, name: str) -> TensorInfo:
        if name not in self.tensors:
            raise GGUFError(f"{self.path}: missing tensor {name!r}")
        return self.tensors[name]

    def dequantize(self, name: str) -> torch.Tensor:
        """One tensor as fp32 in numpy/torch shape, whatever its storage type (F32, F16, Q4_1, Q8_0...)."""
        info = self.tensor_info(name)
        try:
            if info.qtype in _TORCH_DEQUANTIZE:
                with warnings.catch_warnings():          # the map is read-only; we only read it
                    warnings.simplefilter("ignore", UserWarning)
                    blocks = torch.from_numpy(self.raw(name)).reshape(-1, gguf.GGML_QUANT_SIZES[info.qtype][1])
                return _TORCH_DEQUANTIZE[info.qtype](blocks).reshape(info.shape)
            out = gguf.quants.dequantize(self.raw(name), info.qtype)
        except (NotImplementedError, ValueError, RuntimeError) as e:
            raise GGUFError(f"{self.path}: cannot dequantize tensor {name!r} "
                            f"({info.qtype.name}, shape {info.shape}): {e}") from e
        # F32 comes back as a view of the read-only map: copy so torch gets writable memory
        return torch.from_numpy(out.reshape(info.shape) if out.flags.writeable else out.reshape(info.shape).copy())


# The three block formats of nearly every Llama GGUF, dequantised with torch: the same arithmetic
# as gguf.quants (bit-identical results) in fewer passes over memory, ~1.8x faster. A block holds
# 32 weights: fp16 scale d [, fp16 min m], then int8 values (Q8_0) or 4-bit values, the low
# nibbles of the 16 bytes being weights 0-15 and the high nibbles weights 16-31.
def _scale(blocks: torch.Tensor, at: int) -> torch.Tensor:
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()           # (blocks, 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat((qs & 0x0F, qs >> 4), dim=1)                                   # (blocks, 32) uint8


def _dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:     # w = d * q, q int8
    return blocks[:, 2:].view(torch.int8).float().mul_(_scale(blocks, 0))


def _dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:     # w = d * (q - 8), q in 0..15
    return (_nibbles(blocks[:, 2:]).to(torch.int8) - 8).float().mul_(_scale(blocks, 0))


def _dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:     # w = d * q + m, q in 0..15
    return _nibbles(blocks[:, 4:]).float().mul_(_scale(blocks, 0)).add_(_scale(blocks, 2))


_TORCH_DEQUANTIZE = {
    gguf.GGMLQuantizationType.Q8_0: _dequantize_q8_0,
    gguf.GGMLQuantizationType.Q4_0: _dequantize_q4_0,
    gguf.GGMLQuantizationType.Q4_1: _dequantize_q4_1,
}


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file: a short file raises GGUFError."""

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0
        self.reading = "the header"    # named in the error if the file ends early

    def take(self, n: int) -> int:
        start = self.pos
        if start + n > len(self.buf):
            raise GGUFError(f"{self.path}: file is truncated ({len(self.buf)} bytes) while reading "
                            f"{self.reading}; it needs at least {start + n} bytes")
        self.pos += n
        return start

    def scalar(self, fmt: str) -> Any:
        return struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        start = self.take(n)
        return self.buf[start:start + n].decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        vtype = gguf.GGUFValueType(vtype)
        if vtype in _SCALAR_FORMATS:
            return self.scalar(_SCALAR_FORMATS[vtype])
        if vtype == gguf.GGUFValueType.STRING:
            return self.string()
        if vtype == gguf.GGUFValueType.ARRAY:
            item_type, count = gguf.GGUFValueType(self.scalar("<I")), self.scalar("<Q")
            if item_type in _SCALAR_FORMATS:         # numeric arrays (token types) in one read
                dtype = np.dtype(_SCALAR_FORMATS[item_type])
                start = self.take(count * dtype.itemsize)
                return np.frombuffer(self.buf, dtype=dtype, count=count, offset=start).tolist()
            return [self.value(item_type) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} while reading {self.reading}")


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse the header and tensor table of a GGUF (v2/v3, little-endian) file."""
    path = Path(path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise GGUFError(f"{path}: file is empty (truncated), not a GGUF file")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    cur = _Cursor(buf, path)
    try:
        return _parse(cur, buf, path)
    except (struct.error, UnicodeDecodeError, OverflowError, ValueError) as e:
        if isinstance(e, GGUFError):
            raise
        raise GGUFError(f"{path}: corrupt GGUF while reading {cur.reading}: {e}") from e


def _parse(cur: _Cursor, buf: mmap.mmap, path: Path) -> GGUFFile:
    cur.reading = "the magic number"
    if cur.scalar("<I") != gguf.GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (bad magic number)")
    cur.reading = "the version"
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: GGUF version {version} is not supported (2 or 3, little-endian)")
    tensor_count, kv_count = cur.scalar("<Q"), cur.scalar("<Q")

    metadata: dict[str, Any] = {}
    for i in range(kv_count):
        cur.reading = f"metadata entry {i}"
        key = cur.string()
        cur.reading = f"metadata key {key!r}"
        metadata[key] = cur.value(cur.scalar("<I"))

    table = []
    for i in range(tensor_count):
        cur.reading = f"tensor table entry {i}"
        name = cur.string()
        cur.reading = f"the table entry of tensor {name!r}"
        n_dims = cur.scalar("<I")
        ne = [cur.scalar("<Q") for _ in range(n_dims)]
        qtype = gguf.GGMLQuantizationType(cur.scalar("<I"))
        offset = cur.scalar("<Q")
        table.append((name, tuple(reversed(ne)), qtype, offset))

    # tensor data starts at the next multiple of the alignment after the table
    alignment = int(metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT))
    data_start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, TensorInfo] = {}
    for name, shape, qtype, offset in table:
        if qtype not in gguf.GGML_QUANT_SIZES:
            raise GGUFError(f"{path}: tensor {name!r} has storage type {qtype.name}, unknown to gguf")
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n_elements = int(np.prod(shape, dtype=np.int64))
        if shape and shape[-1] % block_size:
            raise GGUFError(f"{path}: tensor {name!r} has rows of {shape[-1]} values, "
                            f"not a multiple of the {qtype.name} block ({block_size})")
        info = TensorInfo(name, shape, qtype, data_start + offset, n_elements // block_size * type_size)
        if info.start + info.nbytes > len(buf):
            raise GGUFError(f"{path}: file is truncated: tensor {name!r} needs bytes "
                            f"[{info.start}, {info.start + info.nbytes}) but the file has {len(buf)}")
        tensors[name] = info
    return GGUFFile(path, metadata, tensors, buf)
