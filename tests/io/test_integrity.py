"""Bit rot never restores silently: checksums of every stored array, verified on every read."""

from __future__ import annotations

import gc
import pathlib
import re
import shutil
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
from sparse_embed import cli
from sparse_embed.io import integrity, store
from conftest import make_mesh, require_native
from old_checkpoints import save_old

# orbax leaves a tensorstore future behind when a read fails; its callback may fire after its event
# loop closed ("Event loop is closed", an unraisable exception at garbage collection): not ours.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(autouse=True, scope="module")
def _collect_orbax_leftovers():
    """Surfaces those leftovers here, under this module's filter, not in a later module's test (once per module:
    a full collection costs seconds on the suite's heap)."""
    yield
    gc.collect()


def reference_checksum(x: np.ndarray, rows: int | None = None) -> str:
    """The documented formula, word by word in Python integers."""
    x = np.ascontiguousarray(x)[:rows]
    size = x.dtype.itemsize
    words = x.reshape(-1).view(np.uint32) if size == 8 else x.reshape(-1).view(f"u{size}")
    a = b = 0
    for i, w in enumerate(int(v) for v in words):
        a += w * ((i * 0x9E3779B9 | 1) & 0xFFFFFFFF)
        b += (w ^ (w >> 15)) * ((((i ^ 0x165667B1) * 0x85EBCA77) | 1) & 0xFFFFFFFF)
    return f"{a & 0xFFFFFFFF:08x}{b & 0xFFFFFFFF:08x}"


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16, np.int8, np.int32, np.uint16, np.float64, bool])
@pytest.mark.parametrize("native", [True, False], ids=["C", "numpy"])
def test_checksum_matches_reference_on_host_and_every_sharding(mesh8, dtype, native, monkeypatch):
    monkeypatch.setenv("SPARSE_EMBED_NATIVE", "1" if native else "0")
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(24, 8)) * 100).astype(dtype)
    want = reference_checksum(x)
    assert integrity.checksum(x) == want and integrity.checksum(x, 10) == reference_checksum(x, 10)
    if np.dtype(dtype).itemsize < 8:  # jax arrays (no x64): rows, columns (gathered) and replicated
        for spec in (jax.sharding.PartitionSpec("x"), jax.sharding.PartitionSpec(None, "x"),
                     jax.sharding.PartitionSpec()):
            d = jax.device_put(x, jax.sharding.NamedSharding(mesh8, spec))
            assert integrity.checksum(d) == want and integrity.checksum(d, 10) == reference_checksum(x, 10), spec


def _crc32c(data: bytes) -> int:
    """CRC-32C by its definition, bit by bit (reflected polynomial 0x82F63B78)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


_NATIVE_RESULTS = """
import json, sys, numpy as np
from sparse_embed.host.native import extension
m, rng, out = extension(), np.random.default_rng(7), []
for n in (0, 1, 7, 8, 9, 767, 768, 771, 2053):
    x = rng.integers(0, 256, n + 5, dtype=np.uint8)
    for off in (0, 3):
        for size in (1, 2, 4, 8):
            v = x[off: off + n // size * size]
            out.append([m.crc32c(v.tobytes()), *m.checksum(v.view(f"u{size}"), size, 2**32 - 9 + off)])
print(json.dumps(out))
"""


def test_native_crc32c_and_checksum_match_their_definitions_with_and_without_simd(tmp_path):
    """The C extension's CRC-32C (what zarr3's crc32c codec stores after each chunk) and checksum sums: the
    standard check value, the CRC tensorstore stored for a chunk, chaining, the reference sums; and the SIMD
    loops (crc32 instruction, AVX2) give the same as the portable ones ($SPARSE_EMBED_NATIVE_ISA=baseline)."""
    import json
    import os
    import subprocess
    import sys

    from sparse_embed.host.native import extension

    require_native("preprocess")
    m = extension()
    assert m.crc32c(b"123456789") == 0xE3069283 == _crc32c(b"123456789")
    data = np.random.default_rng(3).integers(0, 256, 3001, dtype=np.uint8).tobytes()
    for n in (0, 1, 13, 768, 3001):
        assert m.crc32c(data[:n]) == _crc32c(data[:n]), n
        assert m.crc32c(data[n // 3: n], m.crc32c(data[: n // 3])) == _crc32c(data[:n]), n
    x = np.random.default_rng(4).normal(size=(100, 3)).astype(np.float32)
    store.write_host(str(tmp_path), {"t": {"table": x}})
    chunk = (pathlib.Path(store.array_path(str(tmp_path), "t", "table")) / "c" / "0" / "0").read_bytes()
    assert m.crc32c(chunk[:-4]) == int.from_bytes(chunk[-4:], "little")
    for w in (x[:3], x[:50]):
        assert "%08x%08x" % m.checksum(w, 4, 0) == reference_checksum(w)
    runs = {}
    for isa in ("native", "baseline"):
        env = {**os.environ, "SPARSE_EMBED_NATIVE_ISA": isa}
        done = subprocess.run([sys.executable, "-c", _NATIVE_RESULTS], env=env, capture_output=True, text=True,
                              check=True)
        runs[isa] = json.loads(done.stdout)
    assert runs["native"] == runs["baseline"]


def test_checksum_changes_with_every_single_bit_and_with_swapped_words():
    x = np.random.default_rng(1).normal(size=(5, 3)).astype(np.float32)
    base = integrity.checksum(x)
    for byte in range(x.nbytes):
        for bit in range(8):
            y = x.copy()
            y.view(np.uint8).reshape(-1)[byte] ^= 1 << bit
            assert integrity.checksum(y) != base, (byte, bit)
    assert integrity.checksum(x[::-1]) != base and integrity.checksum(x.T.copy()) != base
    assert integrity.checksum(np.float32(1.0)) == reference_checksum(np.array([1.0], np.float32))
    with pytest.raises(TypeError, match="cannot checksum"):
        integrity.checksum(np.zeros(3, np.complex128))


# ------------------------------------------------------------------ corrupted checkpoints


def _specs():
    a = se.TableSpec("items", 1000, 16, optimizer=se.optimizers.Adagrad(0.1))
    u = se.TableSpec("users", 300, 8, optimizer=se.optimizers.SGD(0.1))
    return {"i": se.FeatureSpec("i", a, 8), "u": se.FeatureSpec("u", u, 8)}


@pytest.fixture(scope="module")
def two_steps(tmp_path_factory):
    """A checkpoint with steps 1 and 2 (tables, slots, a user pytree) and their values."""
    plan = se.plan(_specs(), make_mesh(8))
    path = tmp_path_factory.mktemp("integrity") / "ck"
    values = {}
    with pytest.MonkeyPatch.context() as mp, se.CheckpointManager(path, max_to_keep=None) as m:
        mp.setattr(store, "CHUNK_BYTES", 4096)  # several chunks per array
        for step in (1, 2):
            state = se.init_tables(plan, jax.random.key(step))
            user = {"dense": np.full(40, step, np.float32), "count": np.array(step, np.int32)}
            m.save(step, plan, state, user=user)
            values[step] = (se.unstack_state(plan, state), user)
    return path, values


def _restore(path, step=None, devices=2):
    plan = se.plan(_specs(), make_mesh(devices))
    with se.CheckpointManager(path) as m:
        r = m.restore(plan, step=step, user={"dense": np.zeros(40, np.float32), "count": np.array(0, np.int32)})
    return r.step, se.unstack_state(plan, r.tables), r.user


def _assert_values(got, want):
    (tables, user), (want_tables, want_user) = got, want
    for t in want_tables:
        for k in want_tables[t]:
            np.testing.assert_array_equal(np.asarray(tables[t][k]), want_tables[t][k])
    np.testing.assert_array_equal(np.asarray(user["dense"]), want_user["dense"])
    assert int(user["count"]) == int(want_user["count"])


def _flip(file: pathlib.Path, where: str) -> None:
    """Overwrites up to 64 bytes of `file` in place (same size) with other bytes."""
    data = bytearray(file.read_bytes())
    n = min(64, len(data))
    start = {"start": 0, "middle": (len(data) - n) // 2, "end": len(data) - n}[where]
    for i in range(start, start + n):
        data[i] ^= 0xA5
    file.write_bytes(bytes(data))


def _files(step_dir: pathlib.Path) -> list[str]:
    return sorted(str(p.relative_to(step_dir)) for p in step_dir.rglob("*") if p.is_file())


def _is_data(name: str) -> bool:
    """A chunk of an array's values (zarr names chunks by their indices, e.g. `items/table/c/3/0`)."""
    return re.fullmatch(r"[\d.]+", name.rsplit("/", 1)[-1]) is not None


def test_the_checkpoint_has_every_kind_of_file(two_steps):
    files = _files(two_steps[0] / "2")
    for kind in ("embeddings/items/table/c/", "embeddings/items/accumulator/c/", "embeddings/users/table/c/",
                 "embeddings/items/table/zarr.json", "user/dense/", "meta/metadata", "_CHECKPOINT_METADATA"):
        assert any(f.startswith(kind) for f in files), kind
    assert sum(f.startswith("embeddings/items/table/c/") for f in files) >= 8  # several chunks per array


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_flipped_bytes_in_the_latest_step_raise_or_fall_back(two_steps, tmp_path, where):
    """Every file of the latest step: restore() gives step 2 or falls back to step 1, exactly; never other values."""
    path, values = two_steps
    outcomes = {}
    files = _files(path / "2")
    chunks = {}
    for name in filter(_is_data, files):
        chunks.setdefault(name.rsplit("/", 1)[0], []).append(name)
    sample = {c[0] for c in chunks.values()} | {c[-1] for c in chunks.values()}  # each array's first, last chunk
    for name in [f for f in files if not _is_data(f) or f in sample]:
        case = tmp_path / f"case{len(outcomes)}"
        shutil.copytree(path, case)
        _flip(case / "2" / name, where)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                step, tables, user = _restore(case)
            except se.CheckpointError:
                outcomes[name] = "error"
                continue
        _assert_values((tables, user), values[step])
        if step == 1:
            assert any("Step 2" in str(w.message) and "corrupt" in str(w.message) for w in caught), name
        try:  # the latest step asked for by number: its own values or an error, never others
            got = _restore(case, step=2)
        except se.CheckpointError as e:
            assert "corrupt" in str(e) or "cannot" in str(e), (name, e)
            outcomes[name] = f"fell back to {step}"
        else:
            assert got[0] == 2 and step == 2
            _assert_values(got[1:], values[2])
            outcomes[name] = "harmless"
        if outcomes[name] != "harmless":
            assert not se.verify_checkpoint(case, step=2).ok, name
        shutil.rmtree(case)
    # every array's damaged chunks are caught (a flip that lands only on padding rows past the vocabulary,
    # which no lookup reads, is harmless; the values returned were checked above either way)
    for array in {n.rsplit("/", 1)[0] for n in outcomes if _is_data(n)}:
        assert any(outcomes[n] != "harmless" for n in outcomes if _is_data(n) and n.startswith(array + "/")), array
    assert outcomes["meta/metadata"] != "harmless"


def _largest_data_file(step_dir: pathlib.Path, item: str) -> pathlib.Path:
    return max((f for f in (step_dir / item).rglob("*") if f.is_file() and _is_data(f.name)),
               key=lambda f: f.stat().st_size)


def test_flipped_bytes_in_an_older_step_leave_the_latest_alone(two_steps, tmp_path):
    path, values = two_steps
    case = tmp_path / "case"
    shutil.copytree(path, case)
    _flip(_largest_data_file(case / "1", "embeddings"), "middle")
    step, tables, user = _restore(case, devices=8)  # any mesh: the checksums do not depend on it
    assert step == 2
    _assert_values((tables, user), values[2])
    with pytest.raises(se.CorruptCheckpointError, match=r"step 1\) is corrupt.*table 'items'"):
        _restore(case, step=1)
    assert not se.verify_checkpoint(case, step=1).ok and se.verify_checkpoint(case, step=2).ok


def test_readable_but_wrong_values_are_named_by_restore_convert_serving_and_verify(two_steps, tmp_path, capsys):
    """A damaged copy: step 2's array files replaced by step 1's. orbax reads them fine; the checksums do not match."""
    path, _ = two_steps
    case = tmp_path / "case"
    shutil.copytree(path, case)
    shutil.rmtree(case / "2" / "embeddings")
    shutil.copytree(case / "1" / "embeddings", case / "2" / "embeddings")
    plan = se.plan(_specs(), make_mesh(4))
    # the accumulators are equal in both steps (fresh Adagrad slots): only the tables differ
    with pytest.raises(se.CorruptCheckpointError, match=r"step 2\) is corrupt: the values of table 'items', "
                                                        r"table 'users' do not match the checksum"):
        se.restore_embeddings(plan, case / "2")
    with pytest.raises(se.CorruptCheckpointError, match="table 'items'"):
        se.convert_checkpoint(case, tmp_path / "out", devices=2)
    with pytest.raises(se.CorruptCheckpointError, match="table 'items'"):
        se.load_serving(case)
    with pytest.warns(UserWarning, match="Step 2 .* is corrupt"):
        assert _restore(case)[0] == 1
    assert cli.main(["verify", str(case)]) == 1
    out = capsys.readouterr()
    assert out.out.count("CORRUPT") == 2 and "table 'users'" in out.out
    assert "2 of 4 arrays are corrupt" in out.err
    assert cli.main(["verify", str(case), "--step", "1"]) == 0
    assert "all 4 arrays match their checksums" in capsys.readouterr().out  # items, its slot, users, the user pytree


def test_every_step_corrupt_raises(two_steps, tmp_path):
    path, _ = two_steps
    case = tmp_path / "case"
    shutil.copytree(path, case)
    for step in ("1", "2"):
        _flip(case / step / "meta" / "metadata", "middle")
    with pytest.warns(UserWarning, match="corrupt"), pytest.raises(se.CorruptCheckpointError, match="Every step"):
        _restore(case)


@pytest.mark.parametrize("fmt", ["sparse_embed/1", "sparse_embed/2"])
def test_checkpoints_of_earlier_versions_restore_exactly(tmp_path, fmt):
    """Orbax PyTree arrays (OCDBT, zstd), padded for 4 devices; format 1 has no checksums and says so."""
    plan4 = se.plan(_specs(), make_mesh(4))
    state = se.init_tables(plan4, jax.random.key(5))
    want = se.unstack_state(plan4, state)
    user = {"dense": np.full(40, 5, np.float32), "count": np.array(5, np.int32)}
    save_old(tmp_path / "ck" / "7", plan4, state, 7, fmt, user, checksum=reference_checksum)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, tables, got_user = _restore(tmp_path / "ck")
    assert step == 7 and any("without checksums" in str(w.message) for w in caught) == (fmt == "sparse_embed/1")
    _assert_values((tables, got_user), (want, user))
    v = se.verify_checkpoint(tmp_path / "ck")
    assert v.ok and v.verified == (fmt == "sparse_embed/2")
    with warnings.catch_warnings(record=True):  # format 1 warns again
        warnings.simplefilter("always")
        out = se.convert_checkpoint(tmp_path / "ck", tmp_path / "new")  # rewritten in the current format
    assert se.read_info(out).format == "sparse_embed/3"
    _assert_values(_restore(tmp_path / "new")[1:], (want, user))


def test_flipped_values_of_an_earlier_version_are_caught(tmp_path):
    plan4 = se.plan(_specs(), make_mesh(4))
    save_old(tmp_path / "ck" / "7", plan4, se.init_tables(plan4, jax.random.key(5)), 7, "sparse_embed/2",
             checksum=reference_checksum)
    arrays = tmp_path / "ck" / "7" / "embeddings"
    data = max((f for f in arrays.rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    _flip(data, "middle")
    with pytest.raises(se.CorruptCheckpointError, match=r"step 7\)"):
        se.restore_embeddings(se.plan(_specs(), make_mesh(2)), tmp_path / "ck")


def test_plain_file_is_not_a_checkpoint_directory(tmp_path, capsys):
    f = tmp_path / "weights.npy"
    np.save(f, np.zeros(3))
    with pytest.raises(se.CheckpointError, match="is a file, not a checkpoint directory"):
        se.read_info(f)
    for command in ("inspect", "verify"):
        assert cli.main([command, str(f)]) == 1
        assert "is a file, not a checkpoint directory" in capsys.readouterr().err
    assert cli.main(["verify", str(tmp_path / "missing")]) == 1


@pytest.mark.parametrize("damage", ["meta item removed", "meta file removed", "embeddings item removed"])
def test_a_step_missing_an_item_falls_back_with_a_warning_naming_it(two_steps, tmp_path, capsys, damage):
    path, values = two_steps
    case = tmp_path / "case"
    shutil.copytree(path, case)
    target = {"meta item removed": "meta", "meta file removed": "meta/metadata",
              "embeddings item removed": "embeddings"}[damage]
    victim = case / "2" / target
    shutil.rmtree(victim) if victim.is_dir() else victim.unlink()
    with pytest.warns(UserWarning, match=r"Step 2 of .* is corrupt, trying an older step: .*2"):
        step, tables, user = _restore(case)
    assert step == 1
    _assert_values((tables, user), values[1])
    with pytest.raises(se.CorruptCheckpointError, match="2"):
        _restore(case, step=2)
    for args in (["verify", str(case)], ["verify", str(case), "--step", "2"], ["verify", str(case / "2")]):
        assert cli.main(args) == 1
        out = capsys.readouterr()
        assert "CORRUPT:" in out.out and "of 0 arrays" not in out.err, (args, out)
        if damage != "embeddings item removed":
            assert "its metadata cannot be read, so none of its arrays can be checked" in out.err
    assert cli.main(["verify", str(case), "--step", "1"]) == 0


def _two_steps_with(path, user, data=None):
    plan = se.plan(_specs(), make_mesh(2))
    tables = se.init_tables(plan, jax.random.key(0))
    with se.CheckpointManager(path) as m:
        for step in (1, 2):
            m.save(step, plan, tables, user=jax.tree.map(lambda a: a * step, user),
                   data=None if data is None else {"pos": data * step})
    return plan


def test_a_bfloat16_user_leaf_is_checksummed_like_any_other(tmp_path):
    """ml_dtypes' leaves (numpy kind "V": bfloat16, float8) are checked by their bytes: a flipped byte is caught."""
    user = {"w": np.linspace(-1, 1, 64).astype(jnp.bfloat16), "f8": np.ones(8, jnp.float8_e4m3fn)}
    plan = _two_steps_with(tmp_path, user)
    info = se.read_info(tmp_path / "2")
    assert sorted(info.user_checksums) == ["f8", "w"] and "bfloat16 (64,)" in info.user_checksums["w"]
    chunk = next(p for p in (tmp_path / "2" / "user").rglob("*") if p.is_file() and "w" in str(p) and _is_data(str(p)))
    _flip(chunk, "middle")
    with se.CheckpointManager(tmp_path) as m, pytest.warns(UserWarning, match="Step 2 of .* is corrupt"):
        r = m.restore(plan, user=jax.tree.map(np.zeros_like, user))
    assert r.step == 1
    np.testing.assert_array_equal(np.asarray(r.user["w"]).view(np.uint16), user["w"].view(np.uint16))
    assert cli.main(["verify", str(tmp_path), "--step", "2"]) == 1


def test_python_number_leaves_are_checked_against_their_checksums(tmp_path):
    """A user pytree's Python numbers (an epoch, a learning rate) are checksummed when saved; a target holding
    numbers once asked for nothing, so they came back unchecked (damage read silently, and a false warning)."""
    user = {"w": np.ones(4, np.float32), "epoch": 7, "lr": 1.5}
    plan = _two_steps_with(tmp_path, user)
    with se.CheckpointManager(tmp_path) as m, warnings.catch_warnings():
        warnings.simplefilter("error")  # a clean restore: every leaf checked, nothing to warn about
        r = m.restore(plan, user=user)
    assert (r.step, int(r.user["epoch"]), float(r.user["lr"])) == (2, 14, 3.0)
    chunk = next(p for p in (tmp_path / "2" / "user").rglob("*") if p.is_file() and "epoch" in str(p)
                 and _is_data(str(p)))
    chunk.write_bytes(np.int64(9999).tobytes())
    with se.CheckpointManager(tmp_path) as m, pytest.warns(UserWarning, match="Step 2 of .* is corrupt"):
        r = m.restore(plan, user=user)
    assert (r.step, int(r.user["epoch"])) == (1, 7)


def test_a_leaf_restored_as_another_dtype_is_unchecked_not_corrupt(tmp_path):
    """float64/int64 leaves into ShapeDtypeStruct targets come back as float32/int32 (jax without x64): a cast,
    counted as unchecked, never reported as damage."""
    user = {"x": np.linspace(0, 1, 5), "count": np.array(5)}
    plan = _two_steps_with(tmp_path, user)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one), user)
    with se.CheckpointManager(tmp_path) as m, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # jax: float64 requested, float32 given; "could not be checked"
        r = m.restore(plan, user=target)
    assert r.step == 2 and int(r.user["count"]) == 10
    np.testing.assert_allclose(np.asarray(r.user["x"]), user["x"] * 2, rtol=1e-7)


@pytest.mark.parametrize("damage", ["digit", "invalid_json", "file_removed", "item_removed", "old_format"])
def test_a_damaged_input_position_falls_back_like_any_damage(tmp_path, damage):
    """The data item (the loader's position, for an exact resume) carries a CRC32, and the metadata says it was
    saved: changed, unreadable or missing, the step is corrupt (never a silent restart from another position)."""
    plan = _two_steps_with(tmp_path, {"dense": np.ones(4, np.float32)}, data=11)
    item = tmp_path / "2" / "data"
    file = item / "process_0-of-1.json"
    if damage == "digit":
        file.write_text(file.read_text().replace("22", "92"))
    elif damage == "invalid_json":
        file.write_bytes(b"{" + file.read_bytes())
    elif damage == "file_removed":
        file.unlink()
    elif damage == "item_removed":
        shutil.rmtree(item)
    else:  # a file in the format before checksums, in a step whose metadata says it has them
        file.write_text('{"pos": 92}')
    with se.CheckpointManager(tmp_path) as m, pytest.warns(UserWarning, match="Step 2 of .* is corrupt.*input "
                                                                              "position"):
        r = m.restore(plan)
    assert r.step == 1 and r.data == {"pos": 11}
    with pytest.raises(se.CorruptCheckpointError, match="input position"):
        se.CheckpointManager(tmp_path).restore(plan, step=2)
    assert not se.verify_checkpoint(tmp_path, step=2).ok and se.verify_checkpoint(tmp_path, step=1).ok


def test_numpy_scalar_leaves_round_trip_and_unsaveable_leaves_are_refused_before_writing(tmp_path):
    plan = se.plan(_specs(), make_mesh(2))
    tables = se.init_tables(plan, jax.random.key(0))
    user = {"count": np.int32(4), "lr": np.float32(0.5), "w": np.arange(3, dtype=np.float32)}
    with se.CheckpointManager(tmp_path / "a") as m:
        m.save(1, plan, tables, user=user)
    with se.CheckpointManager(tmp_path / "a") as m:
        r = m.restore(plan, user=user)  # the same pytree as the target, numpy scalars and all
    assert int(r.user["count"]) == 4 and float(r.user["lr"]) == 0.5
    np.testing.assert_array_equal(np.asarray(r.user["w"]), user["w"])
    with se.CheckpointManager(tmp_path / "b") as m:
        with pytest.raises(ValueError, match=r"The user pytree has leaves of size 0 \['e'\], which orbax cannot save"):
            m.save(1, plan, tables, user={"e": np.zeros((0, 3), np.float32), "w": user["w"]})
        for leaf, kind in [(np.bool_(True), "numpy.bool"), (1j, "builtins.complex"), (b"xy", "builtins.bytes"),
                           (object(), "builtins.object")]:
            with pytest.raises(TypeError, match=rf"leaves orbax cannot save: 'bad' \({kind}\); it saves arrays"):
                m.save(1, plan, tables, user={"bad": leaf, "w": user["w"]})
        for empty in ({}, [], ()):
            with pytest.raises(ValueError, match=r"The user pytree is empty \(.*\), which orbax cannot save; pass "
                                                 "user=None to save none"):
                m.save(1, plan, tables, user=empty)
        assert m.all_steps() == []
    assert [p.name for p in (tmp_path / "b").iterdir() if "tmp" in p.name or "staging" in p.name] == []
    with se.CheckpointManager(tmp_path / "b") as m:  # nothing left behind that a later save trips on
        assert m.save(1, plan, tables, user={"name": "run", "w": user["w"]})


@pytest.mark.parametrize("target, problem", [
    ({"w": np.ones((4, 2), np.float32), "n": 0, "s": ""}, r"'w' is \(3, 2\) in the checkpoint, \(4, 2\) in the target"),
    ({"w": np.ones((3, 2), np.float32), "n": 0, "s": "", "extra": np.ones(2)}, r"the target's leaves \['extra'\] were"),
    ({"w": np.ones((3, 2), np.float32), "s": ""}, r"its leaves \['n'\] are not in the target"),
    ({"w": 0.0, "n": 0, "s": ""}, r"'w' is \(3, 2\) in the checkpoint, \(\) in the target"),  # a Python number
    ({"v": np.ones((3, 2), np.float32), "n": 0, "s": ""},
     r"its leaves \['w'\] are not in the target; the target's leaves \['v'\] were not saved"),
])
def test_a_user_target_of_another_structure_or_shape_names_the_leaves(tmp_path, target, problem):
    """Not orbax's message from deep inside its restore, nor the saved shape handed back for another asked."""
    plan = se.plan(_specs(), make_mesh(2))
    tables = se.init_tables(plan, jax.random.key(0))
    user = {"w": np.arange(6, dtype=np.float32).reshape(3, 2), "n": 4, "s": "run"}
    with se.CheckpointManager(tmp_path) as m:
        m.save(1, plan, tables, user=user)
    with se.CheckpointManager(tmp_path) as m:
        with pytest.raises(se.CheckpointError, match="its user pytree does not match the target given: " + problem):
            m.restore(plan, user=target)
        with pytest.warns(UserWarning, match="1 leaves of the user pytree were restored with another dtype"):
            r = m.restore(plan, user={"w": np.zeros((3, 2), np.float64), "n": 0, "s": ""})  # a cast: allowed
    np.testing.assert_array_equal(np.asarray(r.user["w"]), user["w"])
    assert np.asarray(r.user["w"]).dtype == np.float64 and int(r.user["n"]) == 4 and r.user["s"] == "run"


def test_typed_prng_key_leaves_save_checksummed_and_restore(tmp_path):
    """A train state's `jax.random.key` (a typed key array: its dtype is no numpy dtype) saves with a checksum of
    its key data and restores into itself or `ShapeDtypeStruct`s of it, verified (save failed: 'KeyTy' object has no
    attribute 'kind')."""
    from sparse_embed.io.orbax_items import read_info

    plan = se.plan(_specs(), make_mesh(2))
    tables = se.init_tables(plan, jax.random.key(0))
    user = {"rng": jax.random.split(jax.random.key(3), 4), "old": jax.random.PRNGKey(5), "w": np.ones(3, np.float32)}
    with se.CheckpointManager(tmp_path) as m:
        m.save(1, plan, tables, user=user)
    assert read_info(tmp_path, 1).user_checksums["rng"].endswith(" uint32 (4, 2)")
    assert se.verify_checkpoint(tmp_path, step=1).ok
    user = jax.device_put(user, jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec()))
    structs = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), user)
    for target in (user, structs):  # (a struct without a sharding restores as numpy: the key's data, uint32)
        with se.CheckpointManager(tmp_path) as m:
            r = m.restore(plan, user=target)
        assert jax.dtypes.issubdtype(r.user["rng"].dtype, jax.dtypes.prng_key)
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(r.user["rng"])),
                                      np.asarray(jax.random.key_data(user["rng"])))
        np.testing.assert_array_equal(np.asarray(r.user["old"]), np.asarray(user["old"]))
