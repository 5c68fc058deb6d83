"""A stored array's metadata edited (dtype, shape, chunking, codecs, fill value, ...) never restores silently.

The CRC32C of a chunk and the checksum's word sums cover bits, not their
meaning: a float32 table whose `zarr.json` says int32 reads the same bits as
other numbers. Every reader checks every field of the metadata and binds
the checksum to the dtype and shape it read; these tests edit each field of
each stored array of a step and check every reader.
"""

from __future__ import annotations

import json
import pathlib
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
from conftest import make_mesh

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax's leftovers

USER = {"dense": np.zeros(40, np.float32), "count": np.array(0, np.int32)}


def _plan(devices: int) -> se.EmbeddingPlan:
    items = se.TableSpec("items", 300, 16, optimizer=se.optimizers.Adagrad(0.1))
    tags = se.TableSpec("tags", 50, 4, optimizer=se.optimizers.SGD(0.1), dtype=jnp.bfloat16)
    users = se.TableSpec("users", 200, 8, combiner="sum", dynamic=se.Dynamic(admit_after=2),
                         optimizer=se.optimizers.Adagrad(0.3))
    return se.plan([se.FeatureSpec("i", items, 8), se.FeatureSpec("t", tags, 8), se.FeatureSpec("u", users, 8)],
                   make_mesh(devices))


def _train(plan, tables, maps, step: int):
    ids = {"i": np.arange(8) * 7 + step, "t": np.arange(8) % 5,
           "u": np.array([[5, 6], [7, -1]] * 3 + [[100 + step, -1], [9, 9]])}
    batch, _ = se.preprocess(plan, ids)
    batch, tables, maps, _ = se.map_ids(plan, batch, tables, maps, step)
    loss = lambda t: sum(jnp.sum(jnp.sin(a.astype(jnp.float32))) for a in se.lookup(plan, batch, t, step).values())
    return jax.grad(loss)(tables), maps


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> pathlib.Path:
    """Steps 1 and 2 of static f32 and bf16 tables with slots, a raw-id table with waiting ids, a user pytree."""
    plan = _plan(2)
    rng = jax.random.key(0)
    tables, maps = se.init_tables(plan, rng), se.init_id_maps(plan, rng)
    path = tmp_path_factory.mktemp("damage") / "ck"
    with se.CheckpointManager(path, max_to_keep=None, async_save=False) as m:
        for step in (1, 2):
            tables, maps = _train(plan, tables, maps, step)
            m.save(step, plan, tables, id_maps=maps, user={"dense": np.full(40, step, np.float32),
                                                           "count": np.array(step, np.int32)})
    return path


def _other_dtype(name: str, same_size: bool) -> str:
    return {True: {"float32": "int32", "int32": "float32", "uint32": "int32", "bfloat16": "float16"},
            False: {"float32": "float64", "int32": "int64", "uint32": "uint8", "bfloat16": "float32"}}[same_size][name]


def _edits(meta: dict) -> list[tuple[str, dict]]:
    """(what, edited metadata): one edit of every field of a zarr3 array's metadata."""
    rows, width = meta["shape"]
    chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
    grid = lambda r, w: {"name": "regular", "configuration": {"chunk_shape": [r, w]}}  # noqa: E731
    bytes_codec = {"name": "bytes", "configuration": {"endian": "little"}}
    edits = {
        "data_type, same size": {"data_type": _other_dtype(meta["data_type"], True)},
        "data_type, other size": {"data_type": _other_dtype(meta["data_type"], False)},
        "shape, one row more": {"shape": [rows + 1, width]},
        "shape, one row less": {"shape": [rows - 1, width]},
        "shape, wider": {"shape": [rows, width + 1]},
        "chunking, twice the rows": {"chunk_grid": grid(chunk[0] * 2, width)},
        "chunking, half the rows": {"chunk_grid": grid(max(1, chunk[0] // 2), width)},
        "chunking, part of a row": {"chunk_grid": grid(chunk[0], max(1, width // 2))},
        "codecs, big endian": {"codecs": [{"name": "bytes", "configuration": {"endian": "big"}}, {"name": "crc32c"}]},
        "codecs, no crc32c": {"codecs": [bytes_codec]},
        "codecs, gzip added": {"codecs": [bytes_codec, {"name": "gzip", "configuration": {"level": 1}},
                                          {"name": "crc32c"}]},
        "fill_value": {"fill_value": 1},
        "chunk_key_encoding": {"chunk_key_encoding": {"name": "v2"}},
        "a field added": {"dimension_names": ["row", "column"]},
    }
    return [(what, {**meta, **e}) for what, e in edits.items() if {**meta, **e} != meta]  # (1-row chunks: no half)


def _arrays(step_dir: pathlib.Path) -> list[pathlib.Path]:
    """Every stored array's `zarr.json` of the table store (tables, slots, raw ids and their waiting ids)."""
    return sorted((step_dir / "embeddings").rglob("zarr.json"))


def _group(zarr_json: pathlib.Path) -> str:
    return zarr_json.parent.parent.name  # embeddings/<table or table.pending>/<key>/zarr.json


def test_the_step_has_every_kind_of_stored_array(checkpoint):
    names = {f"{_group(p)}/{p.parent.name}" for p in _arrays(checkpoint / "2")}
    assert names == {"items/table", "items/accumulator", "tags/table", "users/table", "users/accumulator",
                     "users/ids", "users/last", "users/seed", "users.pending/ids", "users.pending/counts",
                     "users.pending/last"}
    dtypes = {json.loads(p.read_text())["data_type"] for p in _arrays(checkpoint / "2")}
    assert dtypes == {"float32", "bfloat16", "int32", "uint32"}


@pytest.fixture
def damaged(checkpoint, tmp_path):
    """A copy of the checkpoint; `edit(zarr_json, meta)` replaces one array's metadata in step 2."""
    case = tmp_path / "ck"
    shutil.copytree(checkpoint, case)
    return case


def test_every_field_of_every_array_edited_is_caught_by_every_reader(damaged):
    """restore (any mesh), restore_embeddings, load_serving and verify: an error naming the table, never values."""
    plan = _plan(1)
    files = _arrays(damaged / "2")
    seen = set()
    for n, path in enumerate(files):
        original = path.read_text()
        for what, meta in _edits(json.loads(original)):
            path.write_text(json.dumps(meta))
            name, case = _group(path).removesuffix(".pending"), f"{path.parent.parent.name}/{path.parent.name}: {what}"
            with pytest.raises(se.CorruptCheckpointError, match=rf"step 2\).*'{name}"):
                se.restore_embeddings(plan, damaged, step=2)
                pytest.fail(f"restored {case}")
            v = se.verify_checkpoint(damaged, step=2)
            assert not v.ok and len(v.problems) == 1 and f"'{name}" in v.problems[0], (case, v.problems)
            if path.parent.name in ("table", "ids") and ".pending" not in str(path):  # what serving reads
                with pytest.raises(se.CorruptCheckpointError, match=f"'{name}'"):
                    se.load_serving(damaged)
            if what not in seen:  # once per kind of edit (each restore compiles anew): the manager falls back
                seen.add(what)
                with warnings.catch_warnings(record=True) as caught, se.CheckpointManager(damaged) as m:
                    warnings.simplefilter("always")
                    assert m.restore(plan, user=USER).step == 1, case
                assert any("Step 2" in str(w.message) and "corrupt" in str(w.message) for w in caught), case
        path.write_text(original)
    assert se.verify_checkpoint(damaged, step=2).ok  # the edits were the only damage


def _user_edits(meta: dict) -> list[tuple[str, dict]]:
    """One edit of every field of a zarr v2 array's metadata (orbax's user pytree)."""
    shape = meta["shape"]
    other = {"<f4": "<i4", "<i4": "<f4"}[meta["dtype"]]
    edits = {
        "dtype, same size": {"dtype": other},
        "dtype, other size": {"dtype": meta["dtype"][:2] + "8"},
        "dtype, big endian": {"dtype": ">" + meta["dtype"][1:]},
        "shape": {"shape": [s + 1 for s in shape] or [2]},
        "chunks": {"chunks": [max(1, c // 2) for c in meta["chunks"]] or [2]},
        "compressor": {"compressor": {"id": "zlib", "level": 1}},
        "fill_value": {"fill_value": 7},
        "order": {"order": "F" if meta["order"] == "C" else "C", "shape": shape or [1], "chunks": meta["chunks"] or [1]},
        "dimension_separator": {"dimension_separator": "/" if meta.get("dimension_separator") == "." else "."},
    }
    return [(what, {**meta, **e}) for what, e in edits.items()]


def test_every_field_of_the_user_pytree_metadata_edited_is_caught_or_harmless(damaged):
    """orbax's zarr v2 arrays: restore gives the saved values exactly or a CorruptCheckpointError naming the step."""
    plan = _plan(1)
    outcomes = {}
    for path in sorted((damaged / "2" / "user").rglob(".zarray")):
        original = path.read_text()
        for what, meta in _user_edits(json.loads(original)):
            path.write_text(json.dumps(meta))
            case = f"{path.parent.name}: {what}"
            try:
                with se.CheckpointManager(damaged) as m:
                    r = m.restore(plan, step=2, user=USER)
            except se.CorruptCheckpointError as e:
                assert "step 2" in str(e) or "/2" in str(e), (case, e)
                assert not se.verify_checkpoint(damaged, step=2).ok, case
                outcomes[case] = "error"
            else:
                np.testing.assert_array_equal(np.asarray(r.user["dense"]), np.full(40, 2, np.float32), err_msg=case)
                assert int(r.user["count"]) == 2, case
                outcomes[case] = "harmless"
            path.write_text(original)
    assert outcomes and all(v == "error" for k, v in outcomes.items() if "dtype" in k or "shape" in k), outcomes
