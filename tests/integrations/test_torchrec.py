"""TorchRec interop: tables and fused-optimizer state move both ways and training goes on as in TorchRec.

The reference is FBGEMM itself: its CPU table-batched embedding (`SplitTableBatchedEmbeddingBagsCodegen`, the
kernel under TorchRec's fused `EmbeddingBagCollection`) trains the TorchRec side, and its state is laid out under
TorchRec's keys. Where the torchrec package is installed (it requires the CUDA `fbgemm-gpu` distribution, so the
test extra cannot carry it: see pyproject.toml), the same runs through TorchRec's `DistributedModelParallel` on a
1-process gloo group, with TorchRec's own state dicts (ShardedTensors).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import textwrap
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sparse_embed as se
from conftest import importorfail, make_mesh
from sparse_embed import optimizers as opt
from sparse_embed.integrations import torchrec as tr

# TorchRec's planner and sharders warn about their own defaults (FutureWarning, UserWarning)
pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning:torchrec"),
              pytest.mark.filterwarnings("ignore::UserWarning:torchrec"),
              pytest.mark.filterwarnings("ignore:Please use DTensor instead:FutureWarning")]  # reading one here
torch = None  # set by `_torch` when a test of this file runs, not at collection (every xdist worker collects it)


@pytest.fixture(autouse=True, scope="module")
def _torch():
    global torch
    torch = importorfail("torch")
    importorfail("fbgemm_gpu")

B, N, MAX_LEN = 16, 3, 4  # batch, steps on each side, ids per sample
CONFIGS = [  # TorchRec EmbeddingBagConfigs (duck-typed): table a is read by two features
    types.SimpleNamespace(name="a", num_embeddings=40, embedding_dim=8, feature_names=["fa1", "fa2"], pooling="SUM"),
    types.SimpleNamespace(name="b", num_embeddings=23, embedding_dim=8, feature_names=["fb"], pooling="SUM"),
    types.SimpleNamespace(name="c", num_embeddings=17, embedding_dim=4, feature_names=["fc"], pooling="SUM"),
]
FEATURES = [f for c in CONFIGS for f in c.feature_names]
FUSED = {  # TorchRec's fused params (FBGEMM's names)
    "rowwise_adagrad": {"optimizer": "exact_rowwise_adagrad", "learning_rate": 0.3, "eps": 1e-3},
    "adagrad": {"optimizer": "exact_adagrad", "learning_rate": 0.2, "eps": 0.0},
    "sgd": {"optimizer": "exact_sgd", "learning_rate": 0.1},
}
# Not trained against FBGEMM: its CPU kernel (fbgemm-gpu-cpu 1.8.0) applies no weight decay in either mode
# (measured: one step's rows are those without decay); its GPU kernel applies this formula.
DECAY = {"optimizer": "EXACT_ROWWISE_ADAGRAD", "learning_rate": 0.3, "eps": 1e-3, "weight_decay": 0.05,
         "weight_decay_mode": 2}


def _plan(optimizer: opt.Optimizer, devices: int) -> se.EmbeddingPlan:
    features = tr.features_from_torchrec(CONFIGS, B, optimizer)
    return se.plan(features, make_mesh(devices), capacity=3 * B * MAX_LEN)  # a and b stack (dim 8), c alone


def _batches(seed: int, n: int) -> list[tuple[dict, dict]]:
    """`n` batches of ragged ids `{feature: (values, lengths)}` and loss cotangents `{feature: [B, dim]}`."""
    rng, dims = np.random.default_rng(seed), {f: c.embedding_dim for c in CONFIGS for f in c.feature_names}
    vocab = {f: c.num_embeddings for c in CONFIGS for f in c.feature_names}
    out = []
    for _ in range(n):
        lengths = {f: rng.integers(0, MAX_LEN + 1, B) for f in FEATURES}
        ids = {f: (rng.integers(0, vocab[f] // 2 if f == "fa2" else vocab[f], int(n.sum())), n)  # repeats
               for f, n in lengths.items()}
        out.append((ids, {f: rng.normal(size=(B, dims[f])).astype(np.float32) for f in FEATURES}))
    return out


# ------------------------------------------------------------------ the TorchRec side
class Fbgemm:
    """FBGEMM's CPU TBE with the fused optimizer; its state under TorchRec's keys (views of its buffers)."""

    def __init__(self, fused: dict):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice, SplitTableBatchedEmbeddingBagsCodegen, WeightDecayMode)

        kw = {k: v for k, v in fused.items() if k in ("learning_rate", "eps", "weight_decay")}
        if "weight_decay_mode" in fused:
            kw["weight_decay_mode"] = WeightDecayMode(fused["weight_decay_mode"])
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(c.num_embeddings, c.embedding_dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for c in CONFIGS],
            feature_table_map=[i for i, c in enumerate(CONFIGS) for _ in c.feature_names],
            optimizer=EmbOptimType[fused["optimizer"].upper()], pooling_mode=PoolingMode.SUM, **kw)

    def train(self, ids: dict, cot: dict) -> None:
        values = torch.from_numpy(np.concatenate([ids[f][0] for f in FEATURES]).astype(np.int64))
        lengths = np.concatenate([ids[f][1] for f in FEATURES])
        offsets = torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64))
        out = self.tbe(values, offsets)
        out.backward(torch.from_numpy(np.concatenate([cot[f] for f in FEATURES], axis=1)))

    def state(self) -> dict:
        names = [c.name for c in CONFIGS]
        model = {f"embedding_bags.{n}.weight": w for n, w in zip(names, self.tbe.split_embedding_weights())}
        states = self.tbe.split_optimizer_states()
        optim = {f"embedding_bags.{n}.weight": {f"{n}.momentum1": s[0]} for n, s in zip(names, states) if s}
        return {"model": model, "optim": {"state": optim, "param_groups": []}}


@pytest.fixture(scope="module")
def process_group():
    """A 1-process gloo group for TorchRec's DistributedModelParallel (in this process's memory)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class TorchRec:
    """TorchRec's EmbeddingBagCollection under DistributedModelParallel, fused optimizer from `fused`."""

    def __init__(self, fused: dict):
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

        from benchmarks.e2e_torchrec import fused_dmp

        configs = [EmbeddingBagConfig(name=c.name, num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim,
                                      feature_names=list(c.feature_names)) for c in CONFIGS]
        params = {**fused, "optimizer": EmbOptimType[fused["optimizer"].upper()]}
        if "weight_decay_mode" in params:
            from fbgemm_gpu.split_table_batched_embeddings_ops_training import WeightDecayMode

            params["weight_decay_mode"] = WeightDecayMode(params["weight_decay_mode"])
        ebc = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        self.model = fused_dmp(torch, ebc, params, [c.name for c in CONFIGS])

    def train(self, ids: dict, cot: dict) -> None:
        from torchrec import KeyedJaggedTensor

        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=FEATURES, values=torch.from_numpy(np.concatenate([ids[f][0] for f in FEATURES]).astype(np.int64)),
            lengths=torch.from_numpy(np.concatenate([ids[f][1] for f in FEATURES]).astype(np.int64)))
        out = self.model(kjt).to_dict()
        torch.autograd.backward([out[f] for f in FEATURES], [torch.from_numpy(cot[f]) for f in FEATURES])

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.model.fused_optimizer.state_dict()}


PEERS = {"fbgemm": Fbgemm, "torchrec": TorchRec}


def _peer(kind: str, fused: dict, request):
    if kind == "torchrec":
        importorfail("torchrec")
        request.getfixturevalue("process_group")
    return PEERS[kind](fused)


# ------------------------------------------------------------------ our side
@functools.lru_cache(maxsize=None)
def _train_step(plan: se.EmbeddingPlan):
    def loss(tables, batch, cot, step):
        acts = se.lookup(plan, batch, tables, step)
        return sum(jnp.sum(acts[f] * cot[f]) for f in FEATURES)

    return jax.jit(jax.grad(loss), donate_argnums=0)  # the gradient of the tables: the updated tables


def _train(plan, tables, batches, first_step):
    for i, (ids, cot) in enumerate(batches):
        tables = _train_step(plan)(tables, se.preprocess(plan, ids)[0], cot, jnp.int32(first_step + i))
    return tables


def _assert_same(plan, tables, state) -> None:
    """Our tables and accumulators against TorchRec's state, read independently of the converter."""
    ours = se.unstack_state(plan, tables)
    flat = dict(tr._leaves(state))
    for c in CONFIGS:
        want = tr._read("w", next(v for k, v in flat.items() if k.endswith(f"embedding_bags.{c.name}.weight")))
        np.testing.assert_allclose(ours[c.name]["table"], want, rtol=2e-5, atol=1e-6, err_msg=c.name)
        momentum = [v for k, v in flat.items() if k.endswith(f"{c.name}.momentum1")]
        assert len(momentum) == len(ours[c.name]) - 1, c.name  # one state for the Adagrads, none for SGD
        if momentum:
            acc = ours[c.name]["accumulator"]
            np.testing.assert_allclose(acc, tr._read("m", momentum[0]).reshape(acc.shape), rtol=2e-5, atol=1e-7)


# ------------------------------------------------------------------ the acceptance
@pytest.mark.parametrize("devices", [1, 8], ids=lambda n: f"mesh{n}")
@pytest.mark.parametrize("name", sorted(FUSED))
@pytest.mark.parametrize("kind", ["fbgemm", "torchrec"])
def test_trained_in_torchrec_converted_trains_on_as_torchrec_does(kind, name, devices, request):
    """N steps in TorchRec, converted; N more here and N more in TorchRec on the same batches agree."""
    plan = _plan(tr.optimizer_from_fused_params(FUSED[name]), devices)
    batches = _batches(0, 2 * N)
    peer = _peer(kind, FUSED[name], request)
    for ids, cot in batches[:N]:
        peer.train(ids, cot)
    tables = tr.from_torchrec(plan, peer.state())
    _assert_same(plan, tables, peer.state())
    tables = _train(plan, tables, batches[N:], N)
    for ids, cot in batches[N:]:
        peer.train(ids, cot)
    _assert_same(plan, tables, peer.state())


@pytest.mark.parametrize("devices", [1, 8], ids=lambda n: f"mesh{n}")
@pytest.mark.parametrize("name", sorted(FUSED))
@pytest.mark.parametrize("kind", ["fbgemm", "torchrec"])
def test_trained_here_written_into_torchrec_trains_on_alike(kind, name, devices, request):
    """N steps here, written into a fresh TorchRec model in place; N more on each side agree."""
    plan = _plan(tr.optimizer_from_fused_params(FUSED[name], initial_accumulator_value=0.05), devices)
    batches = _batches(1, 2 * N)
    tables = _train(plan, se.init_tables(plan, jax.random.key(3)), batches[:N], 0)
    peer = _peer(kind, FUSED[name], request)
    tr.to_torchrec(plan, tables, into=peer.state())
    _assert_same(plan, tables, peer.state())
    tables = _train(plan, tables, batches[N:], N)
    for ids, cot in batches[N:]:
        peer.train(ids, cot)
    _assert_same(plan, tables, peer.state())


def test_embedding_bag_configs_become_feature_specs():
    torchrec = importorfail("torchrec")
    configs = [torchrec.EmbeddingBagConfig(name="a", num_embeddings=40, embedding_dim=8, feature_names=["f", "g"],
                                           pooling=torchrec.PoolingType.MEAN),
               torchrec.EmbeddingBagConfig(name="b", num_embeddings=9, embedding_dim=4, feature_names=["h"])]
    features = tr.features_from_torchrec(configs, B, opt.SGD(0.1))
    assert sorted(features) == ["f", "g", "h"] and features["f"].table is features["g"].table
    assert (features["f"].table.combiner, features["h"].table.combiner) == ("mean", "sum")
    assert (features["h"].table.vocabulary_size, features["h"].table.embedding_dim) == (9, 4)
    with pytest.raises(ValueError, match="Table 'a': pooling 'none' has no sparse_embed combiner"):
        tr.features_from_torchrec([types.SimpleNamespace(name="a", num_embeddings=4, embedding_dim=4,
                                                         feature_names=["f"], pooling="NONE")], B, opt.SGD(0.1))


def test_a_feature_several_tables_read_is_one_feature_per_table_named_as_torchrec_names_it():
    """TorchRec pools a feature that tables a and b both read into two outputs, f@a and f@b; here too (it was one
    feature, f, reading whichever table came last: table a's lookups of f were dropped silently)."""
    torchrec = importorfail("torchrec")
    configs = [torchrec.EmbeddingBagConfig(name="a", num_embeddings=10, embedding_dim=4, feature_names=["f", "g"]),
               torchrec.EmbeddingBagConfig(name="b", num_embeddings=12, embedding_dim=4, feature_names=["f"])]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    features = tr.features_from_torchrec(ebc, 2, opt.SGD(0.1))
    assert {f: s.table.name for f, s in features.items()} == {"f@a": "a", "g": "a", "f@b": "b"}
    plan = se.plan(features, make_mesh(1))
    tables = tr.from_torchrec(plan, ebc.state_dict(), with_optimizer_state=False)
    f, g = (np.array([1, 9, 4]), np.array([2, 1])), (np.array([3, 0]), np.array([1, 1]))
    acts = se.lookup(plan, se.preprocess(plan, {"f@a": f, "f@b": f, "g": g})[0], tables, jnp.int32(0))
    kjt = torchrec.KeyedJaggedTensor.from_lengths_sync(keys=["f", "g"], values=torch.tensor([1, 9, 4, 3, 0]),
                                                       lengths=torch.tensor([2, 1, 1, 1]))
    theirs = ebc(kjt).to_dict()
    weights = {n: ebc.state_dict()[f"embedding_bags.{n}.weight"].numpy() for n in "ab"}
    for name, table in (("f@a", "a"), ("f@b", "b")):
        want = np.stack([weights[table][[1, 9]].sum(0), weights[table][4]])
        np.testing.assert_allclose(np.asarray(acts[name]), want, rtol=1e-6, err_msg=name)
        np.testing.assert_allclose(np.asarray(acts[name]), theirs[name].detach().numpy(), rtol=1e-6, err_msg=name)


def test_weighted_mean_and_sequence_tables_are_refused_as_they_mean_another_thing():
    """TorchRec's weighted MEAN divides by the number of ids (sparse_embed's "mean": by the weights' sum); an
    EmbeddingConfig is a sequence table: neither converts silently."""
    torchrec = importorfail("torchrec")
    mean = torchrec.EmbeddingBagConfig(name="a", num_embeddings=40, embedding_dim=8, feature_names=["f"],
                                       pooling=torchrec.PoolingType.MEAN)
    total = torchrec.EmbeddingBagConfig(name="b", num_embeddings=9, embedding_dim=4, feature_names=["h"])
    match = "Table 'a': weighted MEAN pooling means another thing in TorchRec"
    ebc = torchrec.EmbeddingBagCollection(tables=[mean, total], is_weighted=True, device=torch.device("meta"))
    for call in (lambda: tr.features_from_torchrec(ebc, B, opt.SGD(0.1)),
                 lambda: tr.features_from_torchrec([mean, total], B, opt.SGD(0.1), weighted=True)):
        with pytest.raises(ValueError, match=match):
            call()
    weighted_sum = torchrec.EmbeddingBagCollection(tables=[total], is_weighted=True, device=torch.device("meta"))
    assert tr.features_from_torchrec(weighted_sum, B, opt.SGD(0.1))["h"].table.combiner == "sum"
    unweighted = torchrec.EmbeddingBagCollection(tables=[mean, total], device=torch.device("meta"))
    assert tr.features_from_torchrec(unweighted, B, opt.SGD(0.1))["f"].table.combiner == "mean"
    sequence = torchrec.EmbeddingConfig(name="s", num_embeddings=9, embedding_dim=4, feature_names=["q"])
    with pytest.raises(ValueError, match=r"Table 's': an EmbeddingConfig .* is not pooled"):
        tr.features_from_torchrec([sequence], B, opt.SGD(0.1))
    ec = torchrec.EmbeddingCollection(tables=[sequence], device=torch.device("meta"))
    with pytest.raises(ValueError, match=r"takes an EmbeddingBagCollection .* not an EmbeddingCollection"):
        tr.features_from_torchrec(ec, B, opt.SGD(0.1))  # (was: 'EmbeddingCollection' object is not iterable)


def test_a_sharded_collection_becomes_feature_specs_and_a_model_is_refused_naming_it(request):
    """DistributedModelParallel's module, a ShardedEmbeddingBagCollection, gives the same features as the collection
    it was made of, its weighted MEAN refused alike; the DMP itself is a TypeError saying what to pass (both were
    "'...' object is not iterable")."""
    torchrec = importorfail("torchrec")
    request.getfixturevalue("process_group")
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    from benchmarks.e2e_torchrec import fused_dmp

    configs = [torchrec.EmbeddingBagConfig(name=c.name, num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim,
                                           feature_names=list(c.feature_names), pooling=torchrec.PoolingType.MEAN
                                           if c.name == "b" else torchrec.PoolingType.SUM) for c in CONFIGS]
    fused = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
    for weighted in (False, True):
        ebc = torchrec.EmbeddingBagCollection(tables=configs, is_weighted=weighted, device=torch.device("cpu"))
        dmp = fused_dmp(torch, ebc, fused, [c.name for c in CONFIGS])
        assert type(dmp.module).__name__ == "ShardedEmbeddingBagCollection"
        if weighted:
            with pytest.raises(ValueError, match="Table 'b': weighted MEAN pooling means another thing"):
                tr.features_from_torchrec(dmp.module, B, opt.SGD(0.1))
        else:
            assert tr.features_from_torchrec(dmp.module, B, opt.SGD(0.1)) == tr.features_from_torchrec(
                configs, B, opt.SGD(0.1))
    with pytest.raises(TypeError, match=r"takes an EmbeddingBagCollection \(sharded or not\) or its "
                                        r"EmbeddingBagConfigs, got a DistributedModelParallel; pass the collection"):
        tr.features_from_torchrec(dmp, B, opt.SGD(0.1))


def test_to_torchrec_then_from_torchrec_is_exact_on_another_mesh_and_stacking():
    o = opt.RowwiseAdagrad(0.1)
    plan8 = _plan(o, 8)
    state = se.init_tables(plan8, jax.random.key(0))
    state = {k: se.EmbeddingVariables(v.table, {"accumulator": v.slots["accumulator"] + jnp.arange(
        v.slots["accumulator"].shape[0], dtype=jnp.float32)[:, None]}) for k, v in state.items()}
    out = tr.to_torchrec(plan8, state)
    assert sorted(out["model"]) == [f"embedding_bags.{c.name}.weight" for c in CONFIGS]
    assert tuple(out["optim"]["state"]["embedding_bags.a.weight"]["a.momentum1"].shape) == (40,)  # row-wise: [rows]
    plan2 = se.plan(tr.features_from_torchrec(CONFIGS, B, o), make_mesh(2), stacking=None)
    back = se.unstack_state(plan2, tr.from_torchrec(plan2, out))
    for name, arrays in se.unstack_state(plan8, state).items():
        for key, a in arrays.items():
            np.testing.assert_array_equal(back[name][key], a, err_msg=f"{name}/{key}")


def test_a_dcp_checkpoint_reads_as_its_state_dict(tmp_path):
    dcp = importorfail("torch.distributed.checkpoint")
    plan = _plan(opt.Adagrad(0.1), 1)
    state = se.init_tables(plan, jax.random.key(0))
    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(tr.to_torchrec(plan, state), checkpoint_id=str(tmp_path))
    back = tr.from_torchrec(plan, tmp_path)
    for name, arrays in se.unstack_state(plan, state).items():
        for key, a in arrays.items():
            np.testing.assert_array_equal(se.unstack_state(plan, back)[name][key], a)


_ONE_OF_TWO = textwrap.dedent("""
    import sys, numpy as np, torch.distributed as dist
    rank, where = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("gloo", init_method=f"file://{where}/group", rank=rank, world_size=2)
    if rank == 0:  # converts; rank 1 does not
        import sparse_embed as se
        plan = se.plan({"fa": se.FeatureSpec("fa", se.TableSpec("a", 40, 8, optimizer=se.optimizers.SGD(0.1)), 16)})
        got = se.unstack_tables(plan, se.torchrec.from_torchrec(plan, f"{where}/ckpt"))["a"]
        assert np.array_equal(got, np.arange(320, dtype=np.float32).reshape(40, 8)), got
    dist.barrier()
""")


def test_a_dcp_checkpoint_reads_in_one_process_of_a_process_group(tmp_path):
    """from_torchrec(plan, directory) in one process of an initialized torch.distributed group (a conversion on
    rank 0 of a training job): DCP's load used the group and waited for the other processes forever."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is ... uninitialized, assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": {"embedding_bags.a.weight": torch.arange(320.0).reshape(40, 8)}},
                 checkpoint_id=str(tmp_path / "ckpt"))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", _ONE_OF_TWO, str(rank), str(tmp_path)], env=env)
             for rank in (0, 1)]
    try:
        codes = [p.wait(timeout=180) for p in procs]
    except subprocess.TimeoutExpired:
        codes = "hung"
    finally:
        for p in procs:
            p.kill()
    assert codes == [0, 0]


def test_a_dcp_checkpoint_of_a_torchrec_model_reads_as_its_live_state(tmp_path, request):
    """TorchRec's own DCP checkpoint (its ShardedTensors saved by DCP) reads as the live model's state does."""
    import torch.distributed.checkpoint as dcp

    peer = _peer("torchrec", FUSED["rowwise_adagrad"], request)
    for ids, cot in _batches(2, N):
        peer.train(ids, cot)
    dcp.save(peer.state(), checkpoint_id=str(tmp_path))
    plan = _plan(tr.optimizer_from_fused_params(FUSED["rowwise_adagrad"]), 2)
    live, saved = (se.unstack_state(plan, tr.from_torchrec(plan, x)) for x in (peer.state(), tmp_path))
    for name, arrays in live.items():
        for key, a in arrays.items():
            np.testing.assert_array_equal(saved[name][key], a, err_msg=f"{name}/{key}")


def test_torchrec_dtensor_state_reads_and_trains_on_as_torchrec_does(request):
    """TorchRec's state under output_dtensor: DTensors whose local tensor is its LocalShardsWrapper (full_tensor()
    returns the wrapper again; reading it failed with torch's '.numpy() is not supported for tensor subclasses').
    Table a COLUMN_WISE in two shards; checked against TorchRec's own lookups, converted and after N more steps."""
    importorfail("torchrec")
    request.getfixturevalue("process_group")
    import torch.distributed as dist
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
    from torchrec.distributed import DistributedModelParallel
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
    from torchrec.distributed.types import ShardingEnv

    fused = FUSED["adagrad"]
    configs = [EmbeddingBagConfig(name=c.name, num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim,
                                  feature_names=list(c.feature_names)) for c in CONFIGS]
    sharders = [EmbeddingBagCollectionSharder(fused_params={**fused, "optimizer": EmbOptimType.EXACT_ADAGRAD})]
    constraints = {c.name: ParameterConstraints(sharding_types=["column_wise" if c.name == "a" else "table_wise"],
                                                compute_kernels=["fused"], min_partition=4) for c in CONFIGS}
    ebc = EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    sharding = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"),
                                        constraints=constraints).collective_plan(ebc, sharders, dist.GroupMember.WORLD)
    model = DistributedModelParallel(ebc, env=ShardingEnv(1, 0, dist.GroupMember.WORLD, output_dtensor=True),
                                     device=torch.device("cpu"), plan=sharding, sharders=sharders)

    def theirs(ids):
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=FEATURES, values=torch.from_numpy(np.concatenate([ids[f][0] for f in FEATURES]).astype(np.int64)),
            lengths=torch.from_numpy(np.concatenate([ids[f][1] for f in FEATURES]).astype(np.int64)))
        return model(kjt).to_dict()

    def same_lookups(plan, tables, ids):
        with torch.no_grad():
            want = theirs(ids)
        got = se.lookup(plan, se.preprocess(plan, ids)[0], tables, jnp.int32(0))
        for f in FEATURES:
            np.testing.assert_allclose(np.asarray(got[f]), want[f].numpy(), rtol=2e-5, atol=1e-6, err_msg=f)

    batches = _batches(4, 2 * N + 1)
    for ids, cot in batches[:N]:
        out = theirs(ids)
        torch.autograd.backward([out[f] for f in FEATURES], [torch.from_numpy(cot[f]) for f in FEATURES])
    state = {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()}
    assert type(state["model"]["embedding_bags.a.weight"]).__name__ == "DTensor"
    plan = _plan(tr.optimizer_from_fused_params(fused), 1)
    tables = tr.from_torchrec(plan, state)
    same_lookups(plan, tables, batches[-1][0])
    tables = _train(plan, tables, batches[N:2 * N], N)
    for ids, cot in batches[N:2 * N]:
        out = theirs(ids)
        torch.autograd.backward([out[f] for f in FEATURES], [torch.from_numpy(cot[f]) for f in FEATURES])
    same_lookups(plan, tables, batches[-1][0])  # the accumulators converted too: the updates agree


# ------------------------------------------------------------------ the optimizers' math
@pytest.mark.parametrize("name", [*sorted(FUSED), "decay"])
def test_optimizers_map_both_ways(name):
    fused = DECAY if name == "decay" else FUSED[name]
    o = tr.optimizer_from_fused_params(fused)
    assert tr.optimizer_from_fused_params(tr.fused_params(o)) == o
    want = {"rowwise_adagrad": opt.RowwiseAdagrad(0.3, tr.TINY, 1e-3),
            "decay": opt.RowwiseAdagrad(0.3, tr.TINY, 1e-3, weight_decay=0.05),
            "adagrad": opt.Adagrad(0.2, tr.TINY), "sgd": opt.SGD(0.1)}[name]
    assert o == want
    assert tr.fused_params(o)["optimizer"].lower().replace("exact_", "") == want.__class__.__name__.lower().replace(
        "rowwiseadagrad", "rowwise_adagrad")


@pytest.mark.parametrize("fused, match", [
    ({"optimizer": "exact_adagrad", "learning_rate": 0.1}, "eps=1e-08"),  # FBGEMM's default eps
    ({"optimizer": "exact_rowwise_adagrad", "weight_decay": 0.1, "weight_decay_mode": 1}, "L2"),
    ({"optimizer": "exact_rowwise_adagrad", "weight_decay": 0.1, "weight_decay_mode": "COUNTER"}, "COUNTER"),
    ({"optimizer": "exact_rowwise_adagrad", "weight_decay": 0.1, "weight_decay_mode": 5}, "DECOUPLE_GLOBAL"),
    ({"optimizer": "exact_sgd", "weight_decay": 0.1}, "no weight decay"),
    ({"optimizer": "adam"}, "'adam' has no sparse_embed optimizer"),
    ({"optimizer": "exact_sgd", "gradient_clipping": True}, "gradient_clipping"),
    ({"optimizer": "exact_rowwise_adagrad", "max_norm": 0.5}, "max_norm=0.5 rescales each updated row"),
    ({"optimizer": "exact_rowwise_adagrad", "counter_based_regularization": object(),
      "global_weight_decay": object()}, "counter_based_regularization, global_weight_decay change"),
    ({"optimizer": "exact_rowwise_adagrad", "eps": None}, r"fused param eps=None is not a number"),
    ({"optimizer": "exact_sgd", "lr": "fast"}, r"fused param lr='fast' is not a number"),
    (lambda: {"optimizer": torch.optim.SGD, "lr": 0.1}, r"optimizer SGD is a torch.optim class: pass the fused"),
])
def test_fused_params_that_do_not_map_exactly_are_refused(fused, match):
    fused = fused() if callable(fused) else fused  # (torch is imported when a test runs: `_torch`)
    with pytest.raises(ValueError, match=match):
        tr.optimizer_from_fused_params(fused)
    # their neutral values (FBGEMM's defaults) convert
    neutral = {"max_norm": 0.0, "counter_based_regularization": None, "global_weight_decay": None}
    assert tr.optimizer_from_fused_params({"optimizer": "exact_rowwise_adagrad", **neutral}) == opt.RowwiseAdagrad(
        0.01, tr.TINY, 1e-8)


@pytest.mark.parametrize("optimizer, match", [
    (opt.Adam(0.1), "Adam has no FBGEMM"),
    (opt.SGD(0.1, weight_decay=0.1), "row-wise Adagrad only"),
    (opt.Adagrad(lambda step: 0.1), "schedule"),
    (opt.RowwiseAdagrad(0.1, clip_gradient=(-1, 1)), "clip_gradient"),
])
def test_our_optimizers_without_an_fbgemm_twin_are_refused(optimizer, match):
    with pytest.raises(ValueError, match=match):
        tr.fused_params(optimizer)


# ------------------------------------------------------------------ bad input
def _state(plan) -> dict:
    return tr.to_torchrec(plan, se.init_tables(plan, jax.random.key(0)))


def test_a_table_missing_a_shape_mismatch_and_missing_slots_are_named():
    plan = _plan(opt.RowwiseAdagrad(0.1), 1)
    state = _state(plan)
    del state["model"]["embedding_bags.b.weight"]
    with pytest.raises(ValueError, match="Table 'b': no 'embedding_bags.b.weight'"):
        tr.from_torchrec(plan, state)
    state = _state(plan)
    state["model"]["embedding_bags.c.weight"] = torch.zeros(18, 4)
    with pytest.raises(ValueError, match=r"Table 'c': .*shape \(18, 4\), the plan's table needs \(17, 4\)"):
        tr.from_torchrec(plan, state)
    state = _state(plan)
    state["optim"]["state"]["embedding_bags.a.weight"]["a.momentum1"] = torch.zeros(40, 8)  # Adagrad's, not row-wise
    with pytest.raises(ValueError, match=r"Table 'a': .*momentum1 has shape \(40, 8\).*needs \(40,\)"):
        tr.from_torchrec(plan, state)
    state["optim"]["state"]["embedding_bags.a.weight"]["a.momentum1"] = torch.zeros(80)  # one per column shard
    with pytest.raises(ValueError, match=r"Table 'a': .*momentum1 holds 2 row-wise accumulators per row \(80 for 40 "
                                         r"rows\): one per column shard of a COLUMN_WISE"):
        tr.from_torchrec(plan, state)
    with pytest.raises(ValueError, match="Table 'a': no .*momentum1.*fused optimizer's state_dict"):
        tr.from_torchrec(plan, {"model": _state(plan)["model"]})
    unpooled = {k.replace("embedding_bags.", "embeddings."): v for k, v in _state(plan)["model"].items()}
    with pytest.raises(ValueError, match=r"Table 'a': no 'embedding_bags.a.weight' .*embeddings.a.weight' is an "
                                         r"EmbeddingCollection's table, which from_torchrec does not read"):
        tr.from_torchrec(plan, {"model": unpooled}, with_optimizer_state=False)
    fresh = tr.from_torchrec(plan, {"model": _state(plan)["model"]}, with_optimizer_state=False)
    assert float(fresh["a_b"].slots["accumulator"][0, 0]) == pytest.approx(0.1)  # the spec's initial value


@pytest.mark.parametrize("where, value, match", [
    ("weight", float("nan"), r"Table 'c': TorchRec's model.embedding_bags.c.weight is not finite in 2 "
                             r"row\(s\), the first row 3 holding nan; fix or reset those rows"),
    ("weight", float("-inf"), r"Table 'c': .*weight is not finite in 2 row\(s\), the first row 3"),
    ("momentum", -0.5, r"Table 'c': TorchRec's .*c.momentum1 is not a finite value >= 0 \(a sum of squares\) in 2 "
                       r"row\(s\), the first row 3 holding -0.5; fix or reset"),
    ("momentum", float("nan"), r"Table 'c': .*momentum1 is not a finite value >= 0 .* the first row 3 holding nan"),
])
def test_non_finite_weights_and_negative_accumulators_are_named(where, value, match):
    """TorchRec keeps them as they are; converted, a NaN row is looked up and trained as NaN, and a negative
    accumulator makes the row's next update NaN (both were taken silently)."""
    plan = _plan(opt.RowwiseAdagrad(0.1), 1)
    state = _state(plan)
    if where == "weight":
        state["model"]["embedding_bags.c.weight"][[3, 9], 1] = value
    else:
        state["optim"]["state"]["embedding_bags.c.weight"]["c.momentum1"][[3, 9]] = value
    with pytest.raises(ValueError, match=match):
        tr.from_torchrec(plan, state)
    if where == "momentum":  # fresh slots: the weights alone are fine
        tr.from_torchrec(plan, state, with_optimizer_state=False)


def test_an_optimizer_state_for_an_sgd_table_and_an_unconvertible_optimizer_are_refused():
    state = _state(_plan(opt.Adagrad(0.1), 1))
    with pytest.raises(ValueError, match="Table 'a': .*momentum1, but its optimizer SGD keeps no state"):
        tr.from_torchrec(_plan(opt.SGD(0.1), 1), state)
    sgd = _plan(opt.SGD(0.1), 1)  # unless the optimizer state is not asked for: then it is ignored
    np.testing.assert_array_equal(se.unstack_tables(sgd, tr.from_torchrec(sgd, state, with_optimizer_state=False))[
        "a"], state["model"]["embedding_bags.a.weight"].numpy())
    with pytest.raises(FileNotFoundError, match="No DCP checkpoint at '/nonexistent/ckpt'"):
        tr.from_torchrec(sgd, "/nonexistent/ckpt")
    with tempfile.TemporaryDirectory() as where:  # torch.save's file (was: "No DCP checkpoint at ... no .metadata")
        torch.save(state["model"], os.path.join(where, "model.pt"))
        with pytest.raises(ValueError, match=r"'.*model.pt' is a file, not a DCP checkpoint's directory: pass the "
                                             r"state dict it holds \(torch.load\(path\)\)"):
            tr.from_torchrec(sgd, os.path.join(where, "model.pt"))
    adam = _plan(opt.Adam(0.1), 1)
    with pytest.raises(ValueError, match="Table 'a': its optimizer Adam has no TorchRec"):
        tr.from_torchrec(adam, state)
    with pytest.raises(ValueError, match="Table 'a': its optimizer Adam has no TorchRec"):
        tr.to_torchrec(adam, se.init_tables(adam, jax.random.key(0)))


@pytest.mark.parametrize("devices, placement", [(1, "row"), (8, "column"), (8, "table"), (8, "replicated")])
def test_to_torchrec_returns_tensors_of_its_own(devices, placement):
    """Training the returned tensors in place leaves the tables and slots as they were (they were views of the
    tables' buffers under some placements: an add_ changed the jax tables)."""
    o = opt.Adagrad(0.1)
    plan = se.plan(tr.features_from_torchrec(CONFIGS, B, o), make_mesh(devices), placement=placement)
    tables = se.init_tables(plan, jax.random.key(0))
    before = se.unstack_state(plan, tables)
    out = tr.to_torchrec(plan, tables)
    for t in [*out["model"].values(), *(x for v in out["optim"]["state"].values() for x in v.values())]:
        t.add_(1.0)
    for name, arrays in se.unstack_state(plan, tables).items():
        for key, a in arrays.items():
            np.testing.assert_array_equal(a, before[name][key], err_msg=f"{name}/{key}")
        np.testing.assert_array_equal(out["model"][f"embedding_bags.{name}.weight"].numpy(),
                                      before[name]["table"] + 1)


def test_into_integer_tensors_is_refused_before_anything_is_written():
    plan = _plan(opt.Adagrad(0.1), 1)
    into = _state(plan)
    into["optim"]["state"]["embedding_bags.c.weight"]["c.momentum1"] = torch.zeros(17, 4, dtype=torch.int32)
    kept = {k: v.clone() for k, v in into["model"].items()}
    tables = se.init_tables(plan, jax.random.key(1))
    with pytest.raises(ValueError, match=r"Table 'c': TorchRec's optim.state.embedding_bags.c.weight.c.momentum1 is "
                                         r"torch.int32, not floating point"):
        tr.to_torchrec(plan, tables, into=into)
    for k, v in kept.items():  # a and b come before c: not written either
        np.testing.assert_array_equal(into["model"][k].numpy(), v.numpy(), err_msg=k)
    into["optim"]["state"]["embedding_bags.c.weight"]["c.momentum1"] = torch.zeros(17, 4, dtype=torch.bfloat16)
    tr.to_torchrec(plan, tables, into=into)  # a narrower float: rounded, as documented
    np.testing.assert_array_equal(into["model"]["embedding_bags.a.weight"].numpy(),
                                  se.unstack_tables(plan, tables)["a"])
    import ml_dtypes  # numpy's bfloat16 (dtype kind "V") is a float too, both ways

    half = {k: np.asarray(v.float().numpy(), ml_dtypes.bfloat16) for k, v in into["model"].items()}
    tr.to_torchrec(plan, tables, into=half, with_optimizer_state=False)
    back = se.unstack_tables(plan, tr.from_torchrec(plan, half, with_optimizer_state=False))
    np.testing.assert_array_equal(back["a"], se.unstack_tables(plan, tables)["a"].astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("target", ["tensor", "numpy"])
def test_into_a_float16_target_too_narrow_for_a_value_is_refused_before_anything_is_written(target):
    """A float16 table (TorchRec's DataType.FP16) holds at most 65504: a larger value was written as inf, silently
    (TorchRec trained on with it; from_torchrec refuses it). Values that fit are written rounded, as documented."""
    plan = _plan(opt.SGD(0.1), 1)
    tables = se.init_tables(plan, jax.random.key(1))
    big = {n: np.array(a) for n, a in se.unstack_tables(plan, tables).items()}
    big["c"][3, 1] = 7e4
    tables = tr.from_torchrec(plan, {"model": {f"embedding_bags.{n}.weight": a for n, a in big.items()}})
    half = {k: np.zeros(v.shape, np.float16) for k, v in _state(plan)["model"].items()}
    into = {k: torch.from_numpy(v) for k, v in half.items()} if target == "tensor" else half
    with pytest.raises(ValueError, match=r"Table 'c': TorchRec's embedding_bags.c.weight is (torch.)?float16, too "
                                         r"narrow for 1 row\(s\) here, the first row 3 holding 70000.0 \(it would be "
                                         r"written as inf\); nothing was written"):
        tr.to_torchrec(plan, tables, into=into)
    for k, v in into.items():  # a and b come before c: not written either
        assert not np.asarray(v).any(), k
    big["c"][3, 1] = 6e4
    tables = tr.from_torchrec(plan, {"model": {f"embedding_bags.{n}.weight": a for n, a in big.items()}})
    tr.to_torchrec(plan, tables, into=into)
    for n, a in big.items():
        np.testing.assert_array_equal(np.asarray(into[f"embedding_bags.{n}.weight"]), a.astype(np.float16))


def test_meta_tensors_are_refused_both_ways():
    """A collection made on device 'meta' (to be sharded) holds no values: reading it failed with torch's 'Cannot
    copy out of meta tensor', and writing into it wrote nothing and raised nothing (the tables were lost)."""
    torchrec = importorfail("torchrec")
    configs = [torchrec.EmbeddingBagConfig(name=c.name, num_embeddings=c.num_embeddings, embedding_dim=c.embedding_dim,
                                           feature_names=list(c.feature_names)) for c in CONFIGS]
    ebc = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("meta"))
    plan = _plan(opt.SGD(0.1), 1)
    with pytest.raises(ValueError, match=r"embedding_bags.a.weight: TorchRec's tensor is on device 'meta', which "
                                         r"holds no values .*use the sharded model's state"):
        tr.from_torchrec(plan, ebc.state_dict())
    into = {**_state(plan)["model"], "embedding_bags.c.weight": ebc.state_dict()["embedding_bags.c.weight"]}
    kept = {k: v.clone() for k, v in into.items() if ".c." not in k}
    with pytest.raises(ValueError, match=r"Table 'c': TorchRec's embedding_bags.c.weight is on device 'meta', which "
                                         r"holds no values .*; nothing was written"):
        tr.to_torchrec(plan, se.init_tables(plan, jax.random.key(1)), into=into)
    for k, v in kept.items():
        np.testing.assert_array_equal(into[k].numpy(), v.numpy(), err_msg=k)


@pytest.mark.parametrize("target", ["read-only numpy", "expanded tensor", "jax array", "list"])
def test_into_targets_that_cannot_be_written_are_refused_before_anything_is_written(target):
    """Table 'c''s accumulator cannot be written in place: refused naming it, tables 'a' and 'b' (written first
    before) left as they were."""
    plan = _plan(opt.Adagrad(0.1), 1)
    into = _state(plan)
    key = "embedding_bags.c.weight"
    good = into["optim"]["state"][key]["c.momentum1"].numpy()
    into["optim"]["state"][key]["c.momentum1"] = {
        "read-only numpy": np.frombuffer(good.tobytes(), np.float32).reshape(good.shape),
        "expanded tensor": torch.zeros(1, 4).expand(*good.shape),
        "jax array": jnp.zeros(good.shape), "list": good.tolist()}[target]
    kept = {k: v.clone() for k, v in into["model"].items()}
    with pytest.raises(ValueError, match=rf"Table 'c': TorchRec's optim.state.{key}.c.momentum1 is a .*; nothing "
                                         r"was written"):
        tr.to_torchrec(plan, se.init_tables(plan, jax.random.key(1)), into=into)
    for k, v in kept.items():
        np.testing.assert_array_equal(into["model"][k].numpy(), v.numpy(), err_msg=k)

def test_two_collections_need_a_prefix_and_into_needs_every_table():
    plan = _plan(opt.SGD(0.1), 1)
    one = _state(plan)["model"]
    both = {"user_tower.ebc": one, "item_tower.ebc": {k: v + 1 for k, v in one.items()}}
    with pytest.raises(ValueError, match="several entries .* pass prefix="):
        tr.from_torchrec(plan, both)
    picked = se.unstack_tables(plan, tr.from_torchrec(plan, both, prefix="item_tower"))
    np.testing.assert_array_equal(picked["a"], one["embedding_bags.a.weight"].numpy() + 1)
    # a prefix is whole parts of the path: "sparse.ebc" is not "sparse.ebc2" (it was: ambiguous with both,
    # and ebc2's tables read silently without ebc)
    named = {**{f"sparse.ebc.{k}": v for k, v in one.items()}, **{f"sparse.ebc2.{k}": v + 1 for k, v in one.items()}}
    picked = se.unstack_tables(plan, tr.from_torchrec(plan, named, prefix="sparse.ebc"))
    np.testing.assert_array_equal(picked["a"], one["embedding_bags.a.weight"].numpy())
    with pytest.raises(ValueError, match=r"sparse.ebc.embedding_bags.a.weight: TorchRec's tensor is torch.int8, not "
                                         r"floating point \(a quantized inference table\?\)"):
        tr.from_torchrec(plan, {**named, "sparse.ebc.embedding_bags.a.weight":
                                named["sparse.ebc.embedding_bags.a.weight"].to(torch.int8)}, prefix="sparse.ebc")
    only2 = {k: v for k, v in named.items() if k.startswith("sparse.ebc2.")}
    with pytest.raises(ValueError, match=r"Table 'a': no 'embedding_bags.a.weight' in the TorchRec state \(prefix "
                                         r"'sparse.ebc'\)"):
        tr.from_torchrec(plan, only2, prefix="sparse.ebc")
    with pytest.raises(ValueError, match="Table 'c': no 'embedding_bags.c.weight' .* to write into"):
        tr.to_torchrec(plan, se.init_tables(plan, jax.random.key(0)),
                       into={k: v for k, v in one.items() if ".c." not in k})
    with pytest.raises(TypeError, match="to_torchrec writes into live tensors, and '/tmp/x' is a path"):
        tr.to_torchrec(plan, se.init_tables(plan, jax.random.key(0)), into="/tmp/x")


def test_a_prefix_picks_a_collection_with_its_optimizer_state():
    """`{"model": m.state_dict(), "optim": m.fused_optimizer.state_dict()}` of a model with two collections: the
    prefix (a module path) picks one's tables in "model." and its accumulators in "optim.state." alike."""
    plan = _plan(opt.RowwiseAdagrad(0.1), 1)
    one = _state(plan)
    plus = lambda tree, x: {k: plus(v, x) if isinstance(v, dict) else v + x for k, v in tree.items()}  # noqa: E731
    state = {"model": {f"{tower}.ebc.{k}": v + i for i, tower in enumerate(("user", "item"))
                       for k, v in one["model"].items()},
             "optim": {"state": {f"{tower}.ebc.{k}": plus(v, i) for i, tower in enumerate(("user", "item"))
                                 for k, v in one["optim"]["state"].items()}}}
    for prefix in ("item", "item.ebc"):
        got = se.unstack_state(plan, tr.from_torchrec(plan, state, prefix=prefix))
        np.testing.assert_array_equal(got["a"]["table"], one["model"]["embedding_bags.a.weight"].numpy() + 1)
        np.testing.assert_array_equal(got["a"]["accumulator"][:, 0], one["optim"]["state"][
            "embedding_bags.a.weight"]["a.momentum1"].numpy() + 1)


class _Shard(types.SimpleNamespace):
    pass


class _ShardedTensor:
    """The two attributes of torch's ShardedTensor the converter reads: its local shards and its size."""

    def __init__(self, full: np.ndarray, rows: list[tuple[int, int]]):
        self.full, self.metadata = full, None
        self.shards = [_Shard(tensor=torch.from_numpy(full[a:b].copy()),
                              metadata=types.SimpleNamespace(shard_offsets=[a, 0], shard_sizes=[b - a, full.shape[1]]))
                       for a, b in rows]

    def local_shards(self):
        return self.shards

    def size(self):
        return self.full.shape


def test_sharded_tensors_read_from_their_shards_and_a_partial_one_is_refused():
    plan = _plan(opt.SGD(0.1), 1)
    model = {k: v.numpy() for k, v in _state(plan)["model"].items()}
    sharded = {k: _ShardedTensor(v, [(0, 5), (5, v.shape[0])]) for k, v in model.items()}
    got = se.unstack_tables(plan, tr.from_torchrec(plan, sharded))
    for c in CONFIGS:
        np.testing.assert_array_equal(got[c.name], model[f"embedding_bags.{c.name}.weight"])
    sharded["embedding_bags.b.weight"] = _ShardedTensor(model["embedding_bags.b.weight"], [(0, 5)])
    with pytest.raises(ValueError, match=r"embedding_bags.b.weight: this process holds 40 of its 184 elements"):
        tr.from_torchrec(plan, sharded)


def test_into_a_process_holding_none_of_a_table_writes_the_tables_it_holds():
    """Under DistributedModelParallel over several processes, a process's fused optimizer keeps the state of the
    tables it holds shards of only (measured, TABLE_WISE over 2 gloo processes): into= refused 'no ...momentum1 to
    write into' on every process. A table with no local shard here needs none; one with a shard still does."""
    plan = _plan(opt.Adagrad(0.1), 1)
    state = _state(plan)
    model = {k: _ShardedTensor(np.zeros(tuple(v.shape), np.float32), [] if ".b." in k else [(0, 5), (5, v.shape[0])])
             for k, v in state["model"].items()}
    optim = {k: v for k, v in state["optim"]["state"].items() if ".b." not in k}
    into = {"model": model, "optim": {"state": optim}}
    tables = se.init_tables(plan, jax.random.key(1))
    tr.to_torchrec(plan, tables, into=into)
    want = se.unstack_state(plan, tables)
    for name in "ac":
        got = np.concatenate([s.tensor.numpy() for s in model[f"embedding_bags.{name}.weight"].local_shards()])
        np.testing.assert_array_equal(got, want[name]["table"], err_msg=name)
        np.testing.assert_array_equal(optim[f"embedding_bags.{name}.weight"][f"{name}.momentum1"].numpy(),
                                      want[name]["accumulator"], err_msg=name)
    model["embedding_bags.b.weight"] = _ShardedTensor(np.zeros((23, 8), np.float32), [(0, 23)])
    with pytest.raises(ValueError, match=r"Table 'b': no 'embedding_bags.b.weight.b.momentum1' in the TorchRec state "
                                         r"to write into"):
        tr.to_torchrec(plan, tables, into=into)


def test_offloaded_tables_are_refused(tmp_path):
    """An offloaded table's array is its cache (`cache_rows` rows, a cache slot's row not row i): to_torchrec
    returned the cache as TorchRec's table, silently, and from_torchrec asked for a table of cache_rows rows."""
    t = se.TableSpec("a", 40, 8, optimizer=opt.SGD(0.1), storage=se.offload.Offload(str(tmp_path / "a"), cache_rows=16))
    plan = se.plan({"fa": se.FeatureSpec("fa", t, B)}, make_mesh(1))
    match = r"Tables \['a'\] are offloaded \(storage=\): their arrays hold their caches' rows"
    with pytest.raises(ValueError, match=match):
        tr.to_torchrec(plan, se.init_tables(plan, jax.random.key(0)))
    with pytest.raises(ValueError, match=match):
        tr.from_torchrec(plan, {"embedding_bags.a.weight": torch.zeros(40, 8)})


def test_raw_id_tables_are_refused():
    t = se.TableSpec("a", 40, 8, optimizer=opt.SGD(0.1), dynamic=se.Dynamic())
    plan = se.plan({"fa": se.FeatureSpec("fa", t, B)}, make_mesh(1))
    with pytest.raises(ValueError, match="Table 'a' is keyed by raw ids"):
        tr.from_torchrec(plan, {})
