"""Checked safetensors files: numpy arrays + string metadata + a CRC-32 over header and payload.

The file is plain safetensors (8-byte little-endian header length, JSON header
``{name: {dtype, shape, data_offsets}, "__metadata__": {str: str}}``, raw little-endian bytes),
so ``mlx.core.load`` and the ``safetensors`` package read it. One extra metadata key,
``checksum`` (``crc32:<8 hex>``), covers the canonical header JSON (with the checksum zeroed)
and every payload byte, so a torn, truncated or bit-flipped file is rejected on read.

    plan = plan_file(tensors, {"kind": "kv"})        # cheap: layout + header, no data touched
    checksum = write_file(tmp_path, plan, tensors)    # streams + fsyncs; returns the checksum
    tensors, metadata = read_file(path, expected_size=plan.size)   # raises CorruptFile
    metadata = verify_file(path, expected_size=plan.size)            # same checks, no arrays kept

numpy + stdlib only (no MLX): writes run on a background thread, reads on the inference thread.
CRC-32 (zlib, ~6 GB/s here) rather than a cryptographic hash: it guards against torn writes and
disk corruption, not an adversary, and it sits on the load path of every disk hit.
"""
from __future__ import annotations

import json
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CHECKSUM_KEY = "checksum"
_CHECKSUM_PLACEHOLDER = "crc32:00000000"
_CHUNK = 8 * 1024 * 1024           # stream in 8 MiB pieces: cache-friendly CRC, bounded copies
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors package's own limit

# numpy dtype -> safetensors code. bfloat16 has no numpy dtype: callers store it as uint16 bits.
DTYPE_CODES: dict[np.dtype, str] = {
    np.dtype(np.float64): "F64", np.dtype(np.float32): "F32", np.dtype(np.float16): "F16",
    np.dtype(np.int64): "I64", np.dtype(np.int32): "I32", np.dtype(np.int16): "I16", np.dtype(np.int8): "I8",
    np.dtype(np.uint64): "U64", np.dtype(np.uint32): "U32", np.dtype(np.uint16): "U16", np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}
_CODE_DTYPES: dict[str, np.dtype] = {code: dt.newbyteorder("<") for dt, code in DTYPE_CODES.items()}


class CorruptFile(ValueError):
    """The file is torn, truncated, malformed or fails its checksum; it must never be served."""


@dataclass(frozen=True, slots=True)
class TensorSlot:
    name: str
    code: str                 # safetensors dtype code
    shape: tuple[int, ...]
    start: int                # byte offsets into the payload (after the header)
    end: int


@dataclass(frozen=True, slots=True)
class FilePlan:
    """Everything about a file that is known before its bytes are read: sizes and header."""

    slots: tuple[TensorSlot, ...]
    metadata: dict[str, str]  # without the checksum
    header_len: int           # JSON header bytes, padded so the payload starts 8-byte aligned
    payload_len: int

    @property
    def size(self) -> int:
        return 8 + self.header_len + self.payload_len


# ---------------------------------------------------------------------------- pure helpers
def dtype_code(arr: np.ndarray, name: str) -> str:
    """The safetensors code for ``arr``'s dtype; ValueError naming the tensor if unsupported."""
    code = DTYPE_CODES.get(arr.dtype.newbyteorder("="))
    if code is None:
        supported = ", ".join(sorted(str(d) for d in DTYPE_CODES))
        raise ValueError(f"tensor {name!r} has dtype {arr.dtype}; supported: {supported} "
                         "(store bfloat16 as its uint16 bits)")
    return code


def plan_file(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> FilePlan:
    """Layout and header size for ``tensors``. Wider dtypes come first, so every tensor starts
    aligned to its item size (safetensors forbids gaps, so alignment must come from order)."""
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"safetensors metadata must map str to str, got {key!r}: {type(value).__name__}")
    if CHECKSUM_KEY in metadata:
        raise ValueError(f"metadata key {CHECKSUM_KEY!r} is reserved for the file checksum")
    for name, arr in tensors.items():
        if not isinstance(name, str) or name == "__metadata__":
            raise ValueError(f"{name!r} is not a valid tensor name")
        if not isinstance(arr, np.ndarray):
            raise TypeError(f"tensor {name!r} is {type(arr).__name__}, expected numpy.ndarray")
    order = sorted(tensors, key=lambda n: (-tensors[n].dtype.itemsize, n))
    slots, pos = [], 0
    for name in order:
        arr = tensors[name]
        code = dtype_code(arr, name)
        slots.append(TensorSlot(name, code, tuple(int(d) for d in arr.shape), pos, pos + arr.nbytes))
        pos += arr.nbytes
    plan = FilePlan(tuple(slots), dict(metadata), 0, pos)
    return FilePlan(plan.slots, plan.metadata, len(_padded(_header_json(plan, _CHECKSUM_PLACEHOLDER))), pos)


def _header_dict(slots, metadata: Mapping[str, str], checksum: str) -> dict:
    header: dict = {s.name: {"dtype": s.code, "shape": list(s.shape), "data_offsets": [s.start, s.end]}
                    for s in slots}
    header["__metadata__"] = {**metadata, CHECKSUM_KEY: checksum}
    return header


def _canonical(header: dict) -> bytes:
    return json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _header_json(plan: FilePlan, checksum: str) -> bytes:
    return _canonical(_header_dict(plan.slots, plan.metadata, checksum))


def _padded(header: bytes) -> bytes:
    # Spaces after the JSON are allowed by the format; they align the payload to 8 bytes.
    return header + b" " * (-(8 + len(header)) % 8)


def parse_header(raw: bytes, payload_len: int) -> tuple[tuple[TensorSlot, ...], dict[str, str]]:
    """Validate a header against the payload length: known dtypes, shapes that match their
    byte ranges, ranges that tile the payload exactly (no gaps, overlaps or trailing bytes)."""
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptFile(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptFile("header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CorruptFile("__metadata__ is not a str -> str map")
    slots = []
    for name, desc in header.items():
        try:
            code, shape, (start, end) = desc["dtype"], tuple(desc["shape"]), desc["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise CorruptFile(f"tensor {name!r}: malformed descriptor {desc!r}") from None
        if code not in _CODE_DTYPES:
            raise CorruptFile(f"tensor {name!r}: unknown dtype {code!r}")
        if not all(isinstance(d, int) and d >= 0 for d in shape) or not (
            isinstance(start, int) and isinstance(end, int) and 0 <= start <= end
        ):
            raise CorruptFile(f"tensor {name!r}: bad shape {shape} or offsets {[start, end]}")
        if int(np.prod(shape, dtype=np.int64)) * _CODE_DTYPES[code].itemsize != end - start:
            raise CorruptFile(f"tensor {name!r}: shape {shape} does not fill offsets {[start, end]}")
        slots.append(TensorSlot(name, code, shape, start, end))
    slots.sort(key=lambda s: (s.start, s.end))
    pos = 0
    for s in slots:
        if s.start != pos:
            raise CorruptFile(f"tensor {s.name!r} starts at {s.start}, expected {pos} (gap or overlap)")
        pos = s.end
    if pos != payload_len:
        raise CorruptFile(f"tensors cover {pos} payload bytes, file has {payload_len} (torn or padded)")
    return tuple(slots), metadata


def checksum_of_header(slots, metadata: Mapping[str, str]) -> int:
    """CRC-32 state after the canonical header with the checksum zeroed (the payload follows)."""
    meta = {k: v for k, v in metadata.items() if k != CHECKSUM_KEY}
    return zlib.crc32(_canonical(_header_dict(slots, meta, _CHECKSUM_PLACEHOLDER)))


def _format_checksum(crc: int) -> str:
    return f"crc32:{crc & 0xFFFFFFFF:08x}"


def _byte_view(arr: np.ndarray) -> memoryview:
    little = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
    flat = np.ascontiguousarray(little).reshape(-1)
    return memoryview(flat.view(np.uint8))


# ---------------------------------------------------------------------------- file I/O
def write_file(path: Path, plan: FilePlan, tensors: Mapping[str, np.ndarray]) -> str:
    """Create ``path`` (must not exist), stream the tensors while checksumming, patch the header
    in place (same length: the checksum is fixed-width), fsync. Returns the checksum. The file is
    0600 from its creation, whatever the umask: it holds a prompt's tokens."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)    # exact (a umask can only take bits away; this puts owner rw back)
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "wb") as f:
        placeholder = _padded(_header_json(plan, _CHECKSUM_PLACEHOLDER))
        f.write(plan.header_len.to_bytes(8, "little") + placeholder)
        crc = checksum_of_header(plan.slots, plan.metadata)
        for slot in plan.slots:
            view = _byte_view(tensors[slot.name])
            if len(view) != slot.end - slot.start:
                raise RuntimeError(f"bug: tensor {slot.name!r} changed size after planning "
                                   f"({len(view)} != {slot.end - slot.start} bytes)")
            for i in range(0, len(view), _CHUNK):
                chunk = view[i:i + _CHUNK]
                crc = zlib.crc32(chunk, crc)
                f.write(chunk)
        checksum = _format_checksum(crc)
        f.seek(8)
        f.write(_padded(_header_json(plan, checksum)))
        f.flush()
        os.fsync(f.fileno())
    return checksum


def read_file(path: Path, expected_size: int | None = None) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Read and verify a file written by ``write_file``. Returns (tensors, metadata) with the
    checksum still in the metadata. Raises CorruptFile (torn, malformed, checksum mismatch) or
    OSError (missing, unreadable). Arrays are views of one buffer read in a single pass."""
    with open(path, "rb", buffering=0) as f:
        slots, metadata, payload_len = _read_header(f, expected_size)
        buf = np.empty(payload_len, dtype=np.uint8)  # not bytearray: its zero-fill costs a pass
        _checked_stream(f, slots, metadata, memoryview(buf), whole=True)
    tensors = {}
    for s in slots:
        dt = _CODE_DTYPES[s.code]
        arr = buf[s.start:s.end].view(dt)
        tensors[s.name] = arr.astype(dt.newbyteorder("="), copy=False).reshape(s.shape)
    return tensors, metadata


def verify_file(path: Path, expected_size: int | None = None) -> dict[str, str]:
    """Verify a file without keeping its payload (one reused chunk buffer); returns the
    metadata. For callers that then load the tensors with another reader (``mx.load``)."""
    with open(path, "rb", buffering=0) as f:
        slots, metadata, payload_len = _read_header(f, expected_size)
        buf = memoryview(np.empty(min(payload_len, _CHUNK), dtype=np.uint8))
        _checked_stream(f, slots, metadata, buf, whole=False, payload_len=payload_len)
    return metadata


def _read_header(f, expected_size: int | None):
    size = os.fstat(f.fileno()).st_size
    if expected_size is not None and size != expected_size:
        raise CorruptFile(f"file is {size} bytes, the index recorded {expected_size} (torn)")
    if size < 8:
        raise CorruptFile(f"file is {size} bytes, shorter than the 8-byte header length")
    header_len = int.from_bytes(_read_exact(f, 8), "little")
    if header_len > min(_MAX_HEADER_BYTES, size - 8):
        raise CorruptFile(f"header length {header_len} does not fit a {size}-byte file")
    slots, metadata = parse_header(_read_exact(f, header_len), size - 8 - header_len)
    if CHECKSUM_KEY not in metadata:
        raise CorruptFile("no checksum in __metadata__")
    return slots, metadata, size - 8 - header_len


def _checked_stream(f, slots, metadata, view: memoryview, *, whole: bool, payload_len: int = 0) -> None:
    """Read the payload into ``view`` (all of it when ``whole``, else chunk by chunk into the
    same buffer) and compare the CRC with the stored checksum."""
    total = len(view) if whole else payload_len
    crc = checksum_of_header(slots, metadata)
    for i in range(0, total, _CHUNK):
        n = min(_CHUNK, total - i)
        chunk = view[i:i + n] if whole else view[:n]
        if f.readinto(chunk) != n:
            raise CorruptFile("file shrank while being read")
        crc = zlib.crc32(chunk, crc)
    if _format_checksum(crc) != metadata[CHECKSUM_KEY]:
        raise CorruptFile(f"checksum mismatch: stored {metadata[CHECKSUM_KEY]}, computed {_format_checksum(crc)}")


def _read_exact(f, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise CorruptFile(f"expected {n} bytes, file ended after {len(data)}")
    return data
