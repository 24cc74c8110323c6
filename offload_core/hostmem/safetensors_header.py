"""The tensor table of a safetensors file, read and checked before anything is built from it.

A checkpoint may come from anywhere, so its header is held to the rules the safetensors library
itself enforces (``Metadata::validate`` of safetensors 0.8), and to a few more, before a single
tensor is attached to a model: a header length above zero, at most 100 MB and inside the file; a
UTF-8 JSON object (no ``NaN``, no name given twice, no unpaired surrogate escape);
``__metadata__``, if present, a map of strings to strings; every tensor a known dtype, a shape of non-negative integers, a pair of
offsets ``begin <= end`` whose span is exactly the shape's bytes; and the tensors, in offset
order, covering the data section exactly (each begins where the previous one ends, the last ends
at the end of the file), so that no tensor points into the header or past the end, and no two
share bytes. Each violation is a :class:`~offload_core.base.errors.CheckpointError` naming the file and
the tensor.

The header is read through one descriptor and ``os.pread``, never ``mmap``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import torch

from ..base.errors import CheckpointError

#: the largest header accepted, as the safetensors library's ``MAX_HEADER_SIZE``
MAX_HEADER_BYTES = 100_000_000

#: bits per element of every dtype code the safetensors format defines
BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}

#: the torch dtype of each code this torch has; the sub-byte codes have none (torch packs two
#: 4-bit floats per element, safetensors counts each)
DTYPES = {
    code: dtype for code, name in {
        "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
        "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
        "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16", "I32": "int32", "U32": "uint32",
        "F32": "float32", "C64": "complex64", "F64": "float64", "I64": "int64", "U64": "uint64",
    }.items() if isinstance(dtype := getattr(torch, name, None), torch.dtype)
}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One tensor of the table: its dtype code, shape and byte span in the data section."""

    name: str
    code: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclasses.dataclass(frozen=True)
class Header:
    """A checked tensor table: where the data section starts, and every tensor by name."""

    path: str
    data_start: int
    tensors: dict[str, Entry]
    metadata: dict[str, str]


def read_header(path: str) -> Header:
    """The checked tensor table of the safetensors file at ``path``."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise CheckpointError(f"{path}: {size} bytes, shorter than the 8-byte header length of a safetensors file")
        (length,) = struct.unpack("<Q", _pread(fd, 8, 0))
        if length == 0:
            raise CheckpointError(f"{path}: the header length is 0; a safetensors header is a JSON object")
        if length > MAX_HEADER_BYTES:
            raise CheckpointError(f"{path}: the header length is {length} bytes, above the {MAX_HEADER_BYTES} "
                                  "a safetensors header may take")
        if 8 + length > size:
            raise CheckpointError(f"{path}: the header length is {length} bytes, but the file has only "
                                  f"{size - 8} after it")
        raw = _pread(fd, length, 8)
    finally:
        os.close(fd)
    table = _parse(path, raw)
    metadata = table.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and
                                     all(isinstance(v, str) for v in metadata.values())):
        raise CheckpointError(f"{path}: __metadata__ is {_short(metadata)}; safetensors allows a map of strings "
                              "to strings")
    tensors = {name: _entry(path, name, info) for name, info in table.items()}
    _check_coverage(path, tensors, size - 8 - length)
    return Header(path, 8 + length, tensors, dict(metadata or {}))


def _pread(fd: int, count: int, offset: int) -> bytes:
    chunks = []
    while count:
        chunk = os.pread(fd, count, offset)
        if not chunk:
            raise EOFError("the file changed size while its header was read")
        chunks.append(chunk)
        count -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _parse(path: str, raw: bytes) -> dict:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: the header is not UTF-8 ({exc})") from None
    try:
        table = json.loads(text, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise CheckpointError(f"{path}: the header is not valid JSON ({exc})") from None
    if not isinstance(table, dict):
        raise CheckpointError(f"{path}: the header is a JSON {type(table).__name__}, not an object of tensors")
    return table


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """An object of the header: no name twice, no string that is not Unicode (JSON's escapes can
    spell half a UTF-16 surrogate pair, which Python takes and the safetensors library refuses)."""
    for text in (s for pair in pairs for s in pair if isinstance(s, str)):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{text!r} holds an unpaired surrogate escape") from None
    table = dict(pairs)
    if len(table) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"{twice!r} is given twice")
    return table


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _entry(path: str, name: str, info: object) -> Entry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict):
        raise CheckpointError(f"{where} is {_short(info)}, not an object with dtype, shape and data_offsets")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in info]
    if missing:
        raise CheckpointError(f"{where} has no {' and no '.join(missing)}")
    code, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not isinstance(code, str) or code not in BITS:
        raise CheckpointError(f"{where} has dtype {_short(code)}, which safetensors does not define")
    if not (isinstance(shape, list) and all(_natural(s) for s in shape)):
        raise CheckpointError(f"{where} has shape {_short(shape)}; a shape is a list of non-negative integers")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_natural(o) for o in offsets)):
        raise CheckpointError(f"{where} has data_offsets {_short(offsets)}; they are two non-negative integers")
    begin, end = offsets
    if begin > end:
        raise CheckpointError(f"{where} has data_offsets {offsets}: it ends before it begins")
    numel = 1
    for s in shape:
        numel *= s
    bits = numel * BITS[code]
    if bits % 8 or bits // 8 != end - begin:
        raise CheckpointError(f"{where} spans {end - begin} bytes, but shape {shape} of {code} takes {bits / 8:g}")
    return Entry(name, code, tuple(shape), begin, end)


def _natural(value: object) -> bool:
    return type(value) is int and value >= 0  # not a bool, not a float


def _check_coverage(path: str, tensors: dict[str, Entry], data_bytes: int) -> None:
    """The tensors, in offset order, cover ``data_bytes`` exactly: none outside the data
    section, none sharing a byte with another, no byte that no tensor holds."""
    for e in tensors.values():
        if e.end > data_bytes:
            raise CheckpointError(f"{path}: tensor {e.name!r} has data_offsets [{e.begin}, {e.end}], past the end "
                                  f"of the data section ({data_bytes} bytes)")
    reached, previous = 0, None
    for e in sorted(tensors.values(), key=lambda e: (e.begin, e.end)):
        if e.begin < reached:
            raise CheckpointError(f"{path}: tensor {e.name!r} (bytes {e.begin} to {e.end}) overlaps tensor "
                                  f"{previous.name!r} (bytes {previous.begin} to {previous.end})")
        if e.begin > reached:
            raise CheckpointError(f"{path}: bytes {reached} to {e.begin} of the data section belong to no tensor "
                                  f"(tensor {e.name!r} begins at {e.begin})")
        reached, previous = e.end, e
    if reached != data_bytes:
        raise CheckpointError(f"{path}: bytes {reached} to {data_bytes} at the end of the data section belong to "
                              "no tensor")


def _short(value: object) -> str:
    text = json.dumps(value) if not isinstance(value, (bytes, set)) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
