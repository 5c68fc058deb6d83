"""core.raw_keys: the (hi, lo) key words and splitmix64, checked against Python ints; host's C copy against it."""

from __future__ import annotations

import numpy as np
import pytest

from sparse_embed.core import raw_keys
from sparse_embed.host import native

M64 = (1 << 64) - 1


def _splitmix64(i: int) -> int:
    """The finalizer written out on Python ints (Steele, Lea & Flood 2014), independent of the module's constants."""
    z = i & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def _ids(n: int = 2000) -> np.ndarray:
    rng = np.random.default_rng(0)
    edges = [0, 1, 2, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**32 + 1, 2**62, 2**63 - 2, 2**63 - 1]
    return np.concatenate([np.array(edges, np.int64), rng.integers(0, 2**63 - 1, n, dtype=np.int64),
                           rng.integers(0, 1000, n, dtype=np.int64)])


def test_splitmix64_and_owner_shards_match_python_ints():
    ids = _ids()
    np.testing.assert_array_equal(raw_keys.splitmix64(ids), np.array([_splitmix64(int(i)) for i in ids], np.uint64))
    for S in (1, 2, 3, 8, 12, 64):
        want = np.array([_splitmix64(int(i)) % S for i in ids], np.int64)
        got = raw_keys.owner_shards(ids, S)
        assert got.dtype == np.int64
        np.testing.assert_array_equal(got, want)


def test_words_are_hi_lo_int32_and_round_trip():
    ids = _ids()
    words = raw_keys.split_words(ids)
    assert words.dtype == np.int32 and words.shape == (ids.size, 2)
    u = words.view(np.uint32).astype(np.int64)
    np.testing.assert_array_equal(u[:, 0] << 32 | u[:, 1], ids)
    np.testing.assert_array_equal(raw_keys.join_words(words), ids)
    assert raw_keys.split_words(np.array([2**32 + 5])).tolist() == [[1, 5]]
    assert raw_keys.join_words(np.zeros((0, 2), np.int32)).shape == (0,)


@pytest.mark.usefixtures("needs_native_preprocess")  # a skip, or under CI a failure
@pytest.mark.parametrize("S", [1, 2, 3, 8, 7, 64, 1000])
def test_the_c_owner_shards_match_core(S):
    """host/_native.c's splitmix64 (its speed path, power-of-2 shortcut included) against core.raw_keys'."""
    ids = _ids()
    out = np.full(ids.size, -1, np.int64)
    native.extension().owner_shards(ids, S, out)
    np.testing.assert_array_equal(out, raw_keys.owner_shards(ids, S))
