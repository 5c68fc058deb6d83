"""plan(memory_budget=..., offload_to=...): the largest tables go to disk, their caches fill what the budget leaves."""

from __future__ import annotations

import math

import pytest

import sparse_embed as se
from tests.conftest import make_mesh

MIB = 1 << 20


def _features():
    big = se.TableSpec("big", 1_000_000, 64, optimizer=se.optimizers.RowwiseAdagrad(0.1))  # 260 B a row
    mid = se.TableSpec("mid", 200_000, 64, optimizer=se.optimizers.Adagrad(0.1))  # 512 B a row
    small = se.TableSpec("small", 1000, 16)  # SGD: 64 B a row
    raw = se.TableSpec("raw", 300_000, 32, dynamic=se.Dynamic())  # SGD, raw ids: 128 B a row, never offloaded
    return [se.FeatureSpec("a", big, 64), se.FeatureSpec("b", mid, 64), se.FeatureSpec("c", small, 64),
            se.FeatureSpec("d", raw, 64)]


def _bytes(rows: int, row_bytes: int, shards: int) -> int:  # the reference: rows spread evenly by rows
    return math.ceil(rows / shards) * row_bytes


@pytest.mark.parametrize("shards", [1, 8])
def test_a_budget_below_the_tables_offloads_the_largest_and_the_caches_fill_the_rest(tmp_path, shards):
    mesh = make_mesh(shards)
    full = {"big": _bytes(10**6, 260, shards), "mid": _bytes(200_000, 512, shards),
            "small": _bytes(1000, 64, shards), "raw": _bytes(300_000, 128, shards)}
    budget = sum(full.values()) - full["big"] // 2  # big alone no longer fits whole
    plan = se.plan(_features(), mesh, memory_budget=budget, offload_to=str(tmp_path))
    assert set(plan.tiered_tables) == {"big"}
    big = plan.tiered_tables["big"]
    assert big.vocabulary_size == 10**6 and big.storage.path == str(tmp_path / "big")
    room = budget - (full["mid"] + full["small"] + full["raw"])
    assert big.cache_rows == min(10**6, room // 260 * shards)  # the whole room, in whole rows per device
    assert plan.memory_per_device() <= budget
    assert plan.tables["big"].vocabulary_size == big.cache_rows  # the stack holds the cache


def test_a_budget_that_fits_offloads_nothing_and_a_tighter_one_offloads_more(tmp_path):
    mesh = make_mesh(1)
    assert not se.plan(_features(), mesh, memory_budget=10**9, offload_to=str(tmp_path)).tiered
    tight = se.plan(_features(), mesh, memory_budget=60 * MIB, offload_to=str(tmp_path))
    assert set(tight.tiered_tables) == {"big", "mid"}  # raw ids are never offloaded; big first, then mid
    assert tight.memory_per_device() <= 60 * MIB
    caches = {n: t.cache_rows * (260 if n == "big" else 512) for n, t in tight.tiered_tables.items()}
    full = {"big": 260 * 10**6, "mid": 512 * 200_000}
    assert caches["big"] / caches["mid"] == pytest.approx(full["big"] / full["mid"], rel=1e-3)  # shared by size


def test_a_declared_offload_keeps_its_cache_and_counts_against_the_budget(tmp_path):
    """A table declared with `storage=Offload(path, cache_rows)` keeps both: the planner shared the room among
    every offloaded table's caches, overriding the declared cache (123 rows became 10,686 under this budget)."""
    feats = _features()
    mid = feats[1].table
    declared = se.TableSpec("mid", mid.vocabulary_size, 64, optimizer=mid.optimizer,
                            storage=se.offload.Offload(str(tmp_path / "mine"), cache_rows=123))
    feats[1] = se.FeatureSpec("b", declared, 64)
    kept = _bytes(1000, 64, 1) + _bytes(300_000, 128, 1) + _bytes(123, 512, 1)  # small, raw, mid's cache
    budget = kept + 10 * MIB
    plan = se.plan(feats, make_mesh(1), memory_budget=budget, offload_to=str(tmp_path))
    mid = plan.tiered_tables["mid"]
    assert mid.cache_rows == 123 and mid.storage.path == str(tmp_path / "mine")
    assert plan.tiered_tables["big"].cache_rows == 10 * MIB // 260  # the room left, all big's
    assert plan.memory_per_device() <= budget
    with pytest.raises(ValueError, match=r"no room for table 'small''s cache .*the declared caches of \['mid'\] 62976"):
        se.plan(feats, make_mesh(1), memory_budget=kept - 1, offload_to=str(tmp_path))
    only_raw = [feats[1], feats[3]]  # raw ids are never offloaded: nothing the planner could move
    with pytest.raises(ValueError, match=r"too small: the tables kept in memory need \d+, the declared caches of "
                                         r"\['mid'\] 62976, and no other table can be offloaded"):
        se.plan(only_raw, make_mesh(1), memory_budget=MIB, offload_to=str(tmp_path))


def test_offload_errors_name_the_problem(tmp_path):
    mesh = make_mesh(1)
    with pytest.raises(ValueError, match="offload_to needs a memory_budget"):
        se.plan(_features(), mesh, offload_to=str(tmp_path))
    with pytest.raises(ValueError, match="no room for table 'big'"):
        se.plan(_features(), mesh, memory_budget=30 * MIB, offload_to=str(tmp_path))  # raw + small alone: 37 MiB
    with pytest.raises(ValueError, match="offload_to=<directory>"):
        se.plan(_features(), mesh, memory_budget=60 * MIB)


def test_describe_shows_each_offloaded_tables_cache_and_observed_hit_rate(tmp_path):
    plan = se.plan(_features(), make_mesh(1), memory_budget=100 * MIB, offload_to=str(tmp_path))
    stats = se.offload.TierStats(lookups=1000, hits=873, rows_read=40, rows_written=55)
    text = plan.describe(offload={"big": stats})
    assert f"offloaded 'big': 1000000 rows in {tmp_path / 'big'}, a cache of {plan.tiered_tables['big'].cache_rows}" \
        in text
    assert "hit rate 0.873 over 1000 ids, 40 rows read, 55 written" in text
    assert "observed" not in plan.describe()  # no stats: the cache alone
