"""TorchRec interop: an `EmbeddingBagCollection`'s tables and its fused optimizer's state, in and out.

TorchRec keeps a table `t` of an `EmbeddingBagCollection` under the state
dict key `embedding_bags.t.weight` (`[num_embeddings, embedding_dim]`, a
tensor or, under `DistributedModelParallel`, a `ShardedTensor`) and its
fused (FBGEMM) optimizer's state under `state.embedding_bags.t.weight` ->
`t.momentum1` of the optimizer's `state_dict()`: `[rows]` for row-wise
Adagrad, `[rows, dim]` for Adagrad, nothing for SGD. Keys may carry the
module's path in front (`sparse.ebc.embedding_bags.t.weight`); `prefix`
picks one collection where a model has several.

    state = {"model": dmp.state_dict(), "optim": dmp.fused_optimizer.state_dict()}
    tables = se.torchrec.from_torchrec(plan, state)          # or a DCP checkpoint's directory
    se.torchrec.to_torchrec(plan, tables, into=state)        # writes TorchRec's tensors in place

The optimizers convert exactly where their math is the same
(`optimizer_from_fused_params` / `fused_params`; anything else is a
ValueError that says what differs):

| FBGEMM (`EmbOptimType`) | sparse_embed | slot |
|---|---|---|
| `EXACT_SGD` (and `SGD`) | `SGD(lr)` | none |
| `EXACT_ADAGRAD`, eps = 0 | `Adagrad(lr)` | `momentum1 [rows, dim]` <-> `accumulator [rows, dim]` |
| `EXACT_ROWWISE_ADAGRAD` | `RowwiseAdagrad(lr, epsilon=eps)` | `momentum1 [rows]` <-> `accumulator [rows, 1]` |
| ... with `WeightDecayMode.DECOUPLE` | ... `weight_decay=wd` | |

FBGEMM's Adagrad divides by `sqrt(acc) + eps` and sparse_embed's by
`sqrt(acc)` (so eps must be 0); FBGEMM's L2 weight decay adds `wd * w` to
the gradient (sparse_embed's is decoupled only). The decay maps as FBGEMM
states it and its GPU kernel applies it; its CPU kernel (fbgemm-gpu-cpu
1.8.0) applies none, in either mode (measured). FBGEMM starts its
accumulators at 0, sparse_embed's must be > 0: a converted state carries
TorchRec's accumulators (zeros included), so only rows that no converted
state covers see the spec's `initial_accumulator_value` (default here: the
smallest normal float32, which moves no update by more than rounding).

torch is not imported by this module except to read a DCP checkpoint and to
build the tensors `to_torchrec` returns; tensors are read through their
own methods, so `import sparse_embed` never needs torch.
"""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from sparse_embed.core import optimizers as opt
from sparse_embed.core.planning import EmbeddingPlan
from sparse_embed.core.relayout import TABLE_KEY
from sparse_embed.core.specs import FeatureSpec, TableSpec
from sparse_embed.core.state import EmbeddingVariables
from sparse_embed.core.tables import stack_tables, unstack_state

SLOT = "accumulator"  # sparse_embed's slot of both Adagrads; TorchRec calls it momentum1
MOMENTUM = "momentum1"
TINY = float(np.finfo(np.float32).tiny)  # FBGEMM's accumulators start at 0; ours must start > 0
_NO_DECAY, _DECOUPLED = 0, 2  # FBGEMM's WeightDecayMode values (names: _DECAY_NAMES)
_DECAY_NAMES = {0: "NONE", 1: "L2", 2: "DECOUPLE", 3: "COUNTER", 4: "COWCLIP", 5: "DECOUPLE_GLOBAL"}
_META = "use the sharded model's state (DistributedModelParallel's state_dict()) or a checkpoint"  # for 'meta'
# FBGEMM's settings that change the update (None: off) and that no sparse_embed optimizer has
_UNCONVERTED = ("counter_based_regularization", "cowclip_regularization", "global_weight_decay", "ensemble_mode",
                "emainplace_mode")


# ------------------------------------------------------------------ optimizers
def _number(params: Mapping[str, Any], names: tuple[str, ...], default: float) -> float:
    """The first of `names` in `params` as a float (else `default`); a ValueError naming it if it is no number."""
    for name in names:
        if name in params:
            try:
                return float(params[name])
            except (TypeError, ValueError):
                raise ValueError(f"TorchRec's fused param {name}={params[name]!r} is not a number.") from None
    return default


def _kind(value: Any) -> str:
    """An `EmbOptimType` (or its name or value) -> its name in lower case, e.g. "exact_rowwise_adagrad"."""
    return str(getattr(value, "name", value)).lower().replace("row_wise", "rowwise")


def _decay_mode(value: Any) -> int:
    """A `WeightDecayMode` (or its name or value) -> its int value."""
    value = getattr(value, "value", value)
    if isinstance(value, str):
        names = {v: k for k, v in _DECAY_NAMES.items()}
        if value.upper() not in names:
            raise ValueError(f"Unknown weight_decay_mode {value!r}; FBGEMM's are {sorted(names)}.")
        return names[value.upper()]
    return int(value)


def optimizer_from_fused_params(params: Mapping[str, Any], *,
                                initial_accumulator_value: float = TINY) -> opt.Optimizer:
    """TorchRec's fused optimizer settings -> the sparse_embed optimizer with the same math, or a ValueError.

    `params`: the `fused_params` of TorchRec's sharders (FBGEMM's names:
    `optimizer` an `EmbOptimType` or its name, `learning_rate`, `eps`, `weight_decay`,
    `weight_decay_mode`), or `{"optimizer": ..., "lr": ...}` as given to
    `apply_optimizer_in_backward`. Settings that do not change the math
    (cache, precision of the output, ...) are ignored.
    """
    kind = _kind(params.get("optimizer", "exact_sgd"))
    if isinstance(params.get("optimizer"), type):  # apply_optimizer_in_backward's torch.optim class
        raise ValueError(f"TorchRec's optimizer {params['optimizer'].__name__} is a torch.optim class: pass the "
                         "fused optimizer's EmbOptimType (or its name, e.g. 'exact_rowwise_adagrad').")
    lr = _number(params, ("learning_rate", "lr"), 0.01)
    eps = _number(params, ("eps",), 1e-8)  # FBGEMM's default
    wd = _number(params, ("weight_decay",), 0.0)
    mode = _decay_mode(params.get("weight_decay_mode", _NO_DECAY))
    if params.get("gradient_clipping"):
        raise ValueError("TorchRec's gradient_clipping (FBGEMM's max_gradient) clips where sparse_embed's "
                         "clip_gradient does not: not converted; train without it.")
    if float(params.get("max_norm") or 0.0) > 0.0:
        raise ValueError(f"FBGEMM's max_norm={params['max_norm']} rescales each updated row to that norm in the "
                         "update; sparse_embed has no such rule (TableSpec.max_norm clips what a lookup reads, "
                         "leaving the row as trained): not converted; train without it.")
    if unknown := sorted(k for k in _UNCONVERTED if params.get(k) is not None):
        raise ValueError(f"FBGEMM's {', '.join(unknown)} change the optimizer's math and have no sparse_embed "
                         "counterpart: not converted; train without them.")
    if kind == "exact_rowwise_adagrad":
        if wd and mode != _DECOUPLED:  # DECOUPLE_GLOBAL also decays the rows a step did not touch
            raise ValueError(f"FBGEMM's row-wise Adagrad with weight_decay_mode {_DECAY_NAMES.get(mode, mode)} has "
                             "no sparse_embed counterpart: sparse_embed decays decoupled only (w -= lr * wd * w, "
                             "FBGEMM's DECOUPLE); L2 adds wd * w to the gradient.")
        return opt.RowwiseAdagrad(lr, initial_accumulator_value, eps, weight_decay=wd)
    if wd:
        raise ValueError(f"FBGEMM's {kind} has no weight decay; weight_decay={wd} would change nothing there and "
                         "decay the rows here: leave it out.")
    if kind in ("exact_sgd", "sgd"):
        return opt.SGD(lr)
    if kind == "exact_adagrad":
        if eps != 0.0:
            raise ValueError(f"FBGEMM's Adagrad divides by sqrt(acc) + eps (eps={eps}), sparse_embed's by sqrt(acc): "
                             "they agree only with eps=0 (set it in TorchRec's fused params), or use row-wise "
                             "Adagrad (EXACT_ROWWISE_ADAGRAD <-> RowwiseAdagrad, the same math with eps).")
        return opt.Adagrad(lr, initial_accumulator_value)
    raise ValueError(f"TorchRec's fused optimizer {kind!r} has no sparse_embed optimizer with the same math; "
                     "exact_sgd, exact_adagrad (eps=0) and exact_rowwise_adagrad convert.")


def fused_params(optimizer: opt.Optimizer) -> dict[str, Any]:
    """A sparse_embed optimizer -> TorchRec's fused params with the same math (FBGEMM's names), or a ValueError.

    `optimizer` is the `EmbOptimType`'s name and `weight_decay_mode` the
    `WeightDecayMode`'s int: `EmbOptimType[p["optimizer"]]`,
    `WeightDecayMode(p["weight_decay_mode"])`. The accumulators' initial
    value is not a fused param: FBGEMM starts them at 0, so a fresh TorchRec
    table matches ours only with `initial_accumulator_value=0`, or once
    `to_torchrec` has written our accumulators into it.
    """
    name = type(optimizer).__name__
    if callable(optimizer.learning_rate):
        raise ValueError(f"{name}: a learning-rate schedule is not part of TorchRec's fused params (a scheduler sets "
                         "the fused optimizer's lr each step); convert a float learning_rate.")
    if optimizer.clip_gradient is not None or optimizer.clip_weight is not None:
        raise ValueError(f"{name}: clip_gradient/clip_weight have no FBGEMM counterpart on CPU.")
    lr, wd = optimizer.learning_rate, optimizer.weight_decay
    if type(optimizer) is opt.RowwiseAdagrad:
        return {"optimizer": "EXACT_ROWWISE_ADAGRAD", "learning_rate": lr, "eps": optimizer.epsilon,
                "weight_decay": wd, "weight_decay_mode": _DECOUPLED if wd else _NO_DECAY}
    if wd:
        raise ValueError(f"{name}: FBGEMM applies weight decay in row-wise Adagrad only; weight_decay={wd} has no "
                         "counterpart.")
    if type(optimizer) is opt.SGD:
        return {"optimizer": "EXACT_SGD", "learning_rate": lr}
    if type(optimizer) is opt.Adagrad:
        return {"optimizer": "EXACT_ADAGRAD", "learning_rate": lr, "eps": 0.0}
    raise ValueError(f"{name} has no FBGEMM optimizer with the same math; SGD, Adagrad and RowwiseAdagrad convert.")


def features_from_torchrec(configs: Any, batch_size: int, optimizer: opt.Optimizer, *,
                           initializer: Any = None, weighted: bool | None = None) -> dict[str, FeatureSpec]:
    """TorchRec `EmbeddingBagConfig`s (or the `EmbeddingBagCollection` itself, sharded or not) ->
    `{feature: FeatureSpec}`, each feature reading its config's table.

    Pooling SUM and MEAN map to the combiners "sum" and "mean"; `optimizer`
    is every table's (see `optimizer_from_fused_params`); `initializer`
    (default: the TableSpec's) matters only for tables not converted.
    `weighted`: whether the collection takes per-id weights (default: the
    collection's `is_weighted()`, False for a list of configs). Weighted
    MEAN is refused: TorchRec divides a sample's weighted sum by its number
    of ids, sparse_embed's "mean" by the sum of its weights. A feature that
    several tables read is named as TorchRec names its outputs, `f@table`
    (one FeatureSpec per table; `preprocess` takes its ids under each name).
    """
    if hasattr(configs, "embedding_configs") and not hasattr(configs, "embedding_bag_configs"):
        raise ValueError("features_from_torchrec takes an EmbeddingBagCollection (or its EmbeddingBagConfigs), not an "
                         "EmbeddingCollection: its tables are not pooled, and are not converted. Declare sequence "
                         "features as FeatureSpec(..., max_sequence_length=L).")
    if hasattr(configs, "embedding_bag_configs"):  # the EmbeddingBagCollection
        weighted = configs.is_weighted() if weighted is None else weighted
        configs = configs.embedding_bag_configs()
    elif hasattr(configs, "_embedding_bag_configs"):  # sharded (DistributedModelParallel's): no public accessor
        weighted = bool(getattr(configs, "_is_weighted", False)) if weighted is None else weighted
        configs = configs._embedding_bag_configs
    try:
        configs = list(configs)
    except TypeError:
        raise TypeError(f"features_from_torchrec takes an EmbeddingBagCollection (sharded or not) or its "
                        f"EmbeddingBagConfigs, got a {type(configs).__name__}; pass the collection inside a model "
                        "(e.g. dmp.module.ebc).") from None
    names = [f for c in configs for f in c.feature_names]
    shared = {f for f in names if names.count(f) > 1}  # TorchRec's get_embedding_names_by_table
    out = {}
    for c in configs:
        pooling = _kind(getattr(c, "pooling", "sum"))  # a PoolingType or its name
        if pooling not in ("sum", "mean"):
            raise ValueError(f"Table {c.name!r}: pooling {pooling!r} has no sparse_embed combiner (sum, mean).")
        if pooling == "mean" and weighted:
            raise ValueError(f"Table {c.name!r}: weighted MEAN pooling means another thing in TorchRec (the weighted "
                             "sum over the number of ids) than sparse_embed's 'mean' (over the sum of the weights). "
                             "Use pooling SUM with each sample's weights divided by its number of ids, which is "
                             "TorchRec's value in both.")
        if type(c).__name__ == "EmbeddingConfig":  # a sequence table: one row per id, not pooled
            raise ValueError(f"Table {c.name!r}: an EmbeddingConfig (an EmbeddingCollection's sequence table) is not "
                             "pooled; declare its features with FeatureSpec(..., max_sequence_length=L).")
        extra = {} if initializer is None else {"initializer": initializer}
        table = TableSpec(c.name, int(c.num_embeddings), int(c.embedding_dim), optimizer=optimizer,
                          combiner=pooling, **extra)
        for f in c.feature_names:
            name = f"{f}@{c.name}" if f in shared else f
            out[name] = FeatureSpec(name, table, batch_size)
    return out


# ------------------------------------------------------------------ TorchRec's state
def _leaves(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """`(dotted path, leaf)` of a nested mapping (state dicts, DCP's nested form)."""
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _leaves(v, f"{path}.{k}" if path else str(k))
    else:
        yield path, tree


def _find(leaves: Mapping[str, Any], suffix: str, table: str) -> tuple[str, Any] | None:
    """The one leaf whose path is `suffix` or ends with `.suffix`."""
    hits = [(k, v) for k, v in leaves.items() if k == suffix or k.endswith("." + suffix)]
    if len(hits) > 1:
        raise ValueError(f"Table {table!r}: several entries of the TorchRec state end with {suffix!r}: "
                         f"{sorted(k for k, _ in hits)}; pass prefix= to pick one collection.")
    return hits[0] if hits else None


def _keys(table: str) -> tuple[str, str]:
    """The key suffixes of a table's weight and of its fused optimizer's momentum."""
    weight = f"embedding_bags.{table}.weight"
    return weight, f"{weight}.{table}.{MOMENTUM}"


def _shape(leaf: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in (leaf.size() if callable(getattr(leaf, "size", None)) else np.shape(leaf)))


def _is_sharded(leaf: Any) -> bool:
    return hasattr(leaf, "local_shards") and hasattr(leaf, "metadata")  # torch's ShardedTensor


def _shard_slices(shard: Any) -> tuple[slice, ...]:
    md = shard.metadata
    return tuple(slice(int(o), int(o) + int(n)) for o, n in zip(md.shard_offsets, md.shard_sizes))


def _dtype(t: Any) -> Any:
    return t.dtype if hasattr(t, "detach") else np.asarray(t).dtype


def _floating(t: Any) -> bool:
    """Whether a tensor or array holds floating-point values (numpy: not integers or bools, so that ml_dtypes'
    bfloat16, of kind "V", counts)."""
    return t.is_floating_point() if hasattr(t, "detach") else np.asarray(t).dtype.kind not in "iub"


def _numpy(key: str, t: Any) -> np.ndarray:
    """A CPU tensor (any float dtype) or array -> float32 numpy; ValueError naming `key` for integer ones (a
    quantized inference table's codes would read as values)."""
    if not _floating(t):
        raise ValueError(f"{key}: TorchRec's tensor is {_dtype(t)}, not floating point (a quantized inference "
                         "table?); from_torchrec reads float tables and optimizer states.")
    if getattr(t, "is_meta", False):
        raise ValueError(f"{key}: TorchRec's tensor is on device 'meta', which holds no values (a collection made "
                         f"there to be sharded); {_META}.")
    if hasattr(t, "detach"):
        t = t.detach().cpu()
        t = t.float() if t.element_size() < 4 else t
        return t.numpy().astype(np.float32, copy=False)
    return np.asarray(t, np.float32)


def _local_pieces(leaf: Any) -> list[tuple[tuple[slice, ...], Any]] | None:
    """`(where, tensor)` of each shard this process holds of a ShardedTensor, or of a DTensor whose local tensor
    is TorchRec's `LocalShardsWrapper` (its state under `output_dtensor`, whose `full_tensor()` is that wrapper
    again, which numpy cannot read); None for any other leaf."""
    if _is_sharded(leaf):
        return [(_shard_slices(shard), shard.tensor) for shard in leaf.local_shards()]
    local = leaf.to_local() if hasattr(leaf, "full_tensor") else None
    if local is not None and hasattr(local, "local_offsets") and hasattr(local, "local_shards"):
        return [(tuple(slice(int(o), int(o) + int(n)) for o, n in zip(offset, t.shape)), t)
                for offset, t in zip(local.local_offsets(), local.local_shards())]
    return None


def _read(key: str, leaf: Any) -> np.ndarray:
    """A leaf of TorchRec's state -> the whole array on the host (a ShardedTensor, or TorchRec's DTensor, from
    its local shards)."""
    pieces = _local_pieces(leaf)
    if pieces is not None:
        out, covered = np.zeros(_shape(leaf), np.float32), 0
        for where, t in pieces:
            out[where] = _numpy(key, t).reshape(out[where].shape)
            covered += out[where].size
        if covered != out.size:
            kind = "ShardedTensor" if _is_sharded(leaf) else "DTensor"
            raise ValueError(f"{key}: this process holds {covered} of its {out.size} elements (a {kind} over "
                             "several processes): read a DCP checkpoint instead, or gather the tensor first.")
        return out
    if hasattr(leaf, "full_tensor"):  # a DTensor
        leaf = leaf.full_tensor()
    return _numpy(key, leaf)


def _read_dcp(path: str | os.PathLike) -> dict[str, Any]:
    """A DCP checkpoint directory -> its tensors by dotted key (plain tensors), by this process alone: with
    `no_dist`, so that a process group the caller has initialized is not used (DCP's load on one process of
    it waited for the others forever)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if os.path.isfile(path):  # torch.save's file, most likely
        raise ValueError(f"{os.fspath(path)!r} is a file, not a DCP checkpoint's directory: pass the state dict it "
                         "holds (torch.load(path)) instead.")
    if not os.path.isfile(os.path.join(path, ".metadata")):  # (torch's own error is not an Exception)
        raise FileNotFoundError(f"No DCP checkpoint at {os.fspath(path)!r} (no .metadata file there).")
    reader = dcp.FileSystemReader(os.fspath(path))
    saved = reader.read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in saved.items()
             if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "torch.distributed is disabled ..., assuming ... a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=True)
    return state


def _slot_shape(table: TableSpec) -> tuple[int, ...] | None:
    """TorchRec's momentum1 shape for a table's optimizer (None: it keeps none), or a ValueError."""
    o = table.optimizer
    if type(o) is opt.SGD:
        return None
    if type(o) is opt.RowwiseAdagrad:
        return (table.vocabulary_size,)
    if type(o) is opt.Adagrad:
        return (table.vocabulary_size, table.embedding_dim)
    raise ValueError(f"Table {table.name!r}: its optimizer {type(o).__name__} has no TorchRec (FBGEMM) counterpart "
                     "with the same state; SGD, Adagrad and RowwiseAdagrad convert.")


def _tables_of(plan: EmbeddingPlan) -> list[TableSpec]:
    if plan.tiered_tables:  # plan.tables holds their caches' specs: `cache_rows` rows, a cache slot's row not row i
        raise ValueError(f"Tables {sorted(plan.tiered_tables)} are offloaded (storage=): their arrays hold their "
                         "caches' rows (a cache slot's row, not row i) and the tables are in their stores; convert "
                         "a plan that declares them without storage= (se.offload.store_state / write_store move "
                         "a table between the two, docs/offload.md).")
    for s in plan.stacks:
        if s.dynamic is not None:
            raise ValueError(f"Table {s.first.name!r} is keyed by raw ids (dynamic=): TorchRec's "
                             "EmbeddingBagCollection holds rows by index; convert a plan of static tables.")
    return [plan.tables[n] for n in sorted(plan.tables)]


def _state_leaves(state: Any, prefix: str) -> dict[str, Any]:
    if isinstance(state, (str, os.PathLike)):
        state = _read_dcp(state)
    if not isinstance(state, Mapping):
        raise TypeError(f"The TorchRec state must be a (nested) state dict or a DCP directory, got {type(state)}.")
    # the prefix: whole parts of a key's path, at its start or anywhere (`{"model": ..., "optim": ...}` put
    # "model." and "optim.state." in front of a collection's keys); "sparse.ebc" is not "sparse.ebc2"
    p = prefix.strip(".")
    return {k: v for k, v in _leaves(state) if not p or f".{p}." in f".{k}"}


def _check_shape(table: str, key: str, got: tuple[int, ...], want: tuple[int, ...]) -> None:
    if got != want:
        raise ValueError(f"Table {table!r}: TorchRec's {key} has shape {got}, the plan's table needs {want}.")


def _quiet(fn: Callable) -> Callable:
    """Runs `fn` without torch's FutureWarning on each use of a ShardedTensor (what TorchRec's state dicts hold)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Please use DTensor instead", FutureWarning)
            return fn(*args, **kwargs)

    return wrapped


@_quiet
def from_torchrec(plan: EmbeddingPlan, state: Any, *, prefix: str = "",
                  with_optimizer_state: bool = True) -> dict[str, EmbeddingVariables]:
    """TorchRec's tables (and fused optimizer state) -> the plan's stacked, sharded state, on any mesh.

    `state`: a nested mapping holding an `EmbeddingBagCollection`'s state
    dict and, unless `with_optimizer_state=False` (fresh slots), its fused
    optimizer's `state_dict()`, e.g. `{"model": m.state_dict(), "optim":
    m.fused_optimizer.state_dict()}`; or the directory of a DCP checkpoint
    of such a mapping. Every table of the plan must be there with its
    shape, and its optimizer's state must be the one its TorchRec
    optimizer keeps (see the module docstring); other entries are ignored.
    """
    leaves = _state_leaves(state, prefix)
    arrays, slots = {}, {}
    for t in _tables_of(plan):
        weight_key, momentum_key = _keys(t.name)
        hit = _find(leaves, weight_key, t.name)
        if hit is None:
            unpooled = _find(leaves, f"embeddings.{t.name}.weight", t.name)
            raise ValueError(f"Table {t.name!r}: no {weight_key!r} in the TorchRec state (prefix {prefix!r})" + (
                f"; {unpooled[0]!r} is an EmbeddingCollection's table, which from_torchrec does not read (only an "
                "EmbeddingBagCollection's)." if unpooled is not None else "."))
        _check_shape(t.name, hit[0], _shape(hit[1]), (t.vocabulary_size, t.embedding_dim))
        arrays[t.name] = _checked(t.name, hit[0], _read(*hit))
        want, momentum = _slot_shape(t), _find(leaves, momentum_key, t.name)
        if want is None and momentum is not None and with_optimizer_state:
            raise ValueError(f"Table {t.name!r}: the TorchRec state has {momentum[0]}, but its optimizer SGD keeps "
                             "no state: was it trained with another optimizer?")
        if want is None or not with_optimizer_state:
            continue
        if momentum is None:
            raise ValueError(f"Table {t.name!r}: no {momentum_key!r} (its {type(t.optimizer).__name__} state) in the "
                             "TorchRec state; pass the fused optimizer's state_dict() too, or "
                             "with_optimizer_state=False for fresh slots.")
        got = _shape(momentum[1])
        if len(want) == 1 and len(got) == 1 and got[0] > want[0] and got[0] % want[0] == 0:
            raise ValueError(f"Table {t.name!r}: TorchRec's {momentum[0]} holds {got[0] // want[0]} row-wise "
                             f"accumulators per row ({got[0]} for {want[0]} rows): one per column shard of a "
                             "COLUMN_WISE (or TABLE_COLUMN_WISE) sharded table, which differ and do not convert into "
                             "the one a row has here. Convert it sharded otherwise, or with_optimizer_state=False.")
        _check_shape(t.name, momentum[0], got, want)
        acc = _checked(t.name, momentum[0], _read(*momentum), accumulator=True)
        slots[t.name] = {SLOT: acc.reshape(t.vocabulary_size, -1)}
    return stack_tables(plan, arrays, slots)


def _checked(table: str, key: str, a: np.ndarray, *, accumulator: bool = False) -> np.ndarray:
    """`a`, or a ValueError naming the table and its first bad row: a NaN or infinite weight (TorchRec keeps
    one as it is; it would be looked up and trained as NaN), or a negative or non-finite Adagrad accumulator
    (the next update's square root would be NaN)."""
    rows = a.reshape(a.shape[0], -1)
    bad = ~np.isfinite(rows)
    if accumulator:
        bad |= rows < 0
    if bad.any():
        which = np.flatnonzero(bad.any(axis=1))
        what = "not a finite value >= 0 (a sum of squares)" if accumulator else "not finite"
        raise ValueError(f"Table {table!r}: TorchRec's {key} is {what} in {which.size} row(s), the first row "
                         f"{int(which[0])} holding {rows[which[0]][bad[which[0]]][0]}; fix or reset those rows "
                         "before converting.")
    return a


def _check_float(table: str, key: str, leaf: Any) -> None:
    """A leaf to write a table or its slot into holds floats (an integer one would truncate them silently)."""
    for t in [shard.tensor for shard in leaf.local_shards()] if _is_sharded(leaf) else [leaf]:
        if not _floating(t):
            raise ValueError(f"Table {table!r}: TorchRec's {key} is {_dtype(t)}, not floating point; to_torchrec "
                             "writes float tables and optimizer states (an integer tensor would truncate them).")


def _check_range(table: str, key: str, leaf: Any, a: np.ndarray) -> None:
    """The finite values `a` stay finite in the leaf's dtype (a float16 target rounds a value above 65504 to
    inf, which TorchRec would then train with, and `from_torchrec` refuses)."""
    if _is_sharded(leaf) and not leaf.local_shards():
        return  # nothing of it is written here
    t = leaf.local_shards()[0].tensor if _is_sharded(leaf) else leaf
    if hasattr(t, "detach"):
        import torch

        cast = torch.from_numpy(np.ascontiguousarray(a, np.float32)).to(t.dtype).float().numpy()
    else:
        with np.errstate(over="ignore"):  # (the overflow is what is looked for)
            cast = np.asarray(a, np.float32).astype(np.asarray(t).dtype).astype(np.float32)
    rows = (np.isfinite(a) & ~np.isfinite(cast)).reshape(a.shape[0], -1)
    if rows.any():
        which = np.flatnonzero(rows.any(axis=1))
        first = a.reshape(rows.shape)[which[0]][rows[which[0]]][0]
        raise ValueError(f"Table {table!r}: TorchRec's {key} is {_dtype(t)}, too narrow for {which.size} row(s) "
                         f"here, the first row {int(which[0])} holding {first} (it would be written as inf); nothing "
                         "was written.")


def _check_writable(table: str, key: str, leaf: Any) -> None:
    """A leaf `_write` can write in place, whole: a tensor (or ShardedTensor's local shards) with no element in
    two places (an `expand`ed one), or a writable numpy array; checked before anything is written."""
    why = None
    if hasattr(leaf, "full_tensor") and not _is_sharded(leaf):
        why = "a DTensor, which is not written in place; write a ShardedTensor or plain tensor state, or save " \
              "to_torchrec(plan, tables) with DCP"
    elif _is_sharded(leaf) or hasattr(leaf, "copy_"):
        for t in [shard.tensor for shard in leaf.local_shards()] if _is_sharded(leaf) else [leaf]:
            if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
                why = "a tensor whose elements share memory (expanded): writing it would write each row many times"
            if t.is_meta:  # copy_ into one writes nothing, and raises nothing
                why = f"on device 'meta', which holds no values (a collection made there to be sharded); {_META}"
    elif isinstance(leaf, np.ndarray):
        if not leaf.flags.writeable:
            why = "a read-only numpy array (np.load(mmap_mode='r'), np.frombuffer, ...)"
    else:
        why = f"a {type(leaf).__name__}, which cannot be written in place (a torch tensor or numpy array can)"
    if why is not None:
        raise ValueError(f"Table {table!r}: TorchRec's {key} is {why}; nothing was written.")


def _write(key: str, leaf: Any, a: np.ndarray) -> None:
    """Writes `a` (the whole array) into a leaf of TorchRec's state in place (its local shards, if sharded;
    `_check_writable` first)."""
    if _is_sharded(leaf):
        for shard in leaf.local_shards():
            where = _shard_slices(shard)
            shard.tensor.detach().copy_(shard.tensor.new_tensor(a[where]))
    elif hasattr(leaf, "copy_"):
        leaf.detach().copy_(leaf.new_tensor(a))
    else:
        leaf[...] = a


@_quiet
def to_torchrec(plan: EmbeddingPlan, tables: Mapping[str, EmbeddingVariables], into: Any = None, *,
                prefix: str = "", with_optimizer_state: bool = True) -> Any:
    """The plan's state -> TorchRec's: `{"model": {key: tensor}, "optim": {"state": {key: {name: tensor}}}}`.

    The keys are an unsharded `EmbeddingBagCollection`'s and its fused
    optimizer's: "model" loads with `load_state_dict`, sharded or not; a
    fused optimizer's `load_state_dict` takes its own ShardedTensors only
    (TorchRec asserts), so save the whole with DCP and `dcp.load` it into
    the model's state, or write into that with `into`. With
    `into` (a state as `from_torchrec` reads it: live state dicts of a
    TorchRec model, plain tensors or ShardedTensors), writes into its
    tensors in place instead and returns it: every table must be there
    (a ShardedTensor's local shards; a table this process holds none of
    needs no optimizer state here).
    """
    specs = _tables_of(plan)
    natural = unstack_state(plan, tables)
    if into is None:
        import torch

        model, optim = {}, {}
        for t in specs:
            weight_key, _ = _keys(t.name)
            # copies: unstack_state's arrays may be read-only views of the tables' buffers, which torch.from_numpy
            # would hand out writable (an in-place op on the result changed the jax tables)
            model[weight_key] = torch.tensor(np.asarray(natural[t.name][TABLE_KEY], np.float32))
            want = _slot_shape(t)
            if want is not None and with_optimizer_state:
                optim[weight_key] = {f"{t.name}.{MOMENTUM}": torch.tensor(natural[t.name][SLOT].reshape(want))}
        return {"model": model, "optim": {"state": optim}}
    if isinstance(into, (str, os.PathLike)):
        raise TypeError(f"to_torchrec writes into live tensors, and {os.fspath(into)!r} is a path: a DCP checkpoint "
                        "is not written in place. Save to_torchrec(plan, tables) (or the state it wrote into) with "
                        "torch.distributed.checkpoint instead.")
    leaves, writes = _state_leaves(into, prefix), []
    for t in specs:  # every target checked before the first is written: a refusal leaves `into` as it was
        want = _slot_shape(t)
        pairs = [(TABLE_KEY, (t.vocabulary_size, t.embedding_dim), 0)]
        pairs += [(SLOT, want, 1)] if want is not None and with_optimizer_state else []
        for ours, shape, i in pairs:
            hit = _find(leaves, _keys(t.name)[i], t.name)
            if hit is None and i == 1 and _is_sharded(writes[-1][1]) and not writes[-1][1].local_shards():
                continue  # a table only other processes hold: their fused optimizers keep its state, this one none
            if hit is None:
                raise ValueError(f"Table {t.name!r}: no {_keys(t.name)[i]!r} in the TorchRec state to write into.")
            _check_shape(t.name, hit[0], _shape(hit[1]), shape)
            _check_float(t.name, *hit)
            _check_writable(t.name, *hit)
            values = natural[t.name][ours].reshape(shape)
            _check_range(t.name, *hit, values)
            writes.append((*hit, values))
    for key, leaf, values in writes:
        _write(key, leaf, values)
    return into
