"""Criteo click logs: a block of lines -> labels, dense features and categorical ids, in numpy.

The format (Criteo's display-advertising and terabyte logs): one example a
line, 40 tab-separated fields: the label (0 or 1), 13 integer features
(`I1`..`I13`, decimal, possibly negative) and 26 categorical features
(`C1`..`C26`, hexadecimal hashes, 8 digits in Criteo's files; 1 to 16 are
read). An empty field is a missing value:

- an integer feature's value becomes `log1p(max(x, 0))` as float32 (DLRM's
  input transform): missing and negative values give 0;
- a categorical feature's raw id is its hexadecimal value; a missing one is
  `MISSING_ID` (2**32, past every 32-bit value, so it is an id of its own).
  `hash_ids(ids, vocabulary)` maps raw ids to rows of a static table.

A line with another number of fields, a label other than 0/1, an integer
that is not one, or a hexadecimal value that is not one (or >= 2**63, past
a raw id, or equal to `MISSING_ID`, which would read as missing) is
malformed: `parse_lines` returns its index and the reason, and the caller
(`host.criteo_files`) raises or skips it, as its policy says.

Speed: the separators are found with one vectorised scan, and each field is
read as one unaligned 64-bit word and decoded with SWAR arithmetic (no loop
over characters); fields longer than 8 digits take a slow path.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from sparse_embed.core.raw_keys import splitmix64
from sparse_embed.host import native

NUM_DENSE, NUM_CATEGORICAL = 13, 26
NUM_FIELDS = 1 + NUM_DENSE + NUM_CATEGORICAL
FIELD_NAMES = ("label", *(f"I{i}" for i in range(1, NUM_DENSE + 1)), *(f"C{i}" for i in range(1, NUM_CATEGORICAL + 1)))
MISSING_ID = 2**32  # a missing categorical value's raw id

_U = np.uint64
_LOW_NIBBLES, _HIGH_NIBBLES = _U(0x0F0F0F0F0F0F0F0F), _U(0xF0F0F0F0F0F0F0F0)
_ONES, _ASCII_ZEROS = _U(0x0101010101010101), _U(0x3030303030303030)
_KEEP = np.array([(1 << (8 * n)) - 1 for n in range(8)] + [2**64 - 1], np.uint64)  # the low n bytes of a word
_SHIFT = np.array([8 * (8 - n) if n else 0 for n in range(9)], np.uint64)  # moves n low bytes to the top


class Parsed(NamedTuple):
    """The well-formed lines of a block (N of them), and the block's malformed lines."""

    labels: np.ndarray  # [N] float32, 0 or 1
    dense: np.ndarray  # [N, 13] float32, log1p(max(x, 0)); missing -> 0
    categorical: np.ndarray  # [N, 26] int64 raw ids; missing -> MISSING_ID
    bad: np.ndarray  # [K] int64, the malformed lines' indices in the block (0-based, in order)
    reasons: tuple[str, ...]  # [K] what is wrong with each


def _padded(data: bytes | memoryview) -> tuple[np.ndarray, int]:
    """The block as uint8 with a final newline and 8 zero bytes after it (64-bit reads never run past); its size."""
    n = len(data)
    newline = 0 if n and data[-1] == 10 else 1
    buf = np.zeros(n + newline + 8, np.uint8)
    buf[:n] = np.frombuffer(data, np.uint8)
    if newline:
        buf[n] = 10
    return buf, n + newline


def _words(buf: np.ndarray, size: int) -> np.ndarray:
    """The little-endian 64-bit word starting at every byte of `buf[:size]` (a strided view, no copy)."""
    return np.ndarray((size,), "<u8", buffer=buf.data, strides=(1,))


def _fields(buf: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[str]]:
    """Each well-formed line's field starts and lengths `[N, 40]`, the malformed lines `[K]` and why."""
    sep = np.flatnonzero(buf[:size] < 11)  # tabs and newlines (and other control bytes: a malformed line)
    kind = buf[sep]
    is_newline = kind == 10
    starts = np.empty_like(sep)
    starts[0], starts[1:] = 0, sep[:-1] + 1
    n = int(is_newline.sum())
    if sep.size == NUM_FIELDS * n and is_newline[NUM_FIELDS - 1::NUM_FIELDS].all() and (kind >= 9).all():
        return (starts.reshape(n, NUM_FIELDS), (sep - starts).reshape(n, NUM_FIELDS),
                np.zeros(0, np.int64), [])
    line = np.cumsum(is_newline) - is_newline
    counts = np.bincount(line, minlength=n)
    control = np.bincount(line, weights=kind < 9, minlength=n) > 0
    good = (counts == NUM_FIELDS) & ~control
    bad = np.flatnonzero(~good)
    reasons = ["a control character (not a tab) in the line" if control[i] else
               f"{counts[i]} fields, not {NUM_FIELDS} (a label, {NUM_DENSE} integers, {NUM_CATEGORICAL} categories)"
               for i in bad]
    keep = good[line]
    starts, ends = starts[keep], sep[keep]
    return starts.reshape(-1, NUM_FIELDS), (ends - starts).reshape(-1, NUM_FIELDS), bad, reasons


def _decimal(words: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Decimal integers (optional '-') at `starts`: (int64 values, ok); empty fields give 0."""
    first = words[starts] & _U(0xFF)
    neg = (first == _U(0x2D)) & (lengths > 0)
    n = lengths - neg
    x = words[starts + neg] & _KEEP[np.minimum(n, 8)]
    keep = _ASCII_ZEROS & _KEEP[np.minimum(n, 8)]
    with np.errstate(over="ignore"):
        ok = ((x & _HIGH_NIBBLES) == keep) & (((x + _U(0x0606060606060606)) & _HIGH_NIBBLES) == keep)
        ok &= (n > 0) | (lengths == 0)
        d = (x << _SHIFT[np.minimum(n, 8)]) & _LOW_NIBBLES  # the last digit in the top byte; leading zeros
        d = ((d * _U(10)) + (d >> _U(8))) & _U(0x00FF00FF00FF00FF)
        d = ((d * _U(100)) + (d >> _U(16))) & _U(0x0000FFFF0000FFFF)
        d = ((d * _U(10000)) + (d >> _U(32))) & _U(0xFFFFFFFF)
    values = d.astype(np.int64)
    values[neg] *= -1
    return values, ok & (n <= 8)


def _hex(words: np.ndarray, starts: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Hexadecimal values of 1..8 digits at `starts`: (uint64 values, ok); empty fields give `MISSING_ID`."""
    n = np.minimum(lengths, 8)
    x = (words[starts] & _KEEP[n]) << _SHIFT[n]  # the digits at the top, zero bytes below
    x |= _ASCII_ZEROS & _KEEP[8 - n]  # '0' in the bytes below the digits
    with np.errstate(over="ignore"):
        nib = (x & _LOW_NIBBLES) + _U(9) * ((x >> _U(6)) & _ONES)  # '0'-'9' -> 0-9, 'a'-'f'/'A'-'F' -> 10-15
        above9 = ((nib + _U(0x0606060606060606)) >> _U(4)) & _ONES
        # a hex digit re-encodes to itself (letters in lower case): nothing else does, nor a nibble past 15; only
        # bytes with bit 6 set (letters) are lowered, so that control bytes 0x10-0x19 do not pass as '0'-'9'
        again = nib + _ASCII_ZEROS + _U(0x27) * above9
        lowered = x | ((x >> _U(1)) & _U(0x2020202020202020))
        ok = ((nib & _U(0x1010101010101010)) == 0) & (again == lowered)
    v = ((nib & _U(0x0F000F000F000F00)) >> _U(8)) | ((nib & _U(0x000F000F000F000F)) << _U(4))
    v = ((v & _U(0x00FF000000FF0000)) >> _U(16)) | ((v & _U(0x000000FF000000FF)) << _U(8))
    v = ((v & _U(0x0000FFFF00000000)) >> _U(32)) | ((v & _U(0x000000000000FFFF)) << _U(16))
    v[lengths == 0] = MISSING_ID
    return v, ok & (lengths <= 8)


def _slow(data: np.ndarray, starts: np.ndarray, lengths: np.ndarray, base: int) -> tuple[np.ndarray, np.ndarray]:
    """Fields past the fast path's 8 digits (rare), one at a time: (int64 values, ok); base 10 or 16."""
    allowed = set(b"0123456789" if base == 10 else b"0123456789abcdefABCDEF")
    values, ok = np.zeros(starts.size, np.int64), np.zeros(starts.size, bool)
    for k, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
        text = data[s:s + n].tobytes()
        digits = text[1:] if base == 10 and text.startswith(b"-") else text
        if digits and set(digits) <= allowed and (base == 10 or len(digits) <= 16):  # (the C path's grammar)
            v = int(text, base)
            if -2**63 < v < 2**63 and (base == 10 or v != MISSING_ID):
                values[k], ok[k] = v, True
    return values, ok


def _column_values(buf, words, starts, lengths, decode, base) -> tuple[np.ndarray, np.ndarray]:
    """`decode` of every field of the columns given, `[N, C]` each, with the long fields re-read slowly."""
    values, ok = decode(words, starts.ravel(), lengths.ravel())
    values = values.astype(np.int64)
    long = np.flatnonzero(lengths.ravel() > 8)
    if long.size:
        values[long], ok[long] = _slow(buf, starts.ravel()[long], lengths.ravel()[long], base)
    return values.reshape(starts.shape), ok.reshape(starts.shape)


def _why(buf: np.ndarray, start: int, length: int, column: int) -> str:
    text = buf[start:start + length].tobytes().decode("latin-1")
    if column == 0:
        return f"the label is {text!r}, not '0' or '1'"
    what = ("an integer below 2**63 in magnitude" if column <= NUM_DENSE else
            "a hexadecimal value of 1 to 16 digits below 2**63")
    if column > NUM_DENSE and _is_missing_id(text):
        what += f" other than {MISSING_ID:#x} (MISSING_ID: it would read as a missing value)"
    why = f"field {column + 1} ({FIELD_NAMES[column]}) is {text[:40]!r}, not {what}"
    if column == NUM_FIELDS - 1 and text.endswith("\r"):  # (else only the repr's '\r' tells a CRLF file)
        why += " (the line ends in '\\r\\n', Windows line endings: lines must end in '\\n' alone)"
    return why


def _is_missing_id(text: str) -> bool:
    """Is `text` a hexadecimal value equal to `MISSING_ID` (what no field may hold)?"""
    try:
        return int(text, 16) == MISSING_ID
    except ValueError:
        return False


def _empty() -> Parsed:
    return Parsed(np.zeros(0, np.float32), np.zeros((0, NUM_DENSE), np.float32),
                  np.zeros((0, NUM_CATEGORICAL), np.int64), np.zeros(0, np.int64), ())


def parse_lines(data: bytes | memoryview) -> Parsed:
    """Parses a block of whole lines (the last may lack its newline) into its well-formed examples.

    Returns a `Parsed`: labels `[N]`, dense `[N, 13]` (log1p(max(x, 0)),
    missing 0), categorical raw ids `[N, 26]` (missing `MISSING_ID`), and
    the malformed lines (index in the block, reason), which are left out.
    In C (`host/_native.c`, one pass) when the extension is built, else in
    numpy; both give the same arrays.
    """
    if not len(data):
        return _empty()
    ext = native.extension()
    if ext is None:
        return _parse_numpy(data)
    n = int(np.count_nonzero(np.frombuffer(data, np.uint8) == 10)) + (data[-1] != 10)
    labels, bad = np.empty(n, np.float32), np.empty(n, np.int64)
    ints, dense = np.empty((n, NUM_DENSE), np.int64), np.empty((n, NUM_DENSE), np.float32)
    cats = np.empty((n, NUM_CATEGORICAL), np.int64)
    good, nbad, large = ext.criteo_parse(data, MISSING_ID, _log1p_table(), labels, ints, dense, cats, bad)
    dense, ints = dense[:good], ints[:good]
    if large:  # past the table: numpy's log1p, as the numpy path
        dense[ints >= _LOG1P_TABLE_SIZE] = np.log1p(ints[ints >= _LOG1P_TABLE_SIZE].astype(np.float32))
    reasons = ()
    if nbad:  # the reasons, from the numpy path (malformed lines are rare)
        lines = bytes(data).split(b"\n")
        reasons = tuple((_parse_numpy(lines[i]).reasons or ("malformed",))[0] for i in bad[:nbad].tolist())
    return Parsed(labels[:good], dense, cats[:good], bad[:nbad], reasons)


_LOG1P_TABLE_SIZE = 1 << 16


@functools.cache
def _log1p_table() -> np.ndarray:
    """numpy's own float32 log1p of 0 .. 2**16 - 1, for the C path: both paths give the same bits."""
    return np.log1p(np.arange(_LOG1P_TABLE_SIZE, dtype=np.float32))


def _parse_numpy(data: bytes | memoryview) -> Parsed:
    """`parse_lines` in numpy."""
    buf, size = _padded(data)
    words = _words(buf, size)
    starts, lengths, bad, reasons = _fields(buf, size)
    label_byte = buf[starts[:, 0]]
    label_ok = (lengths[:, 0] == 1) & ((label_byte == 0x30) | (label_byte == 0x31))
    ints, int_ok = _column_values(buf, words, starts[:, 1:1 + NUM_DENSE], lengths[:, 1:1 + NUM_DENSE], _decimal, 10)
    cats, cat_ok = _column_values(buf, words, starts[:, 1 + NUM_DENSE:], lengths[:, 1 + NUM_DENSE:], _hex, 16)
    ok = np.concatenate([label_ok[:, None], int_ok, cat_ok], axis=1)
    good = ok.all(axis=1)
    if not good.all():  # number the lines of the whole block: the malformed ones found above are not in `starts`
        index = np.delete(np.arange(starts.shape[0] + bad.size), bad)
        why = {int(index[i]): _why(buf, int(starts[i, c]), int(lengths[i, c]), int(c))
               for i, c in zip(np.flatnonzero(~good), np.argmin(ok[~good], axis=1))}
        why.update(zip(bad.tolist(), reasons))
        bad = np.array(sorted(why), np.int64)
        reasons = [why[i] for i in bad.tolist()]
        label_byte, ints, cats = label_byte[good], ints[good], cats[good]
    dense = np.log1p(np.maximum(ints, 0).astype(np.float32))
    return Parsed((label_byte - 0x30).astype(np.float32), dense, cats, bad, tuple(reasons))


def hash_ids(ids: np.ndarray, vocabulary: int | np.ndarray) -> np.ndarray:
    """Raw ids -> rows of a static table of `vocabulary` rows (an int, or one per column of `ids`, broadcast):
    splitmix64's finalizer of the id, mod the vocabulary; int64 of `ids`' shape."""
    return (splitmix64(ids) % np.asarray(vocabulary, np.uint64)).astype(np.int64)
