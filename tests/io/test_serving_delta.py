"""Live updates: the change tracker, deltas (chain == full export, bit for bit), refusals, and no torn reads."""

from __future__ import annotations

import os
import pathlib
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
import sparse_embed.serving as ss
from conftest import make_mesh
from sparse_embed.core.raw_keys import split_words
from sparse_embed.io import delta_file
from test_delta_file import _parts

B = 8
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _plan(devices=2):
    items = se.TableSpec("items", 50, 6, combiner="mean", optimizer=se.optimizers.Adagrad(0.5))
    tags = se.TableSpec("tags", 30, 6, combiner="sum", optimizer=se.optimizers.Adagrad(0.5))
    users = se.TableSpec("users", 24, 6, combiner="sum", optimizer=se.optimizers.Adagrad(0.5),
                         dynamic=se.Dynamic(expire_after=2))
    return se.plan([se.FeatureSpec("i", items, B), se.FeatureSpec("t", tags, B),
                    se.FeatureSpec("u", users, B)], make_mesh(devices))


def _batches(seed, steps):
    rng = np.random.default_rng(seed)
    users = rng.integers(0, 2**62, 40, dtype=np.int64)
    for _ in range(steps):
        ids = {"i": rng.integers(0, 20, (B, 3)), "t": rng.integers(0, 30, (B, 2)),
               "u": users[rng.integers(0, 40, (B, 2))]}
        ids["i"][rng.random((B, 3)) < 0.3] = -1
        yield ids


def _trainer(plan):
    @jax.jit
    def train(tables, maps, batch, step):
        b, tables, maps, _ = se.map_ids(plan, batch, tables, maps, step)
        loss = lambda t: sum(jnp.sum(jnp.sin(x)) for x in se.lookup(plan, b, t, step).values())
        return jax.grad(loss)(tables), maps

    return train


def _assert_same_tables(got, want):
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        g = got[name]
        if isinstance(w, tuple):
            np.testing.assert_array_equal(g[0], w[0], err_msg=name)
            g, w = g[1], w[1]
        assert g.dtype == w.dtype, name
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8), err_msg=name)


@pytest.mark.parametrize("dtype", ["int8", "int4", "bfloat16", None])
def test_a_chain_of_deltas_equals_a_full_export_bit_for_bit(dtype, tmp_path):
    plan = _plan()
    rng = jax.random.key(0)
    tables, maps, step = se.init_tables(plan, rng), se.init_id_maps(plan, rng), 0
    train, batches = _trainer(plan), _batches(1, 12)

    def run(n, changes=None):
        nonlocal tables, maps, step
        for _ in range(n):
            ids = next(batches)
            tables, maps = train(tables, maps, se.preprocess(plan, ids)[0], step)
            changes = changes and changes.touched_ids(plan, ids)
            step += 1
        return changes

    run(2)
    se.export_serving(tmp_path / "base", plan, tables, id_maps=maps, dtype=dtype)
    changes = ss.Changes.since(tmp_path / "base")
    paths = []
    for n in (3, 0, 4, 3):  # 0: a delta with no step (empty)
        changes = run(n, changes)
        path, changes = ss.export_delta(tmp_path / "deltas", plan, tables, changes, id_maps=maps)
        paths.append(path)
    assert [os.path.basename(p) for p in paths] == [ss.delta_name(changes.base, k) for k in (1, 2, 3, 4)]
    se.export_serving(tmp_path / "full", plan, tables, id_maps=maps, dtype=dtype)
    live = ss.LiveTables(tmp_path / "base")
    assert live.catch_up(tmp_path / "deltas") == 4 and live.snapshot.seq == 4
    full, _ = se.load_serving(tmp_path / "full")
    _assert_same_tables(live.snapshot.tables, full)
    evicted = sum(delta_file.read(p)[1]["users/evicted"].size for p in paths)
    base, _ = se.load_serving(tmp_path / "base")
    assert evicted > 0 and not np.array_equal(base["users"][0], full["users"][0])  # ids came and went
    header, arrays = delta_file.read(paths[1])
    assert header["tables"] == {"users": "ids"} and arrays["users/rows"].size == 0  # nothing touched: nothing sent
    rows = delta_file.read(paths[0])[1]
    assert 0 < rows["items/rows"].size < 20 and rows["tags/rows"].size <= 30


def test_the_tracker_is_pure_and_holds_every_touched_id():
    plan = _plan()
    changes = ss.Changes("b", 0, {}, {}, {"users": np.zeros(0, np.int64)})
    seen = {"items": set(), "tags": set(), "users": set()}
    first = None
    for k, ids in enumerate(_batches(3, 40)):  # more than the batches kept apart before a merge
        for f, t in (("i", "items"), ("t", "tags"), ("u", "users")):
            seen[t] |= set(np.asarray(ids[f]).ravel().tolist()) - {-1}
        ids["i"] = [row[row != -1] for row in ids["i"]]  # any format: ragged rows
        changes = changes.touched_ids(plan, ids)
        first = first or changes
    for t, want in seen.items():
        got = changes.rows(t)
        assert got.tolist() == sorted(want), t
    assert sum(len(p) for p in first.touched.values()) == 3 and changes.touched is not first.touched
    with pytest.raises(ValueError, match="unknown feature 'x'"):
        changes.touched_ids(plan, {"x": np.zeros((B, 1), np.int64)})
    with pytest.raises(ValueError, match=r"Feature 'i' \(table 'items'\): id 99"):
        changes.touched_ids(plan, {"i": np.full((B, 1), 99)})


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A base export and two deltas after it, and a delta of another export (read only)."""
    tmp_path = tmp_path_factory.mktemp("chain")
    plan = _plan(1)
    rng = jax.random.key(2)
    tables, maps = se.init_tables(plan, rng), se.init_id_maps(plan, rng)
    train = _trainer(plan)
    se.export_serving(tmp_path / "base", plan, tables, id_maps=maps, dtype="int8")
    se.export_serving(tmp_path / "other", plan, tables, id_maps=maps, dtype="int4")
    changes, other = ss.Changes.since(tmp_path / "base"), ss.Changes.since(tmp_path / "other")
    paths = []
    for step, ids in enumerate(_batches(5, 2)):
        tables, maps = train(tables, maps, se.preprocess(plan, ids)[0], step)
        path, changes = ss.export_delta(tmp_path / "d", plan, tables, changes.touched_ids(plan, ids), id_maps=maps)
        paths.append(path)
    foreign, _ = ss.export_delta(tmp_path / "o", plan, tables, other, id_maps=maps)
    # another run from the same export (its export id the same): its second delta follows its own first
    tables, maps, fork = se.init_tables(plan, rng), se.init_id_maps(plan, rng), ss.Changes.since(tmp_path / "base")
    for step, ids in enumerate(_batches(6, 2)):
        tables, maps = train(tables, maps, se.preprocess(plan, ids)[0], step)
        forked, fork = ss.export_delta(tmp_path / "fork", plan, tables, fork.touched_ids(plan, ids), id_maps=maps)
    return tmp_path / "base", paths, foreign, forked


def _flipped(path, part, tmp_path):
    """The delta at `path` with a bit of the middle byte of `part` (`_parts`) flipped, as a new file."""
    data = bytearray(pathlib.Path(path).read_bytes())
    start, stop = _parts(bytes(data))[part]
    data[(start + stop) // 2] ^= 0x04
    out = tmp_path / "flipped.delta"
    out.write_bytes(bytes(data))
    return out


PARTS = ("magic", "length", "header", "items/rows", "items/values", "tags/rows", "tags/values", "users/rows",
         "users/values", "users/evicted", "checksum")


@pytest.mark.parametrize("case, error, match", [
    ("foreign", se.CheckpointError, "applies to export .*, but the served tables come from export"),
    ("second_first", se.CheckpointError, r"is number 2 after export .* at number 0: apply .*\.000001\.delta next"),
    ("first_twice", se.CheckpointError, "is number 1 after export .* at number 1"),
    ("forked", se.CheckpointError, r"follows another delta number 1 \(checksum \w+\) than the one the served "
                                   r"tables applied \(\w+\): two runs wrote deltas after export"),
    *[(f"flip_{part}", se.CorruptCheckpointError, "is damaged or incomplete") for part in PARTS],
    ("truncated", se.CorruptCheckpointError, "is damaged or incomplete"),
])
def test_a_bad_delta_is_refused_and_changes_nothing(chain, case, error, match, tmp_path):
    base, (first, second), foreign, forked = chain
    live = ss.LiveTables(base)
    if case in ("first_twice", "forked"):
        live.apply(first)
    before = live.snapshot
    copies = {n: np.array(a[1] if isinstance(a, tuple) else a) for n, a in before.tables.items()}
    if case.startswith("flip_"):
        bad = _flipped(first, case[5:], tmp_path)
    elif case == "truncated":
        bad = tmp_path / "short.delta"
        bad.write_bytes(pathlib.Path(first).read_bytes()[:-100])
    else:
        bad = {"foreign": foreign, "second_first": second, "first_twice": first, "forked": forked}[case]
    with pytest.raises(error, match=match):
        live.apply(bad)
    assert live.snapshot is before
    for n, a in before.tables.items():
        np.testing.assert_array_equal(np.asarray(a[1] if isinstance(a, tuple) else a), copies[n])
    if case not in ("first_twice", "forked"):
        live.apply(first)
    live.apply(second)  # the good chain still applies
    assert live.snapshot.seq == 2


def test_lookups_from_threads_during_applies_never_see_a_torn_snapshot(tmp_path):
    """Version v sets every row of both tables to v; a lookup's activations must all say one version."""
    a = se.TableSpec("a", 40, 4, combiner="sum")
    b = se.TableSpec("b", 64, 4, combiner="sum")
    plan = se.plan([se.FeatureSpec("fa", a, B), se.FeatureSpec("fb", b, B)], make_mesh(2))
    state = lambda v: se.stack_tables(plan, {"a": np.full((40, 4), v, np.float32),  # noqa: E731
                                             "b": np.full((64, 4), v, np.float32)})
    se.export_serving(tmp_path / "base", plan, state(0), dtype="int8")  # constant rows: exact in int8
    changes = ss.Changes.since(tmp_path / "base")
    every = {"fa": np.arange(40).reshape(B, 5), "fb": np.arange(64).reshape(B, 8)}
    for v in range(1, 25):
        _, changes = ss.export_delta(tmp_path / "d", plan, state(v), changes.touched_ids(plan, every))
    live = ss.LiveTables(tmp_path / "base")
    features = [se.FeatureSpec("fa", live.snapshot.specs["a"], B), se.FeatureSpec("fb", live.snapshot.specs["b"], B)]
    fn = jax.jit(lambda t, ids: se.serving_lookup(features, t, ids))
    ids = {"fa": np.array([[0, 17, 39]] * B), "fb": np.array([[5, 63]] * B)}
    fn(live.snapshot.tables, ids)
    torn, seen, done = [], [], threading.Event()

    def reader():
        while not done.is_set():
            s = live.snapshot
            out = jax.device_get(fn(s.tables, ids))
            versions = np.concatenate([out["fa"].ravel() / 3, out["fb"].ravel() / 2])
            seen.append(s.seq)
            if not (versions == s.seq).all():
                torn.append((s.seq, np.unique(versions)))

    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        assert live.catch_up(tmp_path / "d") == 24
    finally:
        done.set()
        for t in threads:
            t.join()
    assert not torn and len(set(seen)) > 1, (torn, sorted(set(seen)))


def test_the_update_loop_in_docs_runs(tmp_path, monkeypatch):
    """docs/serving.md's update-loop example, run as it stands (in a temporary directory)."""
    text = (ROOT / "docs" / "serving.md").read_text()
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "export_delta" in c]
    monkeypatch.chdir(tmp_path)
    ns: dict = {}
    exec(compile(code, "docs/serving.md", "exec"), ns)
    assert ns["live"].snapshot.seq == ns["deltas"] > 0


def test_the_serving_namespace_resolves_its_names_to_the_implementation():
    import importlib

    assert se.serving is ss and "serving" in dir(se)
    where = {"quantize": "sparse_embed.io.quantize", "dequantize": "sparse_embed.io.quantize",
             "LiveTables": "sparse_embed.io.live", "Snapshot": "sparse_embed.io.live",
             "apply_delta": "sparse_embed.io.live", "load_snapshot": "sparse_embed.io.live"}
    for name in ss.__all__:
        module = importlib.import_module(where.get(name, "sparse_embed.io.changes"))
        assert getattr(ss, name) is getattr(module, name), name


def test_tracking_from_a_training_checkpoint_or_without_id_maps_is_refused(tmp_path):
    plan = _plan(1)
    rng = jax.random.key(0)
    tables, maps = se.init_tables(plan, rng), se.init_id_maps(plan, rng)
    with se.CheckpointManager(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, plan, tables, id_maps=maps)
    with pytest.raises(ValueError, match="is a training checkpoint; deltas apply to serving exports"):
        ss.Changes.since(tmp_path / "ck")
    se.export_serving(tmp_path / "s", plan, tables, id_maps=maps)
    changes = ss.Changes.since(tmp_path / "s")
    with pytest.raises(ValueError, match=r"raw-id tables \['users'\]: pass export_delta\(\.\.\., id_maps=id_maps\)"):
        ss.export_delta(tmp_path / "d", plan, tables, changes)
    static = se.plan([f for f in plan.features.values() if f.table.dynamic is None], make_mesh(1))
    with pytest.raises(ValueError, match=r"The export has raw-id tables \['users'\], the plan \[\]"):
        ss.export_delta(tmp_path / "d", static, se.init_tables(static, rng), changes)
    # a table resized since the export: its rows inside the export's vocabulary were applied to it silently
    items = se.TableSpec("items", 60, 6, combiner="mean", optimizer=se.optimizers.Adagrad(0.5))
    grown = se.plan([se.FeatureSpec("i", items, B), *[f for n, f in plan.features.items() if n != "i"]], make_mesh(1))
    with pytest.raises(ValueError, match=r"Table 'items' is \[60, 6\] in the plan, \[50, 6\] in the export: the "
                                         "tracker started at an export of another model"):
        ss.export_delta(tmp_path / "d", grown, se.init_tables(grown, rng),
                        changes.touched_ids(grown, {"i": np.array([[1, 2]] * B)}), id_maps=se.init_id_maps(grown, rng))
    assert not (tmp_path / "d").exists()


def test_write_delta_sorts_the_rows_it_is_given_and_refuses_a_row_given_twice(tmp_path):
    a = se.TableSpec("a", 10, 4, combiner="sum")
    plan = se.plan([se.FeatureSpec("fa", a, B)], make_mesh(1))
    se.export_serving(tmp_path / "base", plan, se.init_tables(plan, jax.random.key(0)))
    changes = ss.Changes.since(tmp_path / "base")
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    path, _ = ss.write_delta(tmp_path / "d", changes, {"a": (np.array([7, 2, 5]), values)})
    arrays = delta_file.read(path)[1]
    assert arrays["a/rows"].tolist() == [2, 5, 7]
    np.testing.assert_array_equal(arrays["a/values"], values[[1, 2, 0]])
    snapshot = ss.apply_delta(ss.load_snapshot(tmp_path / "base"), path)
    np.testing.assert_array_equal(np.asarray(snapshot.tables["a"])[[7, 2, 5]], values)
    with pytest.raises(ValueError, match="Table 'a': row 5 is given twice; a delta holds each once"):
        ss.write_delta(tmp_path / "e", changes, {"a": (np.array([5, 1, 5]), np.zeros((3, 4), np.float32))})
    assert not (tmp_path / "e").exists()


def test_a_delta_is_never_overwritten_by_an_old_tracker(tmp_path):
    """A server applies each sequence number once: a second delta under the same name (a tracker used twice) would
    never reach it, so it is refused and the first stays byte for byte."""
    a = se.TableSpec("a", 10, 4, combiner="sum")
    plan = se.plan([se.FeatureSpec("fa", a, B)], make_mesh(1))
    tables = se.init_tables(plan, jax.random.key(0))
    se.export_serving(tmp_path / "base", plan, tables)
    old = ss.Changes.since(tmp_path / "base").touched_ids(plan, {"fa": np.array([[1], [2]] * (B // 2))})
    path, new = ss.export_delta(tmp_path / "d", plan, tables, old)
    first = pathlib.Path(path).read_bytes()
    for write in (lambda: ss.export_delta(tmp_path / "d", plan, tables, old),
                  lambda: ss.write_delta(tmp_path / "d", old, {"a": (np.array([3]), np.ones((1, 4), np.float32))})):
        with pytest.raises(FileExistsError, match=re.escape(f"The delta {path} exists already: this tracker "
                                                            "(sequence 0)")):
            write()
    assert pathlib.Path(path).read_bytes() == first and sorted(os.listdir(tmp_path / "d")) == [os.path.basename(path)]
    path2, _ = ss.export_delta(tmp_path / "d", plan, tables, new)  # the returned tracker goes on
    assert delta_file.read(path2)[0]["seq"] == 2
    snapshot = ss.apply_delta(ss.apply_delta(ss.load_snapshot(tmp_path / "base"), path), path2)
    np.testing.assert_array_equal(np.asarray(snapshot.tables["a"]), np.asarray(se.unstack_tables(plan, tables)["a"]))


def test_under_jax_distributed_process_0_writes_the_delta_and_every_process_gets_its_tracker(tmp_path, monkeypatch):
    """Every process calls export_delta (as export_serving) into one directory: a process slower than process 0
    found its delta written and failed with "this tracker wrote its next delta before" (then the others hung at
    their next collective). Now process 0 writes it, after every process checked the name; the others only take
    its checksum for their trackers."""
    a = se.TableSpec("a", 10, 4, combiner="sum")
    plan = se.plan([se.FeatureSpec("fa", a, B)], make_mesh(1))
    tables = se.init_tables(plan, jax.random.key(0))
    se.export_serving(tmp_path / "base", plan, tables, dtype="int8")
    changes = ss.Changes.since(tmp_path / "base").touched_ids(plan, {"fa": np.array([[1], [2]] * (B // 2))})
    rows = {"a": (np.array([1, 2]), np.ones((2, 4), np.float32))}
    path, first = ss.write_delta(tmp_path / "d", changes, rows)  # process 0
    written = pathlib.Path(path).read_bytes()
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    for directory in (tmp_path / "d", tmp_path / "elsewhere"):  # found written already, or not yet
        other_path, other = ss.write_delta(directory, changes, rows)
        assert os.path.basename(other_path) == os.path.basename(path)
        assert (other.seq, other.last, other.base) == (first.seq, first.last, first.base)
    assert pathlib.Path(path).read_bytes() == written and not (tmp_path / "elsewhere").exists()


def test_under_jax_distributed_a_delta_holds_the_rows_the_ids_of_every_process_touched(tmp_path, monkeypatch):
    """A process's tracker holds the ids it fed (its rows of each batch, as its preprocess took them): the delta
    written by process 0 had only the rows of process 0's ids, and the server kept the others' old values."""
    a = se.TableSpec("a", 10, 4, combiner="sum", optimizer=se.optimizers.SGD(0.5))
    b = se.TableSpec("b", 12, 4, combiner="mean", optimizer=se.optimizers.SGD(0.5))
    plan = se.plan([se.FeatureSpec("fa", a, B), se.FeatureSpec("fb", b, B)], make_mesh(1))
    tables = se.init_tables(plan, jax.random.key(0))
    se.export_serving(tmp_path / "base", plan, tables)
    mine = ss.Changes.since(tmp_path / "base").touched_ids(plan, {"fa": np.array([[1], [2]] * (B // 2))})
    other = {"a": np.array([2, 5, 7]), "b": np.array([11])}  # what the batches of another process touched
    calls = []

    def allgather(x, tiled=False):  # this process's array, and the other process's (ids as int32 words, -1 padded)
        if tiled:  # (a global array: this process holds all of it here)
            return np.asarray(x)
        calls.append(x.shape)
        if x.ndim == 1:
            return np.stack([x, [other["a"].size, other["b"].size]])
        theirs = np.full_like(x, -1)
        theirs[:4] = split_words(np.concatenate([other["a"], other["b"]]))
        return np.stack([x, theirs])

    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr("jax.experimental.multihost_utils.process_allgather", allgather)
    tables = jax.tree.map(lambda x: x + 1, tables)  # every row moved
    path, after = ss.export_delta(tmp_path / "d", plan, tables, mine)
    header, arrays = delta_file.read(path)
    natural = se.unstack_tables(plan, tables)
    assert arrays["a/rows"].tolist() == [1, 2, 5, 7] and arrays["b/rows"].tolist() == [11]
    assert calls == [(2,), (4, 2)] and after.touched == {}
    for name in ("a", "b"):
        np.testing.assert_array_equal(arrays[f"{name}/values"], natural[name][arrays[f"{name}/rows"]])


def test_a_delta_names_the_table_row_that_cannot_be_quantized(tmp_path):
    a = se.TableSpec("a", 10, 4, combiner="sum")
    plan = se.plan([se.FeatureSpec("fa", a, B)], make_mesh(1))
    tables = se.init_tables(plan, jax.random.key(0))
    se.export_serving(tmp_path / "base", plan, tables, dtype="int8")
    changes = ss.Changes.since(tmp_path / "base").touched_ids(plan, {"fa": np.array([[2], [7]] * (B // 2))})
    natural = se.unstack_tables(plan, tables)["a"].copy()
    natural[7, 1] = np.nan  # row 7 is the delta's second row
    with pytest.raises(ValueError, match=r"Table 'a': row 7 is not finite"):
        ss.export_delta(tmp_path / "d", plan, se.stack_tables(plan, {"a": natural}), changes)
    assert not (tmp_path / "d").exists() or not os.listdir(tmp_path / "d")


@pytest.mark.parametrize("rows, raw, match", [
    ({"a": (np.array([10]), np.ones((1, 4), np.float32))}, None, r"Table 'a': row 10 is outside \[0, 10\)"),
    ({"a": (np.array([-3]), np.ones((1, 4), np.float32))}, None, r"Table 'a': row -3 is outside \[0, 10\)"),
    ({"a": (np.array([1, 2]), np.ones((2, 3), np.float32))}, None, r"Table 'a': 2 rows need values \[2, 4\], got "
                                                                   r"\(2, 3\)"),
    ({"zz": (np.array([1]), np.ones((1, 4), np.float32))}, None, r"Table 'zz': not in the export \(its tables: "
                                                                 r"\['a'\]\)"),
    ({}, {"a": (np.array([1]), np.ones((1, 4), np.float32), np.zeros(0, np.int64))}, r"Table 'a': give its rows in "
                                                                                      r"write_delta's rows="),
], ids=["past_the_table", "negative", "width", "unknown_table", "static_table_as_raw"])
def test_write_delta_refuses_what_a_server_would_refuse(rows, raw, match, tmp_path):
    """A server refuses such a delta, and then every later one as out of order: refused when written instead,
    and the tracker stays where it was."""
    a = se.TableSpec("a", 10, 4, combiner="sum")
    plan = se.plan([se.FeatureSpec("fa", a, B)], make_mesh(1))
    se.export_serving(tmp_path / "base", plan, se.init_tables(plan, jax.random.key(0)))
    changes = ss.Changes.since(tmp_path / "base")
    with pytest.raises(ValueError, match=match):
        ss.write_delta(tmp_path / "d", changes, rows, raw)
    assert not (tmp_path / "d").exists()
    path, _ = ss.write_delta(tmp_path / "d", changes, {"a": (np.array([9]), np.ones((1, 4), np.float32))})
    assert ss.apply_delta(ss.load_snapshot(tmp_path / "base"), path).tables["a"][9].tolist() == [1.0] * 4


def test_write_delta_refuses_more_raw_ids_than_the_table_has_rows(tmp_path):
    """A raw-id table's served copy holds at most vocabulary_size ids: a delta past that would be refused by the
    server, and every later one with it; refused when written, and a server polling before the first delta
    waits (catch_up of a directory not yet made: 0)."""
    u = se.TableSpec("u", 4, 2, combiner="sum", dynamic=se.Dynamic())
    plan = se.plan([se.FeatureSpec("fu", u, B)], make_mesh(1))
    rng = jax.random.key(0)
    se.export_serving(tmp_path / "base", plan, se.init_tables(plan, rng), id_maps=se.init_id_maps(plan, rng))
    changes, live = ss.Changes.since(tmp_path / "base"), ss.LiveTables(tmp_path / "base")
    assert live.catch_up(tmp_path / "d") == 0
    ids = np.array([10, 11, 12, 13, 14])
    with pytest.raises(ValueError, match=r"Table 'u': 5 ids after the delta, more than its 4 rows"):
        ss.write_delta(tmp_path / "d", changes, {}, {"u": (ids, np.ones((5, 2), np.float32), np.zeros(0, np.int64))})
    assert not (tmp_path / "d").exists()
    path, changes = ss.write_delta(tmp_path / "d", changes, {}, {"u": (ids[:4], np.ones((4, 2), np.float32),
                                                                         np.zeros(0, np.int64))})
    # full: one more id fits only with one evicted
    with pytest.raises(ValueError, match=r"Table 'u': 5 ids after the delta, more than its 4 rows"):
        ss.write_delta(tmp_path / "d", changes, {},
                       {"u": (ids[4:], np.ones((1, 2), np.float32), np.zeros(0, np.int64))})
    ss.write_delta(tmp_path / "d", changes, {}, {"u": (ids[4:], np.full((1, 2), 2, np.float32), ids[:1])})
    assert live.catch_up(tmp_path / "d") == 2
    held, array = live.snapshot.tables["u"]
    assert np.asarray(held).tolist() == [11, 12, 13, 14] and np.asarray(array)[3].tolist() == [2.0, 2.0]


def test_catch_up_warns_when_a_delta_is_missing_before_later_ones(tmp_path):
    a = se.TableSpec("a", 10, 4, combiner="sum")
    plan = se.plan([se.FeatureSpec("fa", a, B)], make_mesh(1))
    se.export_serving(tmp_path / "base", plan, se.init_tables(plan, jax.random.key(0)))
    changes, paths = ss.Changes.since(tmp_path / "base"), []
    for i in range(3):
        path, changes = ss.write_delta(tmp_path / "d", changes, {"a": (np.array([i]), np.full((1, 4), i, np.float32))})
        paths.append(path)
    os.rename(paths[0], tmp_path / "first")
    live = ss.LiveTables(tmp_path / "base")
    with pytest.warns(RuntimeWarning, match=rf"{re.escape(paths[0])} is missing, but 2 later delta\(s\) of the "
                                            r"export are there .*serving stays at delta 0"):
        assert live.catch_up(tmp_path / "d") == 0
    os.rename(tmp_path / "first", paths[0])
    assert live.catch_up(tmp_path / "d") == 3 and live.catch_up(tmp_path / "d") == 0  # (no warning: error)
    assert np.asarray(live.snapshot.tables["a"])[:3, 0].tolist() == [0.0, 1.0, 2.0]


def test_with_a_step_exports_and_deltas_leave_out_the_ids_expired_at_it(tmp_path):
    """An id expired at `step` reads zeros in the training side's lookups there (`map_ids(train=False)`): the
    served copy drops it too, in a full export and in a chain of deltas alike."""
    plan = _plan()  # users: expire_after=2
    rng = jax.random.key(0)
    tables, maps = se.init_tables(plan, rng), se.init_id_maps(plan, rng)
    train, ids = _trainer(plan), next(_batches(1, 1))
    lone = np.int64(2**61 + 3)
    first = {**ids, "u": np.where(np.arange(B)[:, None] == 0, lone, ids["u"])}
    tables, maps = train(tables, maps, se.preprocess(plan, first)[0], 0)  # the lone id: used at step 0 only
    se.export_serving(tmp_path / "base", plan, tables, id_maps=maps, step=1)
    changes = ss.Changes.since(tmp_path / "base").touched_ids(plan, ids)
    assert lone in changes.served_ids["users"]
    for step in range(1, 5):
        tables, maps = train(tables, maps, se.preprocess(plan, ids)[0], step)
    path, changes = ss.export_delta(tmp_path / "d", plan, tables, changes, id_maps=maps, step=5)
    se.export_serving(tmp_path / "full", plan, tables, id_maps=maps, step=5)
    full, _ = se.load_serving(tmp_path / "full")
    assert lone not in full["users"][0] and lone in delta_file.read(path)[1]["users/evicted"]
    _assert_same_tables(ss.apply_delta(ss.load_snapshot(tmp_path / "base"), path).tables, full)
    served = {"u": plan.features["u"]}
    got = se.serving_lookup(served, full, {"u": np.full((B, 2), lone)}, oov="zero")["u"]
    mapped = se.map_ids(plan, se.preprocess(plan, {**ids, "u": np.full((B, 2), lone)})[0], tables, maps, 5,
                        train=False)
    np.testing.assert_array_equal(got, np.zeros((B, 6)))
    assert int(mapped[3]["users"].waiting) == 1  # the training side reads it as expired too
    se.export_serving(tmp_path / "all", plan, tables, id_maps=maps)  # no step: every id in the map
    assert lone in se.load_serving(tmp_path / "all")[0]["users"][0]
    # a training checkpoint at step 5, served directly or converted, leaves the lone id out as that export does
    with se.CheckpointManager(tmp_path / "ckpt") as m:
        m.save(5, plan, tables, id_maps=maps)
    _assert_same_tables(se.load_serving(tmp_path / "ckpt")[0], full)
    for dtype in (None, "int8"):
        se.export_serving(tmp_path / f"want_{dtype}", plan, tables, id_maps=maps, step=5, dtype=dtype)
        se.convert_checkpoint(tmp_path / "ckpt", tmp_path / f"got_{dtype}", serving=True, dtype=dtype)
        _assert_same_tables(se.load_serving(tmp_path / f"got_{dtype}")[0],
                            se.load_serving(tmp_path / f"want_{dtype}")[0])


def test_a_gap_is_warned_of_past_a_million_deltas(tmp_path):
    """Delta names grow a digit at 1,000,000: compared as strings, 'b.1000000' sorted before 'b.999999', so a
    missing delta 999999 with later ones there went unwarned."""
    from sparse_embed.io.live import _warn_if_gap

    for seq in (1_000_000, 1_000_001, 999_998):
        (tmp_path / ss.delta_name("b", seq)).touch()
    with pytest.warns(RuntimeWarning, match=r"b\.999999\.delta is missing, but 2 later delta\(s\) of the export "
                                            r"are there \(b\.1000000\.delta \.\.\.\): serving stays at delta 999998"):
        _warn_if_gap(str(tmp_path), "b", 999_999)
