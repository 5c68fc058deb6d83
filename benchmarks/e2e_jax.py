"""The JAX systems of `benchmarks/e2e.py`: sparse_embed under Flax linen and nnx, and `flax.linen.Embed`.

Each builds the DLRM of `e2e_data` with the dense part initialised from the
same numbers as TorchRec's, and exposes what `e2e.py` times: `loop(items)`
(the input pipeline: host batch -> what `step` takes, on a background
thread), `step(x)` (one train step, asynchronous), `dense_step(x)` (the
dense part alone on fixed embedding activations), `predict(x)`, and
`prepare(hb)` split into its host and host->device parts for the profile.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any, Callable, Iterable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import sparse_embed as se
from benchmarks.e2e_data import HostBatch, Model, dense_init, initial_tables
from sparse_embed.flax import linen as sel
from sparse_embed.flax import nnx as senn


def adagrad(lr: float, eps: float) -> optax.GradientTransformation:
    """torch's Adagrad: `acc += g^2; w -= lr * g / (sqrt(acc) + eps)`, acc from 0 (optax's puts eps inside)."""

    def update(g, acc, params=None):
        acc = jax.tree.map(lambda a, x: a + x * x, acc, g)
        return jax.tree.map(lambda x, a: -lr * x / (jnp.sqrt(a) + eps), g, acc), acc

    return optax.GradientTransformation(lambda p: jax.tree.map(jnp.zeros_like, p), update)


def rowwise_adagrad(lr: float, eps: float) -> optax.GradientTransformation:
    """FBGEMM's row-wise Adagrad on dense `[rows, dim]` gradients (an untouched row's zero gradient moves nothing)."""

    def update(g, acc, params=None):
        acc = jax.tree.map(lambda a, x: a + jnp.mean(x * x, axis=1, keepdims=True), acc, g)
        return jax.tree.map(lambda x, a: -lr * x / (jnp.sqrt(a) + eps), g, acc), acc

    return optax.GradientTransformation(lambda p: jax.tree.map(lambda t: jnp.zeros((t.shape[0], 1)), p), update)


def dlrm_head(model: Model, layer: Callable[[str, jax.Array], jax.Array], pooled: list, dense: jax.Array) -> jax.Array:
    """Bottom MLP, dot interaction, top MLP -> logits `[B]`; `layer(name, x)` applies the named dense layer."""
    x = dense
    for i in range(len(model.bottom) + 1):
        x = jax.nn.relu(layer(f"bottom_{i}", x))
    v = jnp.stack([x, *pooled], axis=1)  # [B, vectors, dim]
    i, j = np.triu_indices(model.vectors, k=1)
    y = jnp.concatenate([x, jnp.einsum("bid,bjd->bij", v, v)[:, i, j]], axis=1)
    last = len(model.top)
    for k in range(last + 1):
        y = layer(f"top_{k}", y)
        y = jax.nn.relu(y) if k < last else y
    return y[:, 0]


class Head(nn.Module):
    model: Model

    @nn.compact
    def __call__(self, pooled: list, dense: jax.Array) -> jax.Array:
        sizes = {name: out for name, _, out in self.model.layers()}
        return dlrm_head(self.model, lambda name, x: nn.Dense(sizes[name], name=name)(x), pooled, dense)


def head_params(model: Model) -> dict:
    return {k: {"kernel": jnp.asarray(w), "bias": jnp.asarray(b)} for k, (w, b) in dense_init(model).items()}


def bce(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.sigmoid_binary_cross_entropy(logits, labels).mean()


def jit_train(loss: Callable[..., jax.Array], tx: optax.GradientTransformation, apply_updates: Callable) -> Callable:
    """`(params, opt_state, *batch) -> (params, opt_state, loss)` of `loss(params, *batch)`; params, state donated."""

    def train(params, opt_state, *batch):
        value, grads = jax.value_and_grad(loss)(params, *batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return apply_updates(params, updates), opt_state, value

    return jax.jit(train, donate_argnums=(0, 1))


def dense_trainer(model: Model, place: Callable[[Any], Any] = lambda tree: tree) -> tuple[Callable, tuple]:
    """The dense part alone (the linen head, the same math in both APIs) on fixed activations: a jitted
    `(params, opt_state, acts, dense, labels) -> (params, opt_state, loss, d_acts)` (params, state donated) and
    its initial `(params, opt_state)`, placed by `place`."""
    tx, head = adagrad(model.dense_lr, model.eps), Head(model)

    def step(params, opt_state, acts, dense, labels):
        loss, (g, g_acts) = jax.value_and_grad(lambda p, a: bce(head.apply({"params": p}, a, dense), labels),
                                               argnums=(0, 1))(params, acts)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, g_acts

    params = place(head_params(model))
    return jax.jit(step, donate_argnums=(0, 1)), (params, tx.init(params))


@contextlib.contextmanager
def threaded(items: Iterable[Any], prepare: Callable[[Any], Any], depth: int = 2) -> Iterator[Iterator[Any]]:
    """`prepare(item)` of each item on a background thread, `depth` ahead of the consumer."""
    q: queue.Queue = queue.Queue(depth)
    stop = threading.Event()

    def work():
        for item in items:
            if stop.is_set():
                return
            q.put(prepare(item))
        q.put(StopIteration)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    try:
        yield iter(q.get, StopIteration)
    finally:
        stop.set()
        while thread.is_alive():  # unblock a worker waiting on a full queue
            with contextlib.suppress(queue.Empty):
                q.get(timeout=0.1)


# ------------------------------------------------------------------ sparse_embed
def embedding_plan(model: Model) -> se.EmbeddingPlan:
    """The tables (row-wise Adagrad, as TorchRec's fused one: `se.torchrec.optimizer_from_fused_params`) on one
    device per process (each process's first: one process, one device), a capacity that no batch exceeds (sum
    pooling over the batches' gains)."""
    o = se.torchrec.optimizer_from_fused_params({"optimizer": "exact_rowwise_adagrad",
                                                 "learning_rate": model.embedding_lr, "eps": model.eps})
    init = se.initializers.truncated_normal(0.02)
    tables = {t: se.TableSpec(t, rows, model.dim, init, o, combiner="sum") for t, rows in model.tables}
    features = {f: se.FeatureSpec(f, tables[t], model.batch) for f, t in model.features}
    devices = [d for d in jax.devices() if d.id == min(e.id for e in jax.devices() if e.process_index ==
                                                        d.process_index)]
    capacity = model.batch // len(devices) * sum(model.most_ids(f) for f, _ in model.features)
    return se.plan(features, jax.sharding.Mesh(np.array(devices), ("x",)), capacity=capacity)


def replicated(plan: se.EmbeddingPlan, tree):
    """Host values placed on every device of the plan's mesh (the same on every process)."""
    return jax.device_put(tree, jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec()))


def batch_rows(plan: se.EmbeddingPlan, rows):
    """This process's rows of a batch array -> the global array sharded over the plan's devices."""
    return jax.make_array_from_process_local_data(plan.batch_sharding(), rows)


class SparseEmbed:
    """sparse_embed's `Embed` + the head, trained with `optax_tx(adagrad)` + `apply_updates` (linen) or
    `sparse_embed.flax.nnx.Optimizer` (nnx); the input through `se.prefetch`."""

    def __init__(self, model: Model, api: str):
        self.model, self.api, self.plan = model, api, embedding_plan(model)
        self.features = [f for f, _ in model.features]
        self.count = 0
        (self._build_linen if api == "linen" else self._build_nnx)()
        self._dense_step, self._dense_state = dense_trainer(model, lambda tree: replicated(self.plan, tree))

    def _build_linen(self) -> None:
        plan, model, features = self.plan, self.model, self.features

        class Dlrm(nn.Module):
            @nn.compact
            def __call__(self, sparse, dense, step):
                acts = sel.Embed(plan, name="embed")(sparse, step)
                return Head(model, name="head")([acts[f] for f in features], dense)

        self.module = Dlrm()
        self.params = {"embed": {"tables": se.stack_tables(plan, initial_tables(model))},
                       "head": replicated(plan, head_params(model))}
        tx = se.optax_tx(adagrad(model.dense_lr, model.eps))
        self.opt_state = tx.init(self.params)
        loss = lambda p, sparse, dense, labels, step: bce(  # noqa: E731
            self.module.apply({"params": p}, sparse, dense, step), labels)
        self._train = jit_train(loss, tx, se.apply_updates)
        self._predict = jax.jit(lambda p, sparse, dense: self.module.apply({"params": p}, sparse, dense, None))
        self._acts = jax.jit(lambda p, sparse: se.lookup(plan, sparse, p["embed"]["tables"], None))

    def _build_nnx(self) -> None:
        from flax import nnx

        plan, model, features = self.plan, self.model, self.features

        class Dlrm(nnx.Module):
            def __init__(self, rngs):
                self.embed = senn.Embed(plan, rngs=rngs)
                for name, (w, b) in dense_init(model).items():
                    layer = nnx.Linear(w.shape[0], w.shape[1], rngs=rngs)
                    layer.kernel.set_value(jnp.asarray(w))
                    layer.bias.set_value(jnp.asarray(b))
                    setattr(self, name, layer)

            def __call__(self, sparse, dense, step):
                acts = self.embed(sparse, step)
                return dlrm_head(model, lambda name, x: getattr(self, name)(x), [acts[f] for f in features], dense)

        self.module = Dlrm(nnx.Rngs(0))
        for name, v in se.stack_tables(plan, initial_tables(model)).items():
            held = self.module.embed.tables[name]
            held["table"].set_value(v.table)
            for k, a in v.slots.items():
                held["slots"][k].set_value(a)
        self.optimizer = senn.Optimizer(self.module, adagrad(model.dense_lr, model.eps))

        @nnx.jit(donate_argnums=(0, 1))
        def train(m, optimizer, sparse, dense, labels, step):
            loss, grads = nnx.value_and_grad(lambda m: bce(m(sparse, dense, step), labels))(m)
            optimizer.update(m, grads)
            return loss

        self._train = train
        self._predict = nnx.jit(lambda m, sparse, dense: m(sparse, dense, None))
        self._acts = nnx.jit(lambda m, sparse: m.embed(sparse, None))

    def host_part(self, hb: HostBatch):
        gains = {f: (hb.gains[f], hb.ids[f][1]) for f in self.features}
        return se.preprocess(self.plan, hb.ids, gains, device_put=False)[0], hb.dense, hb.labels

    def device_part(self, host) -> Any:
        sparse, dense, labels = host
        return jax.block_until_ready((jax.device_put(sparse), jax.device_put(dense), jax.device_put(labels)))

    def prepare(self, hb: HostBatch) -> Any:
        return self.device_part(self.host_part(hb))

    @contextlib.contextmanager
    def loop(self, items: Iterable[HostBatch]) -> Iterator[Iterator[Any]]:
        inputs = lambda hb: (hb.ids, {f: (hb.gains[f], hb.ids[f][1]) for f in self.features})  # noqa: E731
        with se.prefetch(self.plan, items, inputs=inputs) as batches:
            yield ((b.batch, batch_rows(self.plan, b.item.dense), batch_rows(self.plan, b.item.labels))
                   for b in batches)

    def step(self, x) -> jax.Array:
        sparse, dense, labels = x
        step = jnp.int32(self.count)
        self.count += 1
        if self.api == "linen":
            self.params, self.opt_state, loss = self._train(self.params, self.opt_state, sparse, dense, labels, step)
            return loss
        return self._train(self.module, self.optimizer, sparse, dense, labels, step)

    def activations(self, x) -> list:
        acts = self._acts(self.params if self.api == "linen" else self.module, x[0])
        return [acts[f] for f in self.features]

    def dense_step(self, acts: list, x) -> jax.Array:
        params, opt_state, loss, _ = self._dense_step(*self._dense_state, acts, x[1], x[2])
        self._dense_state = (params, opt_state)
        return loss

    def predict(self, x) -> np.ndarray:
        state = self.params if self.api == "linen" else self.module
        return np.asarray(self._predict(state, x[0], x[1]))


# ------------------------------------------------------------------ flax.linen.Embed, dense gradients
class FlaxEmbed:
    """What a Flax user writes without sparse_embed: an `nn.Embed` per table, padded `[B, L]` ids and gains, a
    weighted sum; the whole tables' dense gradients through optax (row-wise Adagrad on them, as FBGEMM's)."""

    def __init__(self, model: Model):
        self.model, self.features = model, [f for f, _ in model.features]
        rows, tables = dict(model.tables), dict(model.features)

        class Dlrm(nn.Module):
            @nn.compact
            def __call__(self, ids, gains, dense):
                embed = {t: nn.Embed(rows[t], model.dim, name=t) for t in rows}
                pooled = [(embed[tables[f]](ids[f]) * gains[f][..., None]).sum(1) for f in tables]
                return Head(model, name="head")(pooled, dense)

        self.module = Dlrm()
        params = {t: {"embedding": jnp.asarray(a)} for t, a in initial_tables(model).items()}
        self.params = {**params, "head": head_params(model)}
        labels = {k: "head" if k == "head" else "table" for k in self.params}
        tx = optax.multi_transform({"head": adagrad(model.dense_lr, model.eps),
                                    "table": rowwise_adagrad(model.embedding_lr, model.eps)}, labels)
        self.opt_state = tx.init(self.params)
        loss = lambda p, ids, gains, dense, labels: bce(  # noqa: E731
            self.module.apply({"params": p}, ids, gains, dense), labels)
        self._train = jit_train(loss, tx, optax.apply_updates)
        self._predict = jax.jit(lambda p, ids, gains, dense: self.module.apply({"params": p}, ids, gains, dense))

    def prepare(self, hb: HostBatch) -> Any:
        """Ragged ids -> padded `[B, max length]` ids and gains (0 where padded), on the device."""
        ids, gains = {}, {}
        for f in self.features:
            values, lengths = hb.ids[f]
            mask = np.arange(self.model.most_ids(f))[None, :] < lengths[:, None]
            ids[f] = np.zeros(mask.shape, np.int32)
            gains[f] = np.zeros(mask.shape, np.float32)
            ids[f][mask], gains[f][mask] = values, hb.gains[f]
        return jax.device_put((ids, gains, hb.dense, hb.labels))

    def loop(self, items: Iterable[HostBatch]):
        return threaded(items, self.prepare)

    def step(self, x) -> jax.Array:
        self.params, self.opt_state, loss = self._train(self.params, self.opt_state, *x)
        return loss

    def predict(self, x) -> np.ndarray:
        return np.asarray(self._predict(self.params, *x[:3]))
