"""The safetensors format, read through memory maps and written tensor by tensor.

A ``.safetensors`` file is 8 bytes of little-endian header length, a JSON header
(``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``) and the raw
little-endian bytes. Reading maps the file and hands out numpy *views*: slicing a view reads only
the bytes of the slice, which is how an importer fills each device's shard without ever holding a
whole model. bfloat16 (most HF checkpoints) comes through ``ml_dtypes`` (a jax dependency), so
neither torch nor the ``safetensors`` package is needed at run time.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np

from titanax import errors

DTYPES = {
    "F64": np.dtype(np.float64), "F32": np.dtype(np.float32), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype(np.int64), "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16), "I8": np.dtype(np.int8), "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
    # (Block-quantised FP8 checkpoints: DeepSeek-V3's; hf/fp8_blocks.py dequantises them.)
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
NAMES = {dtype: name for name, dtype in DTYPES.items()}

# Header bigger than this is not a safetensors file (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


def read_header(path: str) -> Tuple[Dict[str, Any], int]:
    """``(header without __metadata__, offset of the data)``; a damaged file is a
    ``CheckpointError`` naming it."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise ValueError("shorter than its 8-byte header length")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES:
                raise ValueError(f"header length {length} is not plausible")
            header = json.loads(f.read(length))
    except (OSError, ValueError) as e:
        raise errors.HFError(f"cannot read the safetensors header: {e}", path=path,
                                     suggestion="check that the file is a complete .safetensors "
                                                "file (re-download or re-export it)") from e
    header.pop("__metadata__", None)
    return header, 8 + length


class SafetensorsFile:
    """One file's tensors as read-only numpy views of a memory map."""

    def __init__(self, path: str):
        self.path = path
        self.header, self._data_offset = read_header(path)
        self._map: Optional[np.memmap] = None

    def names(self) -> Iterable[str]:
        return self.header.keys()

    def info(self, name: str) -> Tuple[Tuple[int, ...], np.dtype]:
        if name not in self.header:
            raise errors.HFError(f"tensor {name!r} is not in this file", path=self.path,
                                 suggestion="the directory's model.safetensors.index.json maps "
                                            "it here: fix the index or the shard")
        entry = self.header[name]
        if entry["dtype"] not in DTYPES:
            raise errors.HFError(
                f"tensor {name!r} has dtype {entry['dtype']}, which Titanax does not read",
                path=self.path, suggestion=f"supported: {', '.join(DTYPES)}")
        return tuple(entry["shape"]), DTYPES[entry["dtype"]]

    def view(self, name: str) -> np.ndarray:
        """The tensor as a view of the file (nothing read until it is indexed or copied)."""
        shape, dtype = self.info(name)
        begin, end = self.header[name]["data_offsets"]
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        start = self._data_offset + begin
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * dtype.itemsize or start + end - begin > self._map.size:
            raise errors.HFError(
                f"tensor {name!r} ({shape}, {NAMES[dtype]}) does not fit its byte range",
                path=self.path, suggestion="the file is truncated or damaged: re-export it")
        return np.ndarray(shape, dtype=dtype, buffer=self._map, offset=start)


@dataclasses.dataclass(frozen=True)
class PlannedTensor:
    """A tensor to be written: known by name, shape and dtype before its bytes exist."""

    name: str
    shape: Tuple[int, ...]
    dtype: np.dtype
    # Returns the array when the writer reaches it (gathered from devices just then).
    produce: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


def write_file(path: str, tensors: Sequence[PlannedTensor], *, write: bool = True,
               metadata: Optional[Mapping[str, str]] = None) -> None:
    """Writes ``tensors`` to ``path``, asking each for its array only when its bytes are due:
    the host holds one tensor at a time. With ``write=False`` the arrays are still produced (in
    a multi-process job every process takes part in each gather) and nothing is written."""
    header: Dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for tensor in tensors:
        if tensor.dtype not in NAMES:
            raise errors.HFError(f"cannot write dtype {tensor.dtype} of tensor {tensor.name!r}",
                                 path=path, suggestion="cast it to float32 or bfloat16")
        header[tensor.name] = {"dtype": NAMES[tensor.dtype], "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + tensor.nbytes]}
        offset += tensor.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # Data aligned to 8 bytes, as the reference writer does.
    tmp = path + ".tmp"
    with open(tmp, "wb") if write else _Discard() as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for tensor in tensors:
            array = np.asarray(tensor.produce())
            if tuple(array.shape) != tuple(tensor.shape):
                raise errors.HFError(f"tensor {tensor.name!r} came out {array.shape}, planned "
                                     f"{tensor.shape}", path=path,
                                     suggestion="a Titanax bug: please report it")
            f.write(np.ascontiguousarray(array, dtype=tensor.dtype.newbyteorder("<")).tobytes())
    if write:
        os.replace(tmp, path)


class _Discard:
    """A file that forgets what is written (processes other than the writer)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def write(self, data) -> None:
        del data
