"""The default initializer: positional truncated normal values, the same on every mesh and stacking."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed.core import tables as core_tables
from conftest import make_mesh


def _mix(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def reference_uniform(seed: np.ndarray, rows: int, dim: int) -> np.ndarray:
    """The documented hash in numpy: (seed, row, column) -> uniform (0, 1)."""
    with np.errstate(over="ignore"):
        h = _mix(np.arange(rows, dtype=np.uint32) + seed[0])[:, None]
        h = _mix(h ^ (np.arange(dim, dtype=np.uint32) * np.uint32(0x9E3779B9) + seed[1]))
    return (h >> 8).astype(np.float64) / (1 << 24) + 0.5 / (1 << 24)


@pytest.mark.parametrize("stddev", [0.05, 1.0])
def test_values_are_the_truncated_normal_quantiles_of_the_hash(stddev):
    key = jax.random.key(3)
    got = np.asarray(se.initializers.truncated_normal(stddev)(key, (500, 24)), np.float64)
    u = reference_uniform(np.asarray(jax.random.bits(key, (2,), jnp.uint32)), 500, 24)
    lo = math.erf(-2 / math.sqrt(2))
    # the inverse error function, checked through erf: erf(z / sqrt2) must be the uniform mapped to [lo, -lo]
    np.testing.assert_allclose(np.vectorize(math.erf)(got / stddev / math.sqrt(2)), lo + u * (-2 * lo), atol=2e-6)
    assert np.abs(got).max() <= 2 * stddev * (1 + 1e-6)


def test_statistics():
    x = np.asarray(se.initializers.truncated_normal(1.0)(jax.random.key(0), (20000, 64)), np.float64)
    assert abs(x.mean()) < 0.003 and abs(x.std() - 0.87962566) < 0.003  # a unit normal truncated at ±2
    assert abs(np.corrcoef(x[:, 0], x[:, 1])[0, 1]) < 0.02 and abs(np.corrcoef(x[:-1, 0], x[1:, 0])[0, 1]) < 0.02
    hist, _ = np.histogram(x, bins=20, range=(-2, 2))
    expected = np.diff([math.erf(b / math.sqrt(2)) for b in np.linspace(-2, 2, 21)]) / (2 * math.erf(math.sqrt(2)))
    np.testing.assert_allclose(hist / x.size, expected, atol=0.002)


@pytest.mark.parametrize("devices", [1, 2, 8])
def test_init_tables_values_depend_only_on_key_and_name(devices):
    """Stacked with a table of another initializer or alone, on any mesh: the same values, zero-padded rows."""
    a, b = se.TableSpec("a", 1001, 8), se.TableSpec("b", 77, 8, initializer=se.initializers.truncated_normal(2.0))
    c = se.TableSpec("c", 40, 8, initializer=jax.nn.initializers.normal(1.0))
    feats = {t.name: se.FeatureSpec(t.name, t, 8) for t in (a, b, c)}
    want = {t.name: np.asarray(t.resolved_initializer(core_tables.table_key(jax.random.key(5), t.name),
                                                      (t.vocabulary_size, 8))) for t in (a, b)}
    for stacking in ("auto", None, [["a", "b"], ["c"]]):
        plan = se.plan(feats, make_mesh(devices), stacking=stacking)
        state = se.init_tables(plan, jax.random.key(5))
        got = se.unstack_tables(plan, state)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6)  # jit vs eager: float ulps
        rows = sum(s.total_rows for s in plan.stacks)
        assert sum(int(np.count_nonzero(np.asarray(v.table).any(1))) for v in state.values()) == 1001 + 77 + 40 <= rows


@pytest.mark.parametrize("rng", [jax.random.key(5), jax.random.PRNGKey(5)], ids=["typed", "raw"])
def test_table_seeds_are_each_tables_seeds(rng):
    names = ["a", "b/c", "d"]
    want = np.stack([np.asarray(jax.random.bits(core_tables.table_key(rng, n), (2,), jnp.uint32)) for n in names])
    np.testing.assert_array_equal(core_tables.table_seeds(rng, names), want)
    assert core_tables.table_seeds(rng, []).shape == (0, 2)


def test_init_hashes_its_keys_once_for_any_number_of_tables():
    """Each table's key hashed apart made init's program (its compile time) grow with the tables: dozens of tables
    compiled for seconds. Static tables (unstacked) and raw-id tables' maps alike."""
    def hashes(n: int) -> int:
        feats = {f"f{i}": se.FeatureSpec(f"f{i}", se.TableSpec(f"t{i}", 30 + i, 4, dynamic=se.Dynamic() if i % 2 else
                                                                 None), 4) for i in range(n)}
        plan = se.plan(feats, make_mesh(2), stacking=None)
        init = lambda k: (se.init_tables(plan, k), se.init_id_maps(plan, k))
        text = str(jax.make_jaxpr(init)(jax.random.key(0)))
        return text.count("random_bits") + text.count("random_fold_in")

    assert hashes(2) == hashes(12) == 4  # a fold_in and a bits in each of init_tables and init_id_maps


def test_bad_arguments():
    for make in (se.initializers.truncated_normal, se.initializers.TruncatedNormal):
        for bad in (0, -1.0, float("inf"), float("nan"), "0.1", None, True):
            with pytest.raises(ValueError, match=f"stddev must be a finite number > 0, got {bad!r}"):
                make(bad)
    assert se.initializers.TruncatedNormal(1) == se.initializers.truncated_normal(1.0)
    with pytest.raises(ValueError, match="2-D tables"):
        se.initializers.truncated_normal(1.0)(jax.random.key(0), (3, 4, 5))
