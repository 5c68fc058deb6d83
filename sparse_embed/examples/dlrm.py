"""DLRM demo: a click model with sharded embeddings, trained on synthetic data.

A hidden "teacher" (its own random embedding tables and a scoring function)
labels Zipf-skewed categorical ids plus a few dense floats with clicks. The
student is a DLRM in flax.linen: `sparse_embed.flax.linen.Embed` (the tables,
Adagrad applied inside the backward pass), a bottom MLP on the dense floats,
pairwise dot interactions and a top MLP, trained with
`sparse_embed.optax_tx(optax.adam(...))` + `sparse_embed.apply_updates` in one
jit whose in/out shardings come from a `sparse_embed.LayoutMap` (params,
optimizer state and tables donated). The teacher's AUC on the same data is
the ceiling the student can reach.

Features (all read by a stacked, sharded table set):

- ``user``:    one id per sample            (table ``user``)
- ``item``:    the candidate item, one id   (table ``item``)
- ``history``: the last ``L`` items seen, a sequence feature ``[B, L, dim]``
               that shares the ``item`` table (-1 padded)
- ``tags``:    1..k weighted tags, ragged ``(values, row_lengths)`` (table ``tag``)

Host data generation and ``sparse_embed.preprocess`` of the next batches run
in a background thread (``sparse_embed.prefetch``) while the device trains on the current one.

Run::

    python -m sparse_embed.examples.dlrm                      # all local devices
    XLA_FLAGS=--xla_force_host_platform_device_count=8 \\
        python -m sparse_embed.examples.dlrm                  # 8 simulated CPU devices
    python -m sparse_embed.examples.dlrm --checkpoint-dir /tmp/dlrm   # then: sparse-embed inspect /tmp/dlrm
    python -m sparse_embed.examples.dlrm --data day_0.txt --checkpoint-dir /tmp/c --checkpoint-every 100  # resumable
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections import deque
from typing import Any, Callable, NamedTuple, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from tqdm import tqdm

import sparse_embed as se
from sparse_embed._argtypes import COUNT, POSITIVE, POSITIVE_INT
from sparse_embed.flax import linen as sel

AXIS = "device"


# ---------------------------------------------------------------------------
# Synthetic data: Zipf ids and a hidden teacher that turns them into clicks.


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Shape of the synthetic data."""

    users: int = 100_000
    user_rows: int | None = 50_000  # raw user ids: the table's rows (fewer than users); None: static user ids
    items: int = 20_000
    tags: int = 2_000
    history_len: int = 8
    max_tags: int = 5
    num_dense: int = 4
    zipf_exponent: float = 1.1
    teacher_dim: int = 8
    signal: float = 1.5  # std of the teacher's logit: sets the label noise, so the ceiling AUC


class ZipfSampler(NamedTuple):
    """Draws ids with P(rank r) ~ 1/(r+1)^a; ranks are scattered over the id space."""

    cdf: np.ndarray  # [vocab] float64, increasing to 1
    ids_by_rank: np.ndarray  # [vocab] int64, a permutation

    @classmethod
    def create(cls, rng: np.random.Generator, vocab: int, exponent: float) -> "ZipfSampler":
        p = 1.0 / np.arange(1, vocab + 1, dtype=np.float64) ** exponent
        return cls(np.cumsum(p / p.sum()), rng.permutation(vocab))

    def __call__(self, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
        ranks = np.searchsorted(self.cdf, rng.random(shape), side="right")
        return self.ids_by_rank[np.minimum(ranks, self.cdf.size - 1)]


class Examples(NamedTuple):
    """One batch on the host. B = batch size, L = history length."""

    ids: dict[str, Any]  # feature -> ids in a `sparse_embed.preprocess` format
    weights: dict[str, Any]  # feature -> weights, same structure (tags only)
    dense: np.ndarray  # [B, num_dense] float32
    history_mask: np.ndarray  # [B, L] float32, 1 where a history position holds an item
    labels: np.ndarray  # [B] float32 clicks
    teacher_logits: np.ndarray  # [B] float32, the teacher's logit (for the ceiling AUC)


@dataclasses.dataclass(frozen=True, eq=False)
class Teacher:
    """The hidden model: random tables and a scoring function that generate the labels.

    score = (u + h + t + d) . i + b_i, where u, i, t are user, item and
    weighted-mean tag vectors, h a position-decayed mean of the history's item
    vectors, d = tanh(W dense); the logit is that score standardised, times
    `config.signal`, plus a negative offset (about a third of the samples click).
    """

    config: DataConfig
    user: np.ndarray  # [users, k]
    item: np.ndarray  # [items, k]
    item_bias: np.ndarray  # [items]
    tag: np.ndarray  # [tags, k]
    dense_proj: np.ndarray  # [num_dense, k]
    position_decay: np.ndarray  # [L]
    samplers: dict[str, ZipfSampler]
    center: float = 0.0
    scale: float = 1.0

    @classmethod
    def create(cls, config: DataConfig, seed: int) -> "Teacher":
        rng = np.random.default_rng([seed, 0])
        k, a = config.teacher_dim, config.zipf_exponent
        normal = lambda *shape: rng.normal(0.0, 1.0 / np.sqrt(k), shape).astype(np.float32)
        samplers = {name: ZipfSampler.create(rng, n, a)
                    for name, n in (("user", config.users), ("item", config.items), ("tag", config.tags))}
        t = cls(config, normal(config.users, k), normal(config.items, k),
                rng.normal(0.0, 0.5, config.items).astype(np.float32), normal(config.tags, k),
                rng.normal(0.0, 1.0, (config.num_dense, k)).astype(np.float32),
                0.75 ** np.arange(config.history_len, dtype=np.float32), samplers)
        raw = t.raw_scores(*t.draw_ids(np.random.default_rng([seed, 99]), 16_384))
        return dataclasses.replace(t, center=float(raw.mean()), scale=float(raw.std()))

    def draw_ids(self, rng: np.random.Generator, batch: int):
        """Host ids of one batch: user/item [B], history [B, L] (-1 padded), tags ragged, dense [B, F]."""
        c = self.config
        user = self.samplers["user"](rng, (batch,))
        item = self.samplers["item"](rng, (batch,))
        lengths = rng.integers(0, c.history_len + 1, batch)
        history = self.samplers["item"](rng, (batch, c.history_len))
        history[np.arange(c.history_len)[None, :] >= lengths[:, None]] = -1
        tag_lengths = rng.integers(1, c.max_tags + 1, batch)
        tag_ids = self.samplers["tag"](rng, (int(tag_lengths.sum()),))
        tag_w = rng.uniform(0.2, 1.0, tag_ids.size).astype(np.float32)
        dense = rng.normal(size=(batch, c.num_dense)).astype(np.float32)
        return user, item, history, (tag_ids, tag_w, tag_lengths), dense

    def raw_scores(self, user, item, history, tags, dense) -> np.ndarray:
        """The unscaled teacher score of each sample, `[B]`."""
        tag_ids, tag_w, tag_lengths = tags
        batch = user.size
        mask = (history >= 0).astype(np.float32)  # [B, L]
        pos_w = mask * self.position_decay[None, :]
        h = np.einsum("bl,blk->bk", pos_w, self.item[np.maximum(history, 0)])
        h /= np.maximum(pos_w.sum(1, keepdims=True), 1e-6)
        rows = np.repeat(np.arange(batch), tag_lengths)
        t = np.zeros((batch, self.config.teacher_dim), np.float32)
        np.add.at(t, rows, tag_w[:, None] * self.tag[tag_ids])
        t /= np.bincount(rows, weights=tag_w, minlength=batch)[:, None]
        d = np.tanh(dense @ self.dense_proj)
        intent = self.user[user] + h + t + d
        return np.sum(intent * self.item[item], axis=1) + self.item_bias[item]

    def logits(self, raw: np.ndarray) -> np.ndarray:
        return (self.config.signal * (raw - self.center) / self.scale - 1.0).astype(np.float32)

    def sample(self, rng: np.random.Generator, batch: int) -> Examples:
        """One labelled batch, in the formats `sparse_embed.preprocess` accepts."""
        user, item, history, tags, dense = self.draw_ids(rng, batch)
        logits = self.logits(self.raw_scores(user, item, history, tags, dense))
        labels = (rng.random(batch) < 1.0 / (1.0 + np.exp(-logits))).astype(np.float32)
        tag_ids, tag_w, tag_lengths = tags
        user = raw_user_ids(user) if self.config.user_rows else user
        ids = {"user": user, "item": item, "history": history, "tags": (tag_ids, tag_lengths)}
        weights = {"tags": (tag_w, tag_lengths)}
        return Examples(ids, weights, dense, (history >= 0).astype(np.float32), labels, logits)


def raw_user_ids(user: np.ndarray) -> np.ndarray:
    """User index -> a raw 63-bit id (a bijection: times an odd constant mod 2**63), as logs carry them."""
    with np.errstate(over="ignore"):
        return ((user.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) & np.uint64(2**63 - 1)).astype(np.int64)


# ---------------------------------------------------------------------------
# The student: sparse_embed tables + a DLRM-style head.


def feature_specs(config: DataConfig, batch_size: int, dim: int, optimizer: se.optimizers.Optimizer,
                  init_std: float):
    """Three tables, four features; `history` shares `item`. The user table is keyed by raw ids (LRU over
    `user_rows` rows) unless `config.user_rows` is None; the static tables are stacked into one."""
    init = se.initializers.truncated_normal(init_std)
    table = lambda name, vocab, dynamic=None: se.TableSpec(name, vocab, dim, init, optimizer, combiner="mean",
                                                          dynamic=dynamic)
    user = table("user", config.user_rows, se.Dynamic()) if config.user_rows else table("user", config.users)
    item, tag = table("item", config.items), table("tag", config.tags)
    return {
        "user": se.FeatureSpec("user", user, batch_size),
        "item": se.FeatureSpec("item", item, batch_size),
        "history": se.FeatureSpec("history", item, batch_size, max_sequence_length=config.history_len),
        "tags": se.FeatureSpec("tags", tag, batch_size),
    }


class DLRM(nn.Module):
    """Embeddings + dense floats -> click logit `[B]`.

    The history `[B, L, dim]` is pooled with learned per-position weights
    (softmax over the valid positions); the dense floats go through a bottom
    MLP; the pairwise dot products of the five `[B, dim]` vectors and the
    vectors themselves feed the top MLP.
    """

    plan: se.EmbeddingPlan
    top: Sequence[int] = (64, 32)

    @nn.compact
    def __call__(self, sparse, dense: jax.Array, history_mask: jax.Array, step=None) -> jax.Array:
        acts = sel.Embed(self.plan, name="embed")(sparse, step)  # {feature: [B, dim] or [B, L, dim]}
        dim = acts["user"].shape[-1]
        position_logits = self.param("position_logits", nn.initializers.zeros, (history_mask.shape[1],))
        w = jnp.exp(position_logits)[None, :] * history_mask  # [B, L]
        w = w / jnp.maximum(w.sum(axis=1, keepdims=True), 1e-6)
        history = jnp.einsum("bl,bld->bd", w, acts["history"])
        bottom = nn.Dense(dim, name="bottom_1")(nn.relu(nn.Dense(2 * dim, name="bottom_0")(dense)))
        vectors = jnp.stack([acts["user"], acts["item"], acts["tags"], history, bottom], axis=1)
        i, j = np.triu_indices(vectors.shape[1], k=1)
        dots = jnp.einsum("bid,bjd->bij", vectors, vectors)[:, i, j]  # [B, 10]
        x = jnp.concatenate([vectors.reshape(vectors.shape[0], -1), dots, dense], axis=1)
        for k, width in enumerate(self.top):
            x = nn.relu(nn.Dense(width, name=f"top_{k}")(x))
        return nn.Dense(1, name="out")(x)[:, 0]


# Sharding rules for the dense params (first match wins; unmatched: replicated). The
# tables always get the plan's row sharding. The first top layer is split over the
# devices by output column, to show a model-parallel dense layer next to the tables.
LAYOUT_RULES = [(r"top_0/kernel$", P(None, AXIS)), (r"top_0/bias$", P(AXIS))]


class DenseInputs(NamedTuple):
    """The non-embedding inputs of a batch, on device (sharded over the batch)."""

    dense: jax.Array  # [B, num_dense]
    history_mask: jax.Array  # [B, L]
    labels: jax.Array  # [B]


class Batch(NamedTuple):
    """A batch ready for the device step, plus its host labels/teacher logits for AUC."""

    sparse: dict[str, se.ShardedCooMatrix]
    inputs: DenseInputs
    labels: np.ndarray  # [B]
    teacher_logits: np.ndarray  # [B]
    stats: se.Stats  # what preprocess saw (ids per partition, capacity, drops)


def with_rows(plan: se.EmbeddingPlan, params, id_maps, sparse, step, *, train: bool):
    """Maps a batch's raw user ids to rows (`se.map_ids`); in training, new ids' rows are initialised."""
    if not id_maps:
        return sparse, params, id_maps
    sparse, tables, id_maps, _ = se.map_ids(plan, sparse, params["embed"]["tables"], id_maps, step, train=train)
    return sparse, {**params, "embed": {**params["embed"], "tables": tables}}, id_maps


def make_predict(model: DLRM) -> Callable:
    """`predict(params, id_maps, sparse, inputs) -> logits [B]` (jitted; a plain forward, nothing updated)."""

    def predict(params, id_maps, sparse, inputs):
        sparse = with_rows(model.plan, params, id_maps, sparse, 0, train=False)[0]
        return model.apply({"params": params}, sparse, inputs.dense, inputs.history_mask)

    return jax.jit(predict)


def make_train_step(model: DLRM, tx: optax.GradientTransformation, shardings: "Shardings") -> Callable:
    """`train_step(params, opt_state, id_maps, sparse, inputs, step) -> (params, opt_state, id_maps, loss)`.

    One jit, in/out shardings from the LayoutMap; params (tables included),
    the raw-id maps and the optimizer state are donated, so the tables are
    updated in place.
    """

    def loss_fn(params, sparse, inputs: DenseInputs, step) -> jax.Array:
        logits = model.apply({"params": params}, sparse, inputs.dense, inputs.history_mask, step)
        return optax.sigmoid_binary_cross_entropy(logits, inputs.labels).mean()

    def train_step(params, opt_state, id_maps, sparse, inputs: DenseInputs, step):
        sparse, params, id_maps = with_rows(model.plan, params, id_maps, sparse, step, train=True)
        # The "gradient" of the tables is the updated tables (Adagrad already applied);
        # optax_tx passes it through and apply_updates swaps it in exactly.
        loss, grads = jax.value_and_grad(loss_fn)(params, sparse, inputs, step)
        updates, opt_state = tx.update(grads, opt_state, params)
        return se.apply_updates(params, updates), opt_state, id_maps, loss

    return jax.jit(train_step, donate_argnums=(0, 1, 2),
                   in_shardings=(shardings.params, shardings.opt_state, shardings.batch, shardings.batch,
                                 shardings.batch, shardings.replicated),
                   out_shardings=(shardings.params, shardings.opt_state, shardings.batch, shardings.replicated))


class Shardings(NamedTuple):
    """Where every input and output of the train step lives."""

    params: Any
    opt_state: Any
    batch: NamedSharding  # leading (batch/device) axis over the mesh
    replicated: NamedSharding


# ---------------------------------------------------------------------------
# Host pipeline: generate + preprocess in a background thread.


def to_batch(plan: se.EmbeddingPlan, ex: Any, sparse: dict, stats: se.Stats) -> Batch:
    """A sampled example with its preprocessed ids: dense inputs sharded over the batch."""
    if any(stats.dropped_ids.values()):  # cannot happen with auto capacity; never drop silently
        raise RuntimeError(f"preprocess dropped ids: {stats.dropped_ids}")
    sharding = NamedSharding(plan.mesh, P(plan.axis_name))
    inputs = jax.device_put(DenseInputs(ex.dense, ex.history_mask, ex.labels), sharding)
    return Batch(sparse, inputs, ex.labels, ex.teacher_logits, stats)


def make_batch(teacher: Teacher, plan: se.EmbeddingPlan, batch_size: int, rng: np.random.Generator) -> Batch:
    """Samples a batch and preprocesses it for the device (COO per stack, dense inputs sharded)."""
    ex = teacher.sample(rng, batch_size)
    return to_batch(plan, ex, *se.preprocess(plan, ex.ids, ex.weights))


# ---------------------------------------------------------------------------
# Metrics.


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC from ranks (Mann-Whitney U, ties get their average rank). `[N]` each."""
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, np.float64).ravel()
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0  # 1-based average rank of each distinct score
    rank_sum = avg_rank[inverse][labels].sum()
    return float((rank_sum - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def score(predict: Callable, params, id_maps, batches: Sequence[Batch]) -> tuple[float, float]:
    """(model AUC, teacher AUC) over the examples of `batches`."""
    logits = [np.asarray(predict(params, id_maps, b.sparse, b.inputs)) for b in batches]
    labels = np.concatenate([b.labels for b in batches])
    teacher = np.concatenate([b.teacher_logits for b in batches])
    return auc(labels, np.concatenate(logits)), auc(labels, teacher)


# ---------------------------------------------------------------------------
# Driver.


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The command line; checks that the batch splits evenly over the devices."""
    p = argparse.ArgumentParser(prog="python -m sparse_embed.examples.dlrm", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=POSITIVE_INT, default=8000, help="training steps")
    p.add_argument("--batch-size", type=POSITIVE_INT, default=1024, help="global batch; must divide by the device count")
    p.add_argument("--seed", type=COUNT, default=0, help="seeds the teacher, the data and the model")
    p.add_argument("--eval-batches", type=POSITIVE_INT, default=16,
                   help="held-out batches for eval AUC (and as many recent training batches for train AUC)")
    p.add_argument("--embedding-dim", type=POSITIVE_INT, default=16, help="width of every table's rows")
    p.add_argument("--embedding-lr", type=POSITIVE, default=0.05, help="Adagrad learning rate of the tables")
    # The loss is a batch mean, so a row's gradient is ~1/batch: an initial accumulator of
    # 0.1 (the Adagrad default) would dwarf g*g and leave rarely seen rows almost frozen.
    p.add_argument("--embedding-init-acc", type=POSITIVE, default=1e-6,
                   help="Adagrad initial accumulator of the tables (small: the loss is a batch mean)")
    # Small initial rows: an id never seen in training then contributes ~nothing, not noise.
    p.add_argument("--embedding-init-std", type=POSITIVE, default=0.02, help="stddev of the initial rows")
    p.add_argument("--dense-lr", type=POSITIVE, default=2e-3, help="Adam learning rate of the MLP head")
    p.add_argument("--users", type=POSITIVE_INT, default=DataConfig.users, help="user vocabulary")
    p.add_argument("--user-rows", type=POSITIVE_INT, default=DataConfig.user_rows,
                   help="rows of the user table, keyed by raw 63-bit user ids (admission, LRU eviction)")
    p.add_argument("--static-user-ids", action="store_true",
                   help="user ids are rows of a [users, dim] table instead (the comparison run)")
    p.add_argument("--items", type=POSITIVE_INT, default=DataConfig.items, help="item vocabulary")
    p.add_argument("--tags", type=POSITIVE_INT, default=DataConfig.tags, help="tag vocabulary")
    p.add_argument("--log-every", type=POSITIVE_INT, default=20, help="steps between progress-bar updates")
    p.add_argument("--checkpoint-dir", help="save the trained state here (sparse_embed.CheckpointManager); "
                   "inspect it with `sparse-embed inspect DIR`")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    from sparse_embed.examples import criteo_dlrm  # (imports this module: here, not at the top)

    criteo_dlrm.add_arguments(p)
    args = p.parse_args(argv)
    n = len(jax.devices())
    if args.batch_size % n:
        p.error(f"--batch-size {args.batch_size} must divide by the {n} devices")
    if args.checkpoint_every and not (args.data and args.checkpoint_dir):
        p.error("--checkpoint-every saves a --data run into --checkpoint-dir: give both (the synthetic demo saves "
                "once, at the end, into --checkpoint-dir)")
    return args


class Result(NamedTuple):
    """What training produced."""

    params: Any  # {"embed": {"tables": {stack: EmbeddingVariables}}, dense layers...}
    id_maps: dict  # the raw user ids' map ({} with static user ids)
    losses: list[float]  # one per step
    recent: list[Batch]  # the last `eval_batches` training batches (for train AUC)
    stats: se.Stats  # preprocess stats merged over all training batches
    seconds: float  # wall time of the loop


def train(args: argparse.Namespace, plan: se.EmbeddingPlan, teacher: Teacher, model: DLRM,
          params: Any, id_maps: dict, layout: se.LayoutMap) -> Result:
    """The training loop: a prefetch thread makes batches while the device steps.

    Losses are fetched every `log_every` steps only, so the host never waits
    for the device in between (dispatch stays asynchronous).
    """
    tx = se.optax_tx(optax.adam(args.dense_lr))  # adam on dense leaves; tables pass through
    opt_sharding = layout.shardings(jax.eval_shape(tx.init, params))
    opt_state = jax.jit(tx.init, out_shardings=opt_sharding)(params)
    shardings = Shardings(layout.shardings(params), opt_sharding, plan.batch_sharding(),
                          NamedSharding(plan.mesh, P()))
    train_step = make_train_step(model, tx, shardings)
    examples = (teacher.sample(np.random.default_rng([args.seed, 1, i]), args.batch_size) for i in range(args.steps))
    losses, pending, recent, stats = [], [], deque(maxlen=args.eval_batches), None
    bar = tqdm(total=args.steps, unit="step", disable=args.no_progress, dynamic_ncols=True)
    start = t_log = time.perf_counter()
    # Sampling and preprocessing of the next batches run on a background thread while the device steps.
    with se.prefetch(plan, examples, inputs=lambda ex: (ex.ids, ex.weights)) as prefetched:
        for step, (sparse, batch_stats, ex) in enumerate(prefetched):
            batch = to_batch(plan, ex, sparse, batch_stats)
            params, opt_state, id_maps, loss = train_step(params, opt_state, id_maps, batch.sparse, batch.inputs,
                                                          jnp.asarray(step, jnp.int32))
            pending.append(loss)
            recent.append(batch)
            stats = batch.stats if stats is None else stats.merge(batch.stats)
            if len(pending) == args.log_every or step == args.steps - 1:
                losses += [float(x) for x in jax.device_get(pending)]
                now = time.perf_counter()
                bar.set_postfix(loss=f"{np.mean(losses[-len(pending):]):.4f}",
                                ex_s=f"{len(pending) * args.batch_size / (now - t_log):,.0f}")
                bar.update(len(pending))
                pending, t_log = [], now
    bar.close()
    return Result(params, id_maps, losses, list(recent), stats, time.perf_counter() - start)


def build(args: argparse.Namespace):
    """Teacher, plan, model, its sharded params (tables included), the layout and the eval batches."""
    config = DataConfig(users=args.users, items=args.items, tags=args.tags,
                        user_rows=None if args.static_user_ids else args.user_rows)
    teacher = Teacher.create(config, args.seed)
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    optimizer = se.optimizers.Adagrad(args.embedding_lr, initial_accumulator_value=args.embedding_init_acc)
    features = feature_specs(config, args.batch_size, args.embedding_dim, optimizer, args.embedding_init_std)
    plan = se.plan(features, mesh)  # the three tables share dim/optimizer/combiner: one stack
    eval_batches = [make_batch(teacher, plan, args.batch_size, np.random.default_rng([args.seed, 2, i]))
                    for i in range(args.eval_batches)]
    model = DLRM(plan)
    key = jax.random.key(args.seed)
    id_maps = se.init_id_maps(plan, key)  # {} without raw-id tables
    first = eval_batches[0]
    sparse = with_rows(plan, {"embed": {"tables": se.init_tables(plan, key)}}, id_maps, first.sparse, 0,
                       train=False)[0]  # init needs batches of rows
    init = lambda key: model.init(key, sparse, first.inputs.dense, first.inputs.history_mask)["params"]
    layout = se.LayoutMap(mesh, LAYOUT_RULES, plan=plan)
    params = jax.jit(init, out_shardings=layout.shardings(jax.eval_shape(init, key)))(key)
    return teacher, plan, model, params, id_maps, layout, eval_batches


def save_checkpoint(directory: str, plan: se.EmbeddingPlan, params: Any, id_maps: dict, step: int) -> None:
    """Saves the tables and raw-id maps (mesh-independent) and the dense params, and waits for the write."""
    dense = {k: v for k, v in params.items() if k != "embed"}
    with se.CheckpointManager(directory) as manager:
        if not manager.save(step, plan, params["embed"]["tables"], id_maps=id_maps or None, user=dense):
            raise SystemExit(f"{directory} already holds a checkpoint of step {step}, left as it was: use another "
                             "--checkpoint-dir, or remove it.")
        manager.wait()
    print(f"checkpoint of step {step} saved in {directory} (inspect: sparse-embed inspect {directory})")


def loss_curve(losses: Sequence[float], points: int = 8) -> str:
    """`"0.634 0.561 ..."`: mean loss over `points` equal stretches of training."""
    chunks = np.array_split(np.asarray(losses), min(points, len(losses)))
    return " ".join(f"{c.mean():.4f}" for c in chunks)


def describe_kernels(plan: se.EmbeddingPlan) -> str:
    """Which code runs the lookup and the preprocessing, and why not the native one where it does not.

    Run from a source tree that was `pip install`ed without `-e`, Python imports that tree (with no compiled
    extensions) ahead of the installed copy: this line says so instead of silently training on numpy and XLA.
    """
    from sparse_embed.core import kernels
    from sparse_embed.host import native as host_native

    used = {s.name: kernels.for_stack(plan, s) for s in plan.stacks}
    line = (f"lookup kernel: {', '.join(sorted({k.name for k in used.values()}))}; preprocessing: "
            f"{'C extension' if host_native.extension() is not None else 'numpy'}")
    why = sorted({kernels.NATIVE.unsupported(s) for s in plan.stacks if used[s.name] is not kernels.NATIVE} - {None})
    return line + (f" (not native: {'; '.join(why)})" if why and jax.default_backend() == "cpu" else "")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Trains the student on teacher-labelled data; prints and returns losses and AUCs."""
    args = parse_args(argv)
    if args.data:  # Criteo-format files instead of the teacher (examples/criteo_dlrm.py)
        from sparse_embed.examples import criteo_dlrm

        return criteo_dlrm.main(args)
    if args.checkpoint_dir and os.path.isdir(os.path.join(args.checkpoint_dir, str(args.steps))):
        raise SystemExit(f"{args.checkpoint_dir} already holds a checkpoint of step {args.steps}: use another "
                         "--checkpoint-dir, or remove it.")  # before training, not after (save_checkpoint)
    teacher, plan, model, params, id_maps, layout, eval_batches = build(args)
    print(f"{len(jax.devices())} device(s), stacks {list(plan.stack_names)}, "
          f"{args.steps} steps x {args.batch_size} examples")
    print(describe_kernels(plan))
    result = train(args, plan, teacher, model, params, id_maps, layout)
    predict = make_predict(model)
    train_auc, teacher_train_auc = score(predict, result.params, result.id_maps, result.recent)
    eval_auc, teacher_auc = score(predict, result.params, result.id_maps, eval_batches)
    if args.checkpoint_dir:
        save_checkpoint(args.checkpoint_dir, plan, result.params, result.id_maps, args.steps)

    examples_per_second = args.steps * args.batch_size / result.seconds
    print(f"trained in {result.seconds:.1f} s ({examples_per_second:,.0f} examples/s); "
          f"preprocess capacity {result.stats.capacity}, dropped ids {result.stats.dropped_ids}")
    print(f"loss curve (mean over {min(8, len(result.losses))} stretches): {loss_curve(result.losses)}")
    if result.id_maps:
        used = int(np.asarray(result.id_maps["user"].rows.size).sum())
        print(f"raw user ids: {used} of {args.user_rows} rows in use ({args.users} users in the data)")
    print(f"{'AUC':<36}{'model':>8}{'teacher':>10}")
    print(f"{f'train (last {len(result.recent)} training batches)':<36}{train_auc:>8.4f}{teacher_train_auc:>10.4f}")
    print(f"{f'eval  ({len(eval_batches)} held-out batches)':<36}{eval_auc:>8.4f}{teacher_auc:>10.4f}")
    print("(the teacher's AUC is the ceiling on held-out data; on batches it trained on, the model "
          "can exceed it by fitting their label noise)")
    return {"losses": result.losses, "train_auc": train_auc, "eval_auc": eval_auc, "teacher_auc": teacher_auc,
            "teacher_train_auc": teacher_train_auc, "seconds": result.seconds,
            "examples_per_second": examples_per_second}


if __name__ == "__main__":
    se.tuning.configure_xla_cpu()  # before the first JAX computation: no whole-table copies on CPU
    se.tuning.configure_cpu_allocator()  # XLA's per-step temporaries reused, not mapped afresh (the raw-id map's)
    main()
