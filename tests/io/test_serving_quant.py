"""int8 / int4 row-wise quantized serving tables: bytes and lookups against a plain-numpy quantization."""

from __future__ import annotations

import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
import reference as ref
from conftest import make_mesh
from sparse_embed import cli
from sparse_embed.io import quantize as q

B = 16
BITS = {"int8": 8, "int4": 4}


def np_quantize(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """The documented rounding, written out row by row: (fused bytes [n, width], dequantized float32 [n, dim])."""
    levels = np.float32(2**bits - 1)
    fused, values = [], []
    for row in np.asarray(x, np.float32):
        lo, hi = np.float32(row.min()), np.float32(row.max())
        scale = np.float32((hi - lo) / levels)
        codes = [min(max(int(np.rint((v - lo) / scale)) if scale > 0 else 0, 0), int(levels)) for v in row]
        values.append([np.float32(np.float32(c) * scale + lo) for c in codes])
        if bits == 4:
            codes = codes + [0] * (len(codes) % 2)
            codes = [codes[i] | codes[i + 1] << 4 for i in range(0, len(codes), 2)]
        fused.append(bytes(codes) + struct.pack("<ff", scale, lo))
    return np.frombuffer(b"".join(fused), np.uint8).reshape(len(fused), -1), np.asarray(values, np.float32)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dim", [1, 7, 8])
def test_quantize_bytes_and_dequantize_equal_numpy(bits, dim):
    x = np.random.default_rng(dim).normal(size=(30, dim)).astype(np.float32) * 3
    x[0] = 1.5  # a constant row: scale 0, read back exactly
    x[1, :] = np.linspace(-1, 1, dim)
    want_bytes, want = np_quantize(x, bits)
    got = q.quantize(x, bits)
    assert got.dtype == np.uint8 and got.shape == (30, q.fused_width(dim, bits))
    np.testing.assert_array_equal(got, want_bytes)
    np.testing.assert_allclose(q.dequantize(got, dim), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(jax.jit(lambda r: q.dequantize(r, dim, jnp))(got), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(want[0], x[0])
    half_step = (x.max(1) - x.min(1)) / (2**bits - 1) / 2
    assert (np.abs(want - x).max(1) <= half_step * (1 + 1e-5) + 1e-6).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_refuses_a_row_that_is_not_finite_or_spans_past_float32(bits):
    x = np.zeros((4, 3), np.float32)
    x[2, 1] = np.nan
    with pytest.raises(ValueError, match="Table 't': row 2 is not finite"):
        q.quantize(x, bits, what="Table 't'")
    with pytest.raises(ValueError, match="Table 't': raw id 12 is not finite"):  # a delta's rows: named as given
        q.quantize(x, bits, what="Table 't'", names=np.array([9, 3, 12, 40]), kind="raw id")
    x[2, 1] = 0.0
    x[1] = [-3e38, 3e38, 0.0]  # finite, but max - min overflows: its scale would be inf, its values NaN
    with pytest.raises(ValueError, match=r"Table 't': row 1 spans more than float32's range \(max - min overflows\)"):
        q.quantize(x, bits, what="Table 't'")
    x[1] = [-1.5e38, 1.5e38, 0.0]  # the widest range that still has a scale
    np.testing.assert_allclose(q.dequantize(q.quantize(x, bits), 3)[1], x[1], rtol=0, atol=float(3e38 / (2**bits - 1)))


def _features():
    """Every combiner, pooled with max_norm and as a sequence (one table each); dims 8 and 7: rows of whole 32-bit
    words (int8: 16 bytes, int4: 12) and not (int8: 15 bytes), which serving_lookup gathers differently."""
    feats = {}
    for combiner in ("sum", "mean", "sqrtn"):
        for kind, seq, max_norm, dim in (("pooled", 0, 0.5, 8), ("seq", 3, None, 7)):
            t = se.TableSpec(f"t_{combiner}_{kind}", 37 + len(combiner), dim, combiner=combiner, max_norm=max_norm)
            feats[f"f_{combiner}_{kind}"] = se.FeatureSpec(f"f_{combiner}_{kind}", t, B, max_sequence_length=seq)
    return feats


def _served(path, plan, state, dtype):
    se.export_serving(path, plan, state, dtype=dtype)
    tables, specs = se.load_serving(path)
    return tables, specs


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_lookup_equals_numpy_for_every_combiner(dtype, devices, tmp_path):
    feats = _features()
    plan = se.plan(feats, make_mesh(devices))
    state = se.init_tables(plan, jax.random.key(devices))
    floats = se.unstack_tables(plan, state)
    tables, specs = _served(tmp_path / "s", plan, state, dtype)
    serve = {n: se.FeatureSpec(n, specs[f.table.name], B, max_sequence_length=f.max_sequence_length)
             for n, f in feats.items()}
    rng = np.random.default_rng(devices)
    fn = jax.jit(lambda t, i, w: se.serving_lookup(serve, t, i, w))
    for weighted in (False, True):
        samples = {n: ref.random_samples(rng, B, f.table.vocabulary_size, 5, weighted=weighted)
                   for n, f in feats.items()}
        rendered = {n: ref.render(s, "dense") for n, s in samples.items()}
        got = fn(tables, {n: r[0] for n, r in rendered.items()}, {n: r[1] for n, r in rendered.items()})
        for name, f in feats.items():
            fused, deq = np_quantize(floats[f.table.name], BITS[dtype])
            np.testing.assert_array_equal(np.asarray(tables[f.table.name]), fused, err_msg=name)
            want = ref.lookup(deq, samples[name], combiner=f.table.combiner, seq_len=f.max_sequence_length,
                              max_norm=f.table.max_norm)
            assert got[name].dtype == jnp.float32
            np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=f"{name} weighted={weighted}")


def test_quantized_lookup_jax_export_roundtrip_and_oov_default(tmp_path):
    feats = {n: f for n, f in _features().items() if "sum" in n}
    plan = se.plan(feats, make_mesh(2))
    state = se.init_tables(plan, jax.random.key(3))
    tables, specs = _served(tmp_path / "s", plan, state, "int8")
    serve = {n: se.FeatureSpec(n, specs[f.table.name], B, max_sequence_length=f.max_sequence_length)
             for n, f in feats.items()}
    oov = {f.table.name: np.linspace(-1, 1, f.table.embedding_dim).astype(np.float32) for f in feats.values()}
    ids = {n: np.array([[1, 2, -1], [500, 3, -1]] * (B // 2), np.int32) for n in feats}  # 500: unknown
    fn = jax.jit(lambda t, i: se.serving_lookup(serve, t, i, oov=oov))
    exported = jax.export.export(fn)(tables, ids)
    got = jax.export.deserialize(exported.serialize()).call(tables, ids)
    floats = se.unstack_tables(plan, state)
    for name, f in feats.items():
        rows = np_quantize(floats[f.table.name], 8)[1].astype(np.float64)
        if f.table.max_norm is not None:  # the table's rows clipped; the default vector read as given (as lookup)
            norms = np.linalg.norm(rows, axis=1, keepdims=True)
            rows = np.where(norms > f.table.max_norm, rows * (f.table.max_norm / np.maximum(norms, 1e-30)), rows)
        deq = np.concatenate([rows, oov[f.table.name][None]])
        samples = [[(int(i) if i < f.table.vocabulary_size else len(deq) - 1, 1.0) for i in row if i != -1]
                   for row in ids[name]]
        want = ref.lookup(deq, samples, combiner="sum", seq_len=f.max_sequence_length)
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_raw_id_table_equals_numpy(dtype, tmp_path):
    table = se.TableSpec("users", 64, 5, combiner="mean", dynamic=se.Dynamic(), max_norm=0.8,
                         optimizer=se.optimizers.Adagrad(0.3))
    plan = se.plan([se.FeatureSpec("u", table, 8)], make_mesh(2))
    rng = jax.random.key(0)
    tables, maps = se.init_tables(plan, rng), se.init_id_maps(plan, rng)
    gen = np.random.default_rng(1)
    space = gen.integers(0, 2**62, 40, dtype=np.int64)
    for step in range(3):
        batch, _ = se.preprocess(plan, {"u": space[gen.integers(0, 40, (8, 3))]})
        _, tables, maps, _ = se.map_ids(plan, batch, tables, maps, step)
    se.export_serving(tmp_path / "s", plan, tables, id_maps=maps, dtype=dtype)
    served, specs = se.load_serving(tmp_path / "s")
    contents = se.raw_ids.id_table_contents(plan, tables, maps)["users"]
    np.testing.assert_array_equal(served["users"][0], contents.ids)
    fused, deq = np_quantize(contents.vectors, BITS[dtype])
    np.testing.assert_array_equal(np.asarray(served["users"][1])[: contents.ids.size], fused)
    ids = np.concatenate([space[gen.integers(0, 40, (8, 2))], np.full((8, 1), 7, np.int64)], axis=1)  # 7: unknown
    got = se.serving_lookup([se.FeatureSpec("u", specs["users"], 8)], served, {"u": ids}, oov="zero")["u"]
    deq = np.concatenate([deq, np.zeros((1, 5), np.float32)])
    pos = {int(i): k for k, i in enumerate(contents.ids)}
    samples = [[(pos.get(int(i), len(deq) - 1), 1.0) for i in row] for row in ids]
    np.testing.assert_allclose(got, ref.lookup(deq, samples, combiner="mean", max_norm=0.8), rtol=1e-5, atol=1e-6)


def test_cli_converts_a_checkpoint_to_int8_as_export_does(tmp_path, capsys):
    feats = _features()
    plan = se.plan(feats, make_mesh(2))
    state = se.init_tables(plan, jax.random.key(5))
    with se.CheckpointManager(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, plan, state)
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "s8"), "--serving", "--dtype", "int8"]) == 0
    converted, specs = se.load_serving(tmp_path / "s8")
    exported, _ = _served(tmp_path / "e8", plan, state, "int8")
    for name, a in exported.items():
        np.testing.assert_array_equal(np.asarray(converted[name]), np.asarray(a), err_msg=name)
        assert specs[name].dtype == jnp.float32  # what its lookups return
    assert se.verify_checkpoint(tmp_path / "s8").ok
    assert cli.main(["inspect", str(tmp_path / "s8")]) == 0
    with pytest.raises(ValueError, match="stored quantized .*only from the float checkpoint"):
        se.convert_checkpoint(tmp_path / "s8", tmp_path / "s4", serving=True, dtype="int4")



@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_restoring_a_quantized_serving_checkpoint_into_a_plan_says_to_load_it_for_serving(dtype, tmp_path):
    """`restore_embeddings(..., with_slots=False)` of an int8 export said "dtype is int8 in the checkpoint but
    float32 in the plan; use the checkpoint's dtype", which no TableSpec can (its dtype is a float)."""
    feats = _features()
    plan = se.plan(feats, make_mesh(2))
    se.export_serving(tmp_path / "s", plan, se.init_tables(plan, jax.random.key(5)), dtype=dtype)
    with pytest.raises(ValueError, match=rf"Table 't_mean_pooled' is quantized \({dtype}\) in the serving "
                                         r"checkpoint .*se.load_serving"):
        se.restore_embeddings(plan, tmp_path / "s", with_slots=False)

def test_cli_names_a_raw_id_tables_row_that_cannot_be_quantized_by_its_raw_id_as_export_does(tmp_path, capsys):
    """A row of a raw-id table is its raw id to the user (its row number is its place in id order): convert named
    "row 0" where export_serving names "raw id 5"."""
    users = se.TableSpec("users", 8, 3, combiner="sum", dynamic=se.Dynamic())
    plan = se.plan([se.FeatureSpec("u", users, 4)], make_mesh(1))
    key = jax.random.key(0)
    tables, maps = se.init_tables(plan, key), se.init_id_maps(plan, key)
    batch = se.preprocess(plan, {"u": np.array([[9], [5], [2**40], [7]])})[0]
    _, tables, maps, _ = se.map_ids(plan, batch, tables, maps, 0)
    stack = tables["users"]
    rows = np.asarray(stack.table).copy()
    rows[np.abs(rows).sum(1) > 0, 1] = np.nan  # every row that holds an id: the first, in id order, is id 5
    tables = {"users": stack._replace(table=jax.device_put(rows, stack.table.sharding))}
    with se.CheckpointManager(tmp_path / "ck", async_save=False) as ck:
        ck.save(1, plan, tables, id_maps=maps)
    with pytest.raises(ValueError, match=r"Table 'users': raw id 5 is not finite \(NaN or inf\)"):
        se.export_serving(tmp_path / "e", plan, tables, id_maps=maps, dtype="int8")
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "s"), "--serving", "--dtype", "int4"]) == 1
    assert "Table 'users': raw id 5 is not finite (NaN or inf)" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_bad_dtype_damaged_file_and_wrong_table_are_refused(tmp_path):
    feats = {n: f for n, f in _features().items() if "sum_pooled" in n}
    plan = se.plan(feats, make_mesh(1))
    state = se.init_tables(plan, jax.random.key(1))
    for bad in ("int3", np.float64, jnp.float8_e4m3fn, "float64", object):  # objects too: float64 was written,
        with pytest.raises(ValueError, match="Unknown dtype"):               # then failed its checksum on load
            se.export_serving(tmp_path / "bad", plan, state, dtype=bad)
        assert not (tmp_path / "bad").exists()
    se.export_serving(tmp_path / "f16", plan, state, dtype=np.float16)  # a dtype object of an offered one
    assert se.load_serving(tmp_path / "f16")[1][next(iter(feats.values())).table.name].dtype == jnp.float16
    tables, specs = _served(tmp_path / "s", plan, state, "int4")
    name = next(iter(tables))
    chunks = [p for p in (tmp_path / "s" / "embeddings").rglob("*") if p.is_file() and "/c/" in str(p)]
    assert chunks
    data = bytearray(chunks[0].read_bytes())
    data[len(data) // 2] ^= 0x10
    chunks[0].write_bytes(bytes(data))
    with pytest.raises(se.CorruptCheckpointError, match=f"table '{name}'"):
        se.load_serving(tmp_path / "s")
    serve = [se.FeatureSpec("f", specs[name], B)]
    wrong = {name: np.zeros((specs[name].vocabulary_size, 9), np.uint8)}  # neither int8 (16) nor int4 (12) rows
    with pytest.raises(ValueError, match=r"Feature 'f' .*uint8 \(40, 9\), expected a float \(40, 8\) or a quantized"):
        se.serving_lookup(serve, wrong, {"f": np.zeros((B, 1), np.int32)})
    for dtype in (np.int8, np.uint8, np.int32):  # codes of the table's width (int8 ones were read as floats, silently)
        codes = {name: np.ones((specs[name].vocabulary_size, 8), dtype)}
        with pytest.raises(ValueError, match=rf"Feature 'f' .*: the table array is {np.dtype(dtype).name} \(40, 8\), "
                                             r"expected a float \(40, 8\) or a quantized uint8 \(40, 16\) \(int8\)"):
            se.serving_lookup(serve, codes, {"f": np.zeros((B, 1), np.int32)})
