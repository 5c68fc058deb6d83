"""The file of one serving delta: a JSON header and raw arrays, every byte under one checksum.

Layout: `MAGIC`, the header's length (8 bytes, little-endian), the header
(JSON: the caller's fields plus `arrays`, each array's name, dtype, shape and
offset), the arrays' bytes, and last the 16 hex digits of the checksum
(`io.integrity`, the checkpoints' algorithm) of everything before them. So a
flipped byte anywhere (header, arrays, the length) fails the check before
anything is parsed. Written to a temporary name and renamed: a reader sees
the whole file or none.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

import numpy as np

from sparse_embed.io.ckpt_format import CorruptCheckpointError
from sparse_embed.io.integrity import checksum

MAGIC = b"sparse_embed delta 1\n"
_SUM = 16  # hex digits of the trailing checksum


def write(path: str, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray]) -> None:
    """Writes `header` (JSON-able) and `arrays` to `path` atomically (see the module doc)."""
    blobs, index, offset = [], [], 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        index.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape), "offset": offset})
        blobs.append(a.tobytes())
        offset += a.nbytes
    head = json.dumps({**header, "arrays": index}, sort_keys=True).encode()
    body = b"".join([MAGIC, len(head).to_bytes(8, "little"), head, *blobs])
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(body)
        f.write(checksum(np.frombuffer(body, np.uint8)).encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """`(header, {name: array})` of a delta file; CorruptCheckpointError if any byte differs from what was written."""
    data = np.fromfile(path, np.uint8)
    body = data[:-_SUM]
    if data.size < len(MAGIC) + 8 + _SUM or checksum(body) != data[-_SUM:].tobytes().decode("ascii", "replace"):
        raise CorruptCheckpointError(f"The delta {path} is damaged or incomplete: its bytes do not match the "
                                     "checksum written with them; write it again from the training run.")
    if body[: len(MAGIC)].tobytes() != MAGIC:
        raise CorruptCheckpointError(f"{path} is not a sparse_embed delta (it does not start with {MAGIC!r}).")
    n = int.from_bytes(body[len(MAGIC): len(MAGIC) + 8].tobytes(), "little")
    start = len(MAGIC) + 8
    header = json.loads(body[start: start + n].tobytes())
    data_at = start + n
    arrays = {}
    for a in header.pop("arrays"):
        dtype, shape = np.dtype(a["dtype"]), tuple(a["shape"])
        count = int(np.prod(shape, dtype=np.int64))
        lo = data_at + a["offset"]
        arrays[a["name"]] = body[lo: lo + count * dtype.itemsize].view(dtype).reshape(shape)
    return header, arrays
