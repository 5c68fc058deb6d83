"""Criteo-format files (plain or gzip, one or many) as fixed-size chunks of examples, read by index.

`CriteoFiles(paths, chunk_rows)` reads the files once when it is made:
it checks every line (`host.criteo.parse_lines`) and records where every
`chunk_rows`-th well-formed line starts, so that `read(c)` then returns
chunk `c` (the well-formed lines `[c * chunk_rows, (c + 1) * chunk_rows)` of
the files' concatenation) by reading only those bytes: a random-access
source whose position is one integer, exact to the line, for checkpoints.
A last chunk with fewer lines is left out.

Malformed lines (`on_malformed`):

- `"error"` (default): `ValueError` naming the file, the line (1-based)
  and what is wrong, when the files are opened;
- `"skip"`: the line is left out of the chunks and counted (`skipped`;
  `malformed` keeps the first few, as `file:line: reason`).

A gzip file that ends early or is corrupt is an error naming the file and
the last complete line; with `"skip"` the file ends at that line (the part
line after it is counted as skipped). A gzip file is read from its start
on every backward jump, so a shuffled order over gzip files is slow (read
them in order, or unpack them).
"""

from __future__ import annotations

import gzip
import os
import threading
import weakref
import zlib
from typing import Iterator, NamedTuple, Sequence

import numpy as np

from sparse_embed.host.criteo import Parsed, parse_lines

BLOCK_BYTES = 1 << 24  # read and parse the files this much at a time
KEEP_MALFORMED = 20  # how many malformed lines `malformed` lists


class _File(NamedTuple):
    path: str
    gzip: bool
    end: int  # bytes (after decompression) that hold whole lines; a truncated gzip file's tail is beyond


def _is_gzip(path: str) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


def _blocks(path: str, is_gzip: bool, on_malformed: str) -> Iterator[tuple[int, bytes, str | None]]:
    """(offset, whole lines, why the stream ended early or None) blocks of about BLOCK_BYTES; a truncated gzip
    stream raises or ends them (with a last, empty block saying so).

    Reads with `read1` (at most one decompressed piece a call), so an error loses no line before it.
    """
    offset, pending, size, lines = 0, [], 0, 0
    with (gzip.open if is_gzip else open)(path, "rb") as f:
        while True:
            try:
                piece = f.read1(BLOCK_BYTES)
            except (EOFError, OSError, zlib.error) as e:
                data = b"".join(pending)
                cut = data.rfind(b"\n") + 1
                if on_malformed == "error":
                    complete = lines + data.count(b"\n")
                    raise ValueError(f"{path}: the gzip stream ends early or is corrupt after line {complete} "
                                     f"({type(e).__name__}: {e}); pass "
                                     "on_malformed='skip' to read the lines before it.") from None
                if cut:
                    yield offset, data[:cut], None
                # always noted: also a stream cut at a line's end, or before anything decompressed, lost what followed
                yield offset + cut, b"", ("the gzip stream ends inside this line" if len(data) > cut else
                                          "the gzip stream ends early or is corrupt here (what followed is lost)")
                return
            pending.append(piece)
            size += len(piece)
            if size >= BLOCK_BYTES or not piece:
                data = b"".join(pending)
                cut = data.rfind(b"\n") + 1 if piece else len(data)
                if cut:
                    lines += data.count(b"\n", 0, cut)
                    yield offset, data[:cut], None
                    offset += cut
                pending, size = [data[cut:]], len(data) - cut
                if not piece:
                    return


def _line_starts(block: bytes) -> np.ndarray:
    """The offset of every line in a block of whole lines `[lines]`."""
    newlines = np.flatnonzero(np.frombuffer(block, np.uint8) == 10)
    starts = np.concatenate([[0], newlines + 1])
    return starts[:-1] if block.endswith(b"\n") else starts


class _Counted(NamedTuple):
    """What one pass over a file found."""

    offsets: list[np.ndarray]  # the chunk boundaries in the file
    good: int  # well-formed lines
    end: int  # bytes of whole lines


def _check_args(paths, chunk_rows: int, on_malformed: str) -> list[str]:
    if on_malformed not in ("error", "skip"):
        raise ValueError(f"on_malformed must be 'error' or 'skip', got {on_malformed!r}.")
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, (int, np.integer)) or chunk_rows < 1:
        raise ValueError(f"chunk_rows must be an int >= 1, got {chunk_rows!r}.")
    one = isinstance(paths, (str, bytes, os.PathLike))  # (bytes: one path, not a sequence of ints)
    paths = [os.fsdecode(p) for p in ([paths] if one else paths)]
    if not paths:
        raise ValueError("paths is empty: give one or more Criteo-format files.")
    folders = [p for p in paths if os.path.isdir(p)]
    if folders:
        raise IsADirectoryError(f"Criteo files are directories: {folders}; give the files in them.")
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise FileNotFoundError(f"Criteo files not found: {missing}.")
    return paths


class CriteoFiles:
    """Criteo-format files as chunks of `chunk_rows` well-formed examples; `read(c)` parses chunk `c`.

    Attributes:
      num_chunks: the whole chunks in the files.
      skipped: malformed lines left out (`on_malformed="skip"`); `malformed`: the first few, `file:line: why`.
    """

    def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike], chunk_rows: int, *,
                 on_malformed: str = "error") -> None:
        self.paths = tuple(_check_args(paths, chunk_rows, on_malformed))
        self.chunk_rows, self.on_malformed = int(chunk_rows), on_malformed
        self.skipped, self.malformed = 0, []
        files, bounds, good = [], [], 0
        for i, path in enumerate(self.paths):
            is_gzip = _is_gzip(path)
            counted = self._count(path, is_gzip, good)
            files.append(_File(path, is_gzip, counted.end))
            bounds += [np.stack([np.full(o.size, i), o], 1) for o in counted.offsets]
            good += counted.good
        self._files = tuple(files)
        self.num_chunks = good // self.chunk_rows
        ends = np.array([[len(files) - 1, files[-1].end]])  # after the last line
        self._bounds = np.concatenate(bounds + [ends])[:self.num_chunks + 1].astype(np.int64)
        self.__setstate__({})

    def _count(self, path: str, is_gzip: bool, good_before: int) -> _Counted:
        """Checks every line of one file; where its chunks start (their first line's offset)."""
        offsets, good, line, end = [], 0, 0, 0
        for offset, block, truncated in _blocks(path, is_gzip, self.on_malformed):
            if truncated:
                self._malformed(path, line + 1, truncated)
            if not block:
                continue
            starts, parsed = _line_starts(block), parse_lines(block)
            for k, why in zip(parsed.bad.tolist(), parsed.reasons):
                self._malformed(path, line + k + 1, why)
            kept = np.delete(np.arange(starts.size), parsed.bad)
            first = (-(good_before + good)) % self.chunk_rows
            offsets.append(offset + starts[kept[first::self.chunk_rows]])
            good, line, end = good + kept.size, line + starts.size, offset + len(block)
        return _Counted(offsets, good, end)

    def _malformed(self, path: str, line: int, why: str) -> None:
        if self.on_malformed == "error":
            raise ValueError(f"{path}:{line}: malformed line: {why} (pass on_malformed='skip' to leave such lines "
                             "out, counted).")
        self.skipped += 1
        if len(self.malformed) < KEEP_MALFORMED:
            self.malformed.append(f"{path}:{line}: {why}")

    def __len__(self) -> int:
        return self.num_chunks

    def read(self, chunk: int) -> Parsed:
        """The examples of chunk `chunk` (`chunk_rows` of them), parsed."""
        if not 0 <= chunk < self.num_chunks:
            raise IndexError(f"chunk {chunk} is out of range: the files hold {self.num_chunks} chunks of "
                             f"{self.chunk_rows} examples.")
        (f0, start), (f1, stop) = self._bounds[chunk], self._bounds[chunk + 1]
        pieces = []
        for i in range(int(f0), int(f1) + 1):
            lo, hi = (int(start) if i == f0 else 0), (int(stop) if i == f1 else self._files[i].end)
            if hi > lo:
                data = self._bytes(i, lo, hi)
                pieces.append(data if data.endswith(b"\n") else data + b"\n")
        parsed = parse_lines(b"".join(pieces))
        if parsed.labels.size != self.chunk_rows:
            raise RuntimeError(f"chunk {chunk} of {self.paths} now holds {parsed.labels.size} examples, not "
                               f"{self.chunk_rows}: a file changed after it was opened.")
        return parsed

    def _bytes(self, i: int, lo: int, hi: int) -> bytes:
        """Bytes `[lo, hi)` of file `i` (after decompression). A plain file is opened for each read; a gzip file
        stays open and is read on from where it stopped (from its start again for an earlier offset).

        Thread-safe (grain may read chunks on several threads): one lock for the gzip files; parsing runs outside.
        """
        if not self._files[i].gzip:
            with open(self._files[i].path, "rb") as f:
                f.seek(lo)
                return f.read(hi - lo)
        with self._lock:
            f = self._handles.get(i)
            if f is None or f.tell() > lo:
                if f is not None:
                    f.close()
                f = self._handles[i] = gzip.open(self._files[i].path, "rb")
            f.seek(lo)
            return f.read(hi - lo)

    def __getstate__(self) -> dict:  # open files and the lock stay with their process (grain's workers open theirs)
        return {k: v for k, v in self.__dict__.items() if k not in ("_handles", "_lock")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _handles={}, _lock=threading.Lock())
        weakref.finalize(self, _close_all, self._handles)

    def close(self) -> None:
        """Closes the gzip files kept open (also done when the object is garbage-collected)."""
        _close_all(self._handles)


def _close_all(handles: dict) -> None:
    for f in handles.values():
        f.close()
    handles.clear()
