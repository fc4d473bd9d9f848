"""A GGUF checkpoint rewritten with its weights in F32, F16 or BF16: the same numbers as the shipped file
(dequantised, as ablate reads them), in the byte budget of ablate's fp32 or a half-precision engine, so
that an outside engine's speed is compared on the bytes it must stream, not on a smaller quantised file.

Metadata (the tokenizer, the shape, the chat template) is copied unchanged except the file type; 1-D
tensors (norms) stay F32 in an F16 or BF16 file, as llama.cpp's own converter writes them. The result is
cached in ~/.cache/ablate/gguf/<name>-<key>-<type>.gguf, keyed by the source's path,
size and modification time, so each source is rewritten once."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

TYPES = ("f32", "f16", "bf16")


def cache_dir(kind: str) -> Path:
    """Where files written for outside engines are kept: ~/.cache/ablate/<kind> (XDG_CACHE_HOME honoured)."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ablate" / kind


def rewritten_gguf(source: Path, weights: str) -> Path:
    """`source` with its weights in `weights` (f32 | f16 | bf16), written once into cache_dir("gguf")."""
    if weights not in TYPES:
        raise ValueError(f"a GGUF can be rewritten in {' or '.join(TYPES)}, not {weights!r}")
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    target = cache_dir("gguf") / f"{source.stem}-{key}-{weights}.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        _rewrite(source, partial, weights)
        partial.replace(target)          # whole or absent: an interrupted write is never read as a checkpoint
    return target


def _rewrite(source: Path, target: Path, weights: str) -> None:
    import gguf

    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    writer = gguf.GGUFWriter(target, arch)
    skip = {gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE}
    for field in reader.fields.values():
        if field.name in skip or field.name.startswith("GGUF."):    # written by the writer itself
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "bf16": gguf.LlamaFileType.MOSTLY_BF16}[weights]
    writer.add_file_type(file_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)   # numpy order
        if weights == "f16" and values.ndim > 1:
            writer.add_tensor(tensor.name, values.astype(np.float16), raw_dtype=gguf.GGMLQuantizationType.F16)
        elif weights == "bf16" and values.ndim > 1:     # round to nearest even, as torch's cast does
            bf16 = gguf.quants.quantize(values, gguf.GGMLQuantizationType.BF16)     # (..., 2 n) bytes: the writer
            writer.add_tensor(tensor.name, bf16, raw_dtype=gguf.GGMLQuantizationType.BF16)   # reads the shape off them
        else:
            writer.add_tensor(tensor.name, values, raw_dtype=gguf.GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
