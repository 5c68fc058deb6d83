"""The file of one serving delta: a JSON header and arrays, every byte under one checksum.

Layout (format 2): `MAGIC` (which names the format), the header's length
(8 bytes, little-endian), the header (JSON: the caller's fields plus
`arrays`: each array's name, dtype, shape, codec, offset and byte count),
the arrays' bytes, and last the 16 hex digits of the checksum
(`io.integrity`, the checkpoints' algorithm) of everything before them. So a
flipped byte anywhere (header, arrays, the length) fails the check before
anything is parsed. Written to a temporary name and renamed: a reader sees
the whole file or none.

Codecs: "raw" stores an array's bytes as they are; "gaps" stores sorted,
distinct int64 ids (a delta's row numbers and raw ids) as their gaps
(`ids[0] + 1, ids[1] - ids[0], ...`, 8-byte little-endian words) in byte
planes (byte 0 of every gap, then byte 1, ...), deflated by zlib: the high
bytes of small gaps are runs of zeros, so the rows of a delta take well
under a byte each instead of 4 or 8. Format 1 (sparse_embed before the
codecs) stored every array raw; it is refused with a message saying so.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from typing import Any, Collection, Mapping

import numpy as np

from sparse_embed.io.ckpt_format import CheckpointError, CorruptCheckpointError
from sparse_embed.io.integrity import checksum

FORMAT = 2
MAGIC = b"sparse_embed delta %d\n" % FORMAT
_SUM = 16  # hex digits of the trailing checksum


def encode_ids(ids: np.ndarray) -> bytes:
    """Sorted distinct int64 ids `[n]` -> the "gaps" codec's bytes (see the module doc)."""
    gaps = np.diff(np.asarray(ids, np.int64), prepend=np.int64(-1)).astype("<u8")
    return zlib.compress(np.ascontiguousarray(gaps.view(np.uint8).reshape(-1, 8).T).tobytes(), 1)


def decode_ids(blob: bytes) -> np.ndarray:
    """The ids `encode_ids` encoded; ValueError if `blob` is not such bytes or the ids are not sorted and distinct."""
    try:
        planes = zlib.decompress(blob)
    except zlib.error as e:
        raise ValueError(f"the ids do not inflate ({e})") from None
    if len(planes) % 8:
        raise ValueError(f"the ids inflate to {len(planes)} bytes, not a whole number of 8-byte gaps")
    planes = np.frombuffer(planes, np.uint8).reshape(8, -1)
    gaps = np.zeros(planes.shape[1], np.uint64)
    for j in np.flatnonzero(planes.any(axis=1)):  # most gaps are small: their high planes are zeros, skipped
        gaps |= planes[j].astype(np.uint64) << np.uint64(8 * j)
    ids = (np.cumsum(gaps, dtype=np.uint64) - np.uint64(1)).view(np.int64)
    if (ids[1:] <= ids[:-1]).any():
        raise ValueError("the ids are not sorted and distinct")
    return ids


def write(path: str, header: Mapping[str, Any], arrays: Mapping[str, np.ndarray], *,
          ids: Collection[str] = (), dry: bool = False) -> str:
    """Writes `header` (JSON-able) and `arrays` to `path` atomically; the arrays named in `ids` (sorted distinct
    int64 ids) with the "gaps" codec, the others raw (see the module doc). Returns the file's checksum (what
    `read` returns as the header's "checksum": the next delta of a chain names it); `dry`: only that, no file."""
    blobs, index, offset = [], [], 0
    for name, a in arrays.items():
        a = np.ascontiguousarray(a)
        blob = encode_ids(a) if name in ids else a.tobytes()
        index.append({"name": name, "dtype": a.dtype.name, "shape": list(a.shape), "offset": offset,
                      "nbytes": len(blob), "codec": "gaps" if name in ids else "raw"})
        blobs.append(blob)
        offset += len(blob)
    head = json.dumps({**header, "arrays": index}, sort_keys=True).encode()
    body = b"".join([MAGIC, len(head).to_bytes(8, "little"), head, *blobs])
    tmp = f"{path}.tmp{os.getpid()}"
    digest = checksum(np.frombuffer(body, np.uint8))
    if dry:
        return digest
    with open(tmp, "wb") as f:
        f.write(body)
        f.write(digest.encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return digest


def _format(path: str, body: np.ndarray) -> int | None:
    """The format number the file's first line names (None if it is not a delta's first line)."""
    m = re.match(rb"sparse_embed delta (\d+)\n", body[: len(MAGIC) + 8].tobytes())
    return int(m.group(1)) if m else None


def _versions(path: str, found: int) -> str:
    age = "an older" if found < FORMAT else "a newer"
    return (f"The delta {path} is in delta format {found}, written by {age} sparse_embed; this one reads format "
            f"{FORMAT}: apply it with the version that wrote it, or export the tables again (a full export, then "
            "deltas) with this one.")


def _array(path: str, data: np.ndarray, a: Mapping[str, Any]) -> np.ndarray:
    dtype, shape = np.dtype(a["dtype"]), tuple(a["shape"])
    blob = data[a["offset"]: a["offset"] + a["nbytes"]]
    if a["codec"] == "raw":
        return blob.view(dtype).reshape(shape)
    try:
        out = decode_ids(blob.tobytes())
    except ValueError as e:
        raise CorruptCheckpointError(f"The delta {path}: array {a['name']!r} does not decode: {e}.") from None
    if out.shape != shape:
        raise CorruptCheckpointError(f"The delta {path}: array {a['name']!r} decodes to {out.size} ids, its header "
                                     f"says {shape}.")
    return out


def read(path: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """`(header, {name: array})` of a delta file, ids decoded, the header's "checksum" the file's;
    CorruptCheckpointError if any byte differs from what was written, CheckpointError if it is in another format."""
    data = np.fromfile(path, np.uint8)
    body = data[:-_SUM]
    found = _format(path, body)
    if data.size < len(MAGIC) + 8 + _SUM or checksum(body) != data[-_SUM:].tobytes().decode("ascii", "replace"):
        other = f" Or: {_versions(path, found)}" if found not in (None, FORMAT) else ""
        raise CorruptCheckpointError(f"The delta {path} is damaged or incomplete: its bytes do not match the "
                                     f"checksum written with them; write it again from the training run.{other}")
    if found is None:
        raise CorruptCheckpointError(f"{path} is not a sparse_embed delta (it does not start with {MAGIC!r}).")
    if found != FORMAT:
        raise CheckpointError(_versions(path, found))
    n = int.from_bytes(body[len(MAGIC): len(MAGIC) + 8].tobytes(), "little")
    start = len(MAGIC) + 8
    header = json.loads(body[start: start + n].tobytes())
    data_at = body[start + n:]
    header["checksum"] = data[-_SUM:].tobytes().decode("ascii")
    return header, {a["name"]: _array(path, data_at, a) for a in header.pop("arrays")}
