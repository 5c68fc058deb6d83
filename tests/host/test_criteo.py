"""The Criteo reader against a plain-Python reference: lines, malformed lines, files (plain, gzip, several), the
grain source's per-process rows and hashing."""

from __future__ import annotations

import gzip
import re

import numpy as np
import pytest

from sparse_embed import data as sed
from sparse_embed.host import native

MISSING = 2**32


@pytest.fixture(autouse=True, params=["C", "numpy"])
def parser(request, monkeypatch):
    """Every test on both parsers: the C extension's (if built) and numpy's."""
    if request.param == "numpy":
        monkeypatch.setenv(native.ENV, "0")
    elif native.extension() is None:
        pytest.skip("the C extension is not built")
    return request.param


def reference_line(line: str):
    """(label, dense [13], ids [26]) of one line, or None if it is malformed: the documented rules, in Python."""
    fields = line.rstrip("\n").split("\t")
    if len(fields) != 40 or fields[0] not in ("0", "1") or any(ord(c) < 9 for c in line):
        return None
    dense, ids = [], []
    for f in fields[1:14]:
        if f and not re.fullmatch(r"-?[0-9]+", f):
            return None
        dense.append(np.log1p(np.float32(max(int(f), 0))) if f else np.float32(0))
    for f in fields[14:]:
        if f and (not re.fullmatch(r"[0-9a-fA-F]{1,16}", f) or int(f, 16) >= 2**63 or int(f, 16) == MISSING):
            return None
        ids.append(int(f, 16) if f else MISSING)
    return float(fields[0]), np.array(dense, np.float32), np.array(ids, np.int64)


def random_line(rng: np.random.Generator) -> str:
    """A well-formed line: ints of 0..12 digits (some negative, some missing), hex of 1..16 digits (mostly 8)."""
    ints = []
    for _ in range(13):
        r = rng.random()
        ints.append("" if r < 0.2 else f"-{rng.integers(1, 10)}" if r < 0.25 else
                    str(rng.integers(0, 10 ** int(rng.integers(1, 13)))))
    cats = []
    for _ in range(26):
        r, n = rng.random(), 8
        if r < 0.15:
            cats.append("")
            continue
        if r < 0.25:
            n = int(rng.integers(1, 16))
        digits = "".join(rng.choice(list("0123456789abcdef"), n))
        cats.append(digits.upper() if rng.random() < 0.05 else digits)
    return "\t".join([str(rng.integers(0, 2)), *ints, *cats]) + "\n"


BAD_LINES = {
    "too few fields": "1\t2\t3\n",
    "bad hex": "0" + "\t1" * 13 + "\tzz12ab34" + "\t" * 25 + "\n",
    "hex >= 2**63": "0" + "\t" * 13 + "\t" + "f" * 16 + "\t" * 25 + "\n",
    "17 hex digits": "0" + "\t" * 13 + "\t" + "0" * 16 + "1" + "\t" * 25 + "\n",  # (a small value: still malformed)
    "hex == MISSING_ID": "0" + "\t" * 13 + "\t" * 25 + "\t100000000\n",  # 2**32: would read as missing
    "hex == MISSING_ID, 16 digits": "0" + "\t" * 13 + "\t0000000100000000" + "\t" * 25 + "\n",
    "bad label": "2" + "\t" * 39 + "\n",
    "bad integer": "1\t1a" + "\t" * 38 + "\n",
    "lone minus": "1\t-" + "\t" * 38 + "\n",
    "control byte": "1\t\x01" + "\t" * 38 + "\n",
    "long bad integer": "1\t1234567890x" + "\t" * 38 + "\n",
}


def check_parsed(parsed, lines: list[str]) -> None:
    want = [reference_line(x) for x in lines]
    good = [w for w in want if w is not None]
    np.testing.assert_array_equal(parsed.bad, [i for i, w in enumerate(want) if w is None])
    np.testing.assert_array_equal(parsed.labels, [w[0] for w in good])
    np.testing.assert_array_equal(parsed.dense, np.array([w[1] for w in good]).reshape(-1, 13))
    np.testing.assert_array_equal(parsed.categorical, np.array([w[2] for w in good]).reshape(-1, 26))


def test_parse_lines_matches_the_reference():
    rng = np.random.default_rng(0)
    lines = [random_line(rng) for _ in range(500)]
    parsed = sed.parse_lines("".join(lines).encode())
    check_parsed(parsed, lines)
    assert parsed.bad.size == 0 and parsed.dense.dtype == np.float32 and parsed.categorical.dtype == np.int64


def test_parse_lines_without_final_newline_and_empty():
    rng = np.random.default_rng(1)
    lines = [random_line(rng) for _ in range(3)]
    check_parsed(sed.parse_lines("".join(lines).rstrip("\n").encode()), lines)
    empty = sed.parse_lines(b"")
    assert empty.labels.shape == (0,) and empty.dense.shape == (0, 13) and empty.categorical.shape == (0, 26)


@pytest.mark.parametrize("kind", sorted(BAD_LINES))
def test_a_malformed_line_is_reported_with_its_reason(kind):
    rng = np.random.default_rng(2)
    lines = [random_line(rng), BAD_LINES[kind], random_line(rng)]
    parsed = sed.parse_lines("".join(lines).encode())
    assert reference_line(BAD_LINES[kind]) is None  # the reference agrees that it is malformed
    check_parsed(parsed, lines)
    assert len(parsed.reasons) == 1 and parsed.reasons[0]


def test_every_byte_inside_a_hex_field_parses_as_the_reference():
    """Each byte value in the middle of a categorical field: a hex digit reads as one, anything else (control
    bytes 0x10-0x19 included, which the numpy path once read as '0'-'9') makes the line malformed, naming C1."""
    rng = np.random.default_rng(3)
    for b in sorted(set(range(256)) - {9, 10}):
        line = "0" + "\t" * 13 + "\ta" + chr(b) + "c" + "\t" * 25 + "\n"
        parsed = sed.parse_lines(line.encode("latin-1") + random_line(rng).encode())
        want = reference_line(line)
        assert (parsed.bad.tolist() == [0]) == (want is None), hex(b)
        if want is None:
            why = "a control character" if b < 9 else "field 15 (C1)"  # (bytes below a tab: the line's own check)
            assert why in parsed.reasons[0], (hex(b), parsed.reasons)
        else:
            assert parsed.categorical[0, 0] == want[2][0], hex(b)


def test_reasons_name_the_field():
    parsed = sed.parse_lines(BAD_LINES["bad hex"].encode() + BAD_LINES["too few fields"].encode())
    assert "field 15 (C1)" in parsed.reasons[0] and "'zz12ab34'" in parsed.reasons[0]
    assert "3 fields, not 40" in parsed.reasons[1]


def test_a_hex_value_of_more_than_16_digits_is_named_so():
    """17 digits of value 1: the reason said "not a hexadecimal value below 2**63", which it is."""
    parsed = sed.parse_lines(BAD_LINES["17 hex digits"].encode())
    assert parsed.reasons == ("field 15 (C1) is '00000000000000001', not a hexadecimal value of 1 to 16 digits below "
                              "2**63",)



def test_an_integer_past_int64_is_named_so():
    """20 digits: the reason said "not an integer", which it is (a too large one)."""
    line = "1\t" + "9" * 20 + "\t" * 38 + "\n"
    assert sed.parse_lines(line.encode()).reasons == (f"field 2 (I1) is '{'9' * 20}', not an integer below 2**63 in "
                                                      "magnitude",)


def splitmix64(x: int) -> int:
    m = 2**64 - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
    return x ^ (x >> 31)


def test_hash_ids_is_splitmix64_mod_vocabulary():
    ids = np.array([0, 1, 2**32, 2**63 - 1, 12345], np.int64)
    np.testing.assert_array_equal(sed.hash_ids(ids, 1000), [splitmix64(int(i)) % 1000 for i in ids])
    per_column = sed.hash_ids(np.stack([ids, ids], 1), np.array([7, 11]))
    np.testing.assert_array_equal(per_column[:, 1], [splitmix64(int(i)) % 11 for i in ids])


# ---------------------------------------------------------------- files


def write(path, lines: list[str], compress: bool = False) -> str:
    data = "".join(lines).encode()
    with (gzip.open if compress else open)(path, "wb") as f:
        f.write(data)
    return str(path)


def good_rows(lines: list[str]):
    return [w for w in map(reference_line, lines) if w is not None]


@pytest.mark.parametrize("compress", [False, True])
def test_files_read_back_in_chunks_across_files(tmp_path, compress, monkeypatch):
    from sparse_embed.host import criteo_files

    monkeypatch.setattr(criteo_files, "BLOCK_BYTES", 4096)  # several blocks per file
    rng = np.random.default_rng(3)
    parts = [[random_line(rng) for _ in range(n)] for n in (37, 0, 50)]
    parts[2][-1] = parts[2][-1].rstrip("\n")  # the last line without its newline
    paths = [write(tmp_path / f"day_{i}{'.gz' if compress else ''}", p, compress) for i, p in enumerate(parts)]
    files = sed.CriteoFiles(paths, chunk_rows=10)
    rows = good_rows(sum(parts, []))
    assert len(files) == len(rows) // 10 == 8
    for c in [7, 3, 0, 4]:  # any order (gzip: from the start again)
        got = files.read(c)
        np.testing.assert_array_equal(got.categorical, np.array([r[2] for r in rows[10 * c:10 * c + 10]]))
        np.testing.assert_array_equal(got.dense, np.array([r[1] for r in rows[10 * c:10 * c + 10]]))
    with pytest.raises(IndexError, match="chunk 8 is out of range"):
        files.read(8)


def test_malformed_lines_error_names_file_and_line(tmp_path):
    rng = np.random.default_rng(4)
    lines = [random_line(rng) for _ in range(5)]
    lines.insert(3, BAD_LINES["bad hex"])
    path = write(tmp_path / "bad.txt", lines)
    with pytest.raises(ValueError, match=re.escape(f"{path}:4: malformed line: field 15 (C1)")):
        sed.CriteoFiles(path, 2)


@pytest.mark.parametrize("last", ["6ab1e4c3", ""])
def test_windows_line_endings_are_named(tmp_path, last):
    """A file with CRLF line endings: every line's last field ends in '\r'; the error said only "field 40 (C26) is
    '6ab1e4c3\r', not a hexadecimal value", the '\r' visible in the repr alone."""
    rng = np.random.default_rng(6)
    lines = [random_line(rng).rstrip("\n").rsplit("\t", 1)[0] + f"\t{last}\r\n" for _ in range(3)]
    assert all(reference_line(x) is None for x in lines)
    crlf = "the line ends in '\\r\\n', Windows line endings: lines must end in '\\n' alone"
    parsed = sed.parse_lines("".join(lines).encode())
    assert parsed.bad.tolist() == [0, 1, 2] and all(crlf in why and "field 40 (C26)" in why for why in parsed.reasons)
    path = write(tmp_path / "crlf.txt", lines)
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: malformed line: field 40 (C26) is '{last}\\r', ")
                       + ".*" + re.escape(crlf)):
        sed.CriteoFiles(path, 1)


def test_malformed_lines_skipped_and_counted(tmp_path):
    rng = np.random.default_rng(5)
    lines = [random_line(rng) for _ in range(12)]
    for i, bad in zip((0, 5, 9), ("bad hex", "too few fields", "bad label")):
        lines.insert(i, BAD_LINES[bad])
    path = write(tmp_path / "bad.txt", lines)
    files = sed.CriteoFiles(path, 4, on_malformed="skip")
    assert files.skipped == 3 and files.malformed[0].startswith(f"{path}:1: ") and len(files) == 3
    rows = good_rows(lines)
    np.testing.assert_array_equal(np.concatenate([files.read(c).categorical for c in range(3)]),
                                  np.array([r[2] for r in rows]))


def test_truncated_gzip(tmp_path):
    rng = np.random.default_rng(6)
    lines = [random_line(rng) for _ in range(40)]
    path = write(tmp_path / "t.gz", lines, compress=True)
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match=re.escape(path) + ".*gzip stream ends early or is corrupt after line"):
        sed.CriteoFiles(path, 4)
    files = sed.CriteoFiles(path, 4, on_malformed="skip")
    assert 0 < len(files) < 10 and files.skipped >= 1
    got = np.concatenate([files.read(c).categorical for c in range(len(files))])
    np.testing.assert_array_equal(got, np.array([r[2] for r in good_rows(lines)[:got.shape[0]]]))


def test_a_gzip_file_cut_before_anything_decompressed_is_noted(tmp_path):
    """Cut at its first bytes: no line decompressed, so none ended inside a line, and under "skip" its lines were
    lost with no count and no note (the file beside it read as if it were all). Now noted, naming the file."""
    rng = np.random.default_rng(16)
    whole = write(tmp_path / "a.gz", [random_line(rng) for _ in range(30)], compress=True)
    cut = write(tmp_path / "b.gz", [random_line(rng) for _ in range(300)], compress=True)
    with open(cut, "rb") as f:
        data = f.read()
    with open(cut, "wb") as f:
        f.write(data[:40])
    files = sed.CriteoFiles([whole, cut], 10, on_malformed="skip")
    assert len(files) == 3 and files.skipped == 1
    assert files.malformed == [f"{cut}:1: the gzip stream ends early or is corrupt here (what followed is lost)"]


def test_files_bad_arguments(tmp_path):
    path = write(tmp_path / "a.txt", [random_line(np.random.default_rng(7))])
    with pytest.raises(ValueError, match="on_malformed must be"):
        sed.CriteoFiles(path, 2, on_malformed="ignore")
    with pytest.raises(ValueError, match="chunk_rows must be an int >= 1"):
        sed.CriteoFiles(path, 0)
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        sed.CriteoFiles(str(tmp_path / "nope.txt"), 2)
    with pytest.raises(ValueError, match="paths is empty"):
        sed.CriteoFiles([], 2)
    with pytest.raises(IsADirectoryError, match=r"Criteo files are directories: \[.*\]; give the files in them"):
        sed.CriteoFiles(str(tmp_path), 2)
    assert sed.CriteoFiles(path.encode(), 1).paths == (path,)  # a bytes path is one path (was: a sequence of ints)


# ---------------------------------------------------------------- the grain source


def test_source_splits_each_batch_over_processes_and_hashes(tmp_path):
    rng = np.random.default_rng(8)
    lines = [random_line(rng) for _ in range(50)]
    path = write(tmp_path / "a.txt", lines)
    rows = good_rows(lines)
    whole = sed.CriteoSource(path, 8, process_index=0, process_count=1)
    halves = [sed.CriteoSource(path, 8, process_index=p, process_count=2) for p in range(2)]
    assert len(whole) == len(halves[0]) == 6
    for i in (0, 5):
        got = np.concatenate([h[i].categorical for h in halves])
        np.testing.assert_array_equal(got, whole[i].categorical)
        np.testing.assert_array_equal(got, np.array([r[2] for r in rows[8 * i:8 * i + 8]]))
        np.testing.assert_array_equal(whole[i].labels, [r[0] for r in rows[8 * i:8 * i + 8]])
    hashed = sed.CriteoSource(path, 8, vocabulary=1000, process_index=0, process_count=1)[2].categorical
    np.testing.assert_array_equal(hashed, [[splitmix64(int(v)) % 1000 for v in r[2]] for r in rows[16:24]])
    ids = sed.criteo_ids(whole[1])
    assert sorted(ids, key=lambda n: int(n[1:])) == [f"C{i}" for i in range(1, 27)]
    np.testing.assert_array_equal(ids["C7"], whole[1].categorical[:, 6])


def test_source_bad_arguments(tmp_path):
    path = write(tmp_path / "a.txt", [random_line(np.random.default_rng(9))] * 4)
    with pytest.raises(ValueError, match="positive multiple of the 2 processes"):
        sed.CriteoSource(path, 3, process_index=0, process_count=2)
    with pytest.raises(ValueError, match="vocabulary must be an int >= 1 or 26"):
        sed.CriteoSource(path, 2, vocabulary=[5, 6], process_index=0, process_count=1)
    with pytest.raises(IndexError, match="batch 2 is out of range"):
        sed.CriteoSource(path, 2, process_index=0, process_count=1)[2]
    with pytest.raises(ValueError, match="names must name the 26"):
        sed.criteo_ids(sed.CriteoSource(path, 2, process_index=0, process_count=1)[0], ("a",))
