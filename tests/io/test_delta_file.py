"""The delta file (format 2): ids stored as gaps in byte planes against a numpy reference, every part of the
file under the checksum, and files of other formats refused with a message that says so."""

from __future__ import annotations

import json
import pathlib
import zlib

import numpy as np
import pytest

import sparse_embed as se
from sparse_embed.io import delta_file
from sparse_embed.io.integrity import checksum


def _reference_planes(ids: list[int]) -> bytes:
    """The gaps codec's bytes before deflate, by hand: gap k = ids[k] - ids[k-1] (ids[-1] = -1) mod 2^64, byte j
    of every gap, then byte j + 1, ..."""
    gaps = [(b - a) % 2**64 for a, b in zip([-1] + ids[:-1], ids)]
    return bytes((g >> (8 * j)) & 0xFF for j in range(8) for g in gaps)


ID_SETS = {
    "empty": [],
    "one": [0],
    "dense rows": list(range(3, 300)) + [1000, 4095],
    "raw 62-bit": sorted({int(x) for x in np.random.default_rng(0).integers(0, 2**62, 200)}),
    "negative and extremes": [-2**63, -5, -1, 0, 7, 2**63 - 1],
}


@pytest.mark.parametrize("name", ID_SETS)
def test_ids_are_stored_as_gaps_in_byte_planes(name):
    ids = ID_SETS[name]
    blob = delta_file.encode_ids(np.array(ids, np.int64))
    assert zlib.decompress(blob) == _reference_planes(ids)
    got = delta_file.decode_ids(blob)
    assert got.dtype == np.int64 and got.tolist() == ids


def test_dense_rows_take_well_under_a_byte_each():
    rows = np.unique(np.random.default_rng(1).integers(0, 400_000, 250_000))
    assert len(delta_file.encode_ids(rows)) < 0.5 * rows.size


@pytest.mark.parametrize("blob, match", [
    (b"not zlib", "the ids do not inflate"),
    (zlib.compress(bytes(12)), "inflate to 12 bytes, not a whole number of 8-byte gaps"),
    (zlib.compress(_reference_planes([5, 3])), "not sorted and distinct"),
    (zlib.compress(_reference_planes([5, 5])), "not sorted and distinct"),
])
def test_bytes_that_are_not_encoded_ids_are_refused(blob, match):
    with pytest.raises(ValueError, match=match):
        delta_file.decode_ids(blob)


ARRAYS = {"t/rows": np.array([2, 3, 9], np.int64), "t/values": np.arange(12, dtype=np.uint8).reshape(3, 4),
          "u/evicted": np.array([-7, 2**40], np.int64)}
IDS = ("t/rows", "u/evicted")


def _parts(data: bytes) -> dict[str, tuple[int, int]]:
    """`{part: (start, stop)}` of a delta file, parsed by hand from its layout."""
    magic = len(b"sparse_embed delta 2\n")
    n = int.from_bytes(data[magic: magic + 8], "little")
    head = magic + 8 + n
    parts = {"magic": (0, magic), "length": (magic, magic + 8), "header": (magic + 8, head),
             "checksum": (len(data) - 16, len(data))}
    for a in json.loads(data[magic + 8: head])["arrays"]:
        parts[a["name"]] = (head + a["offset"], head + a["offset"] + a["nbytes"])
    return parts


def test_a_file_round_trips_and_its_ids_are_encoded(tmp_path):
    path = str(tmp_path / "x.delta")
    digest = delta_file.write(path, {"base": "b", "seq": 1}, ARRAYS, ids=IDS)
    header, arrays = delta_file.read(path)
    assert header == {"base": "b", "seq": 1, "checksum": digest}  # the file's (the next delta of a chain names it)
    with open(path, "rb") as f:
        assert f.read()[-16:].decode() == digest
    for name, a in ARRAYS.items():
        assert arrays[name].dtype == a.dtype and np.array_equal(arrays[name], a), name
    data = pathlib.Path(path).read_bytes()
    start, stop = _parts(data)["t/rows"]
    assert data[start:stop] == delta_file.encode_ids(ARRAYS["t/rows"])


@pytest.mark.parametrize("part", ["magic", "length", "header", *ARRAYS, "checksum"])
@pytest.mark.parametrize("where", ["first", "last"])
def test_a_flipped_byte_in_any_part_is_refused(part, where, tmp_path):
    path = str(tmp_path / "x.delta")
    delta_file.write(path, {"base": "b", "seq": 1}, ARRAYS, ids=IDS)
    data = bytearray(pathlib.Path(path).read_bytes())
    start, stop = _parts(bytes(data))[part]
    data[start if where == "first" else stop - 1] ^= 0x10
    pathlib.Path(path).write_bytes(bytes(data))
    with pytest.raises(se.CorruptCheckpointError, match="is damaged or incomplete"):
        delta_file.read(path)


@pytest.mark.parametrize("keep", [0, 10, 29, 0.5, -1])
def test_a_truncated_file_is_refused(keep, tmp_path):
    path = str(tmp_path / "x.delta")
    delta_file.write(path, {"base": "b", "seq": 1}, ARRAYS, ids=IDS)
    data = pathlib.Path(path).read_bytes()
    pathlib.Path(path).write_bytes(data[: int(keep * len(data)) if isinstance(keep, float) else keep])
    with pytest.raises(se.CorruptCheckpointError, match="is damaged or incomplete"):
        delta_file.read(path)


def _signed(path, body: bytes) -> None:
    pathlib.Path(path).write_bytes(body + checksum(np.frombuffer(body, np.uint8)).encode())


@pytest.mark.parametrize("version, age", [(1, "an older"), (3, "a newer")])
def test_another_format_is_refused_with_its_number(version, age, tmp_path):
    path = str(tmp_path / "x.delta")
    delta_file.write(path, {"base": "b", "seq": 1}, ARRAYS, ids=IDS)
    body = pathlib.Path(path).read_bytes()[:-16].replace(b"delta 2\n", b"delta %d\n" % version, 1)
    _signed(path, body)
    with pytest.raises(se.CheckpointError, match=f"is in delta format {version}, written by {age} sparse_embed; "
                                                 "this one reads format 2") as e:
        delta_file.read(path)
    assert not isinstance(e.value, se.CorruptCheckpointError)
    pathlib.Path(path).write_bytes(body + b"x" * 16)  # a newer format may end otherwise: the number is still named
    with pytest.raises(se.CorruptCheckpointError, match=f"damaged or incomplete.*Or: .* delta format {version}"):
        delta_file.read(path)


def test_ids_that_do_not_decode_under_a_good_checksum_are_refused(tmp_path):
    path = str(tmp_path / "x.delta")
    delta_file.write(path, {}, {"t/rows": np.array([1, 2], np.int64)}, ids=["t/rows"])
    data = pathlib.Path(path).read_bytes()[:-16]
    start = _parts(data + bytes(16))["t/rows"][0]
    blob = zlib.compress(_reference_planes([4, 1]))
    head = json.loads(data[29: start])
    head["arrays"][0]["nbytes"] = len(blob)
    head = json.dumps(head, sort_keys=True).encode()
    _signed(path, data[:21] + len(head).to_bytes(8, "little") + head + blob)
    with pytest.raises(se.CorruptCheckpointError, match="array 't/rows' does not decode: the ids are not sorted"):
        delta_file.read(path)
