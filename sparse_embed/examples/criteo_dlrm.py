"""The demo on Criteo-format click logs (`python -m sparse_embed.examples.dlrm --data PATH ...`), resumable.

The 26 categorical features each read their own table, keyed by raw ids
(`se.Dynamic`, `--table-rows` rows, least recently used evicted) or, with
`--hashed`, a static table of `--table-rows` rows that the ids are hashed
into. The 13 integer features (log1p) feed a bottom MLP; the 27 vectors'
pairwise dots and the vectors feed a top MLP (DLRM). The input is a grain
pipeline (`se.data.CriteoSource`, batches shuffled, `--workers` processes
reading) under `se.data.Loader`. With `--checkpoint-dir`, the run saves
every `--checkpoint-every` steps (tables, id maps, dense state, the losses
so far and the loader's state) and, started again (with the same or a
larger `--steps`), continues from the last save exactly as if it had
never stopped. The last `--eval-batches` batches of the files (at most a
quarter of them, at least one) are held out for eval AUC.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any, NamedTuple

import grain
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import sparse_embed as se
from sparse_embed import data as sed
from sparse_embed._argtypes import COUNT, POSITIVE_INT
from sparse_embed.examples.dlrm import AXIS, auc, describe_kernels, loss_curve

FEATURES = tuple(f"C{i}" for i in range(1, 27))


def make_plan(args: argparse.Namespace, mesh: Mesh) -> se.EmbeddingPlan:
    opt = se.optimizers.Adagrad(args.embedding_lr, initial_accumulator_value=args.embedding_init_acc)
    init = se.initializers.truncated_normal(args.embedding_init_std)
    dynamic = None if args.hashed else se.Dynamic()
    tables = [se.TableSpec(f, args.table_rows, args.embedding_dim, init, opt, dynamic=dynamic) for f in FEATURES]
    return se.plan([se.FeatureSpec(t.name, t, args.batch_size) for t in tables], mesh)


def _dense_layer(key, n_in: int, n_out: int) -> dict:
    return {"w": jax.random.normal(key, (n_in, n_out)) * np.sqrt(2.0 / n_in), "b": jnp.zeros(n_out)}


def init_params(key, dim: int, top=(64, 32)) -> dict:
    """The dense head: bottom MLP 13 -> dim, top MLP over 27 vectors and their 351 pairwise dots -> 1."""
    keys = jax.random.split(key, 3 + len(top))
    widths = [27 * dim + 27 * 26 // 2, *top, 1]
    return {"bottom": [_dense_layer(keys[0], 13, 2 * dim), _dense_layer(keys[1], 2 * dim, dim)],
            "top": [_dense_layer(k, a, b) for k, a, b in zip(keys[2:], widths[:-1], widths[1:])]}


def _mlp(layers: list, x: jax.Array, last_relu: bool) -> jax.Array:
    for i, layer in enumerate(layers):
        x = x @ layer["w"] + layer["b"][None, :]
        x = jax.nn.relu(x) if last_relu or i < len(layers) - 1 else x
    return x


def logits(plan, params, tables, sparse, dense, step) -> jax.Array:
    """`[B]` click logits."""
    acts = se.lookup(plan, sparse, tables, step)
    vectors = jnp.stack([_mlp(params["bottom"], dense, True)] + [acts[f] for f in FEATURES], axis=1)  # [B, 27, d]
    i, j = np.triu_indices(vectors.shape[1], k=1)
    dots = jnp.einsum("bid,bjd->bij", vectors, vectors)[:, i, j]
    return _mlp(params["top"], jnp.concatenate([vectors.reshape(vectors.shape[0], -1), dots], 1), False)[:, 0]


class State(NamedTuple):
    """The dense state: a checkpoint's user pytree."""

    params: Any
    opt: Any


# Each step's loss stays on the device until this many are pending (or a checkpoint saves them): no sync per step.
# (Not an array of `--steps` losses in the state: the step's program would then depend on `--steps`, and a run
# resumed with a larger one would compile it again.)
LOSSES_PENDING = 100


def make_train_step(plan: se.EmbeddingPlan, tx: optax.GradientTransformation):
    def loss_fn(params, tables, sparse, dense, labels, step):
        return optax.sigmoid_binary_cross_entropy(logits(plan, params, tables, sparse, dense, step), labels).mean()

    def train_step(tables, id_maps, state: State, sparse, dense, labels, step):
        sparse, tables, id_maps, _ = se.map_ids(plan, sparse, tables, id_maps, step)
        loss, (g, tables) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state.params, tables, sparse, dense,
                                                                         labels, step)
        updates, opt = tx.update(g, state.opt, state.params)
        return tables, id_maps, State(optax.apply_updates(state.params, updates), opt), loss

    return jax.jit(train_step, donate_argnums=(0, 1, 2))


def make_predict(plan: se.EmbeddingPlan):
    def predict(tables, id_maps, params, sparse, dense):
        sparse = se.map_ids(plan, sparse, tables, id_maps, 0, train=False)[0]
        return logits(plan, params, tables, sparse, dense, 0)

    return jax.jit(predict)


def _rows(plan: se.EmbeddingPlan, x: np.ndarray) -> jax.Array:
    return jax.device_put(x, NamedSharding(plan.mesh, P(AXIS)))


def evaluate(plan, predict, tables, id_maps, params, source, batches: range) -> float:
    """AUC over `batches` of `source` (read and preprocessed here; eval does not touch the plan's training marks
    beyond what these batches need)."""
    labels, scores = [], []
    for i in batches:
        b = source[i]
        sparse, _ = se.preprocess(plan, sed.criteo_ids(b))
        scores.append(np.asarray(predict(tables, id_maps, params, sparse, _rows(plan, b.dense))))
        labels.append(b.labels)
    return auc(np.concatenate(labels), np.concatenate(scores))


def _layout(args, train_batches: int) -> dict[str, Any]:
    """What the shuffle of the training batches depends on besides --seed and --batch-size: the files (by name:
    a moved directory is the same data) and how many of their batches train (--eval-batches holds the rest out)."""
    return {"files": [os.path.basename(os.fspath(f)) for f in args.data], "train_batches": train_batches}


def _restore(args, plan, key: jax.Array, state: State, layout: dict[str, Any]):
    """The last checkpoint of `--checkpoint-dir` if there is one, else fresh tables and id maps: (tables, id maps,
    state, step, loader state, losses so far). Fresh ones are made only then: a restore needs no tables to restore
    into, and initialising them first would cost their programs and their memory at every start.

    The losses so far come from the step's `data` (float hex, exact), so a run may go on with a larger --steps.
    """
    r = None
    if args.checkpoint_dir:
        with se.CheckpointManager(args.checkpoint_dir) as ckpt:
            if ckpt.latest_step() is not None:
                r = ckpt.restore(plan, user={"params": state.params, "opt": state.opt})
    if r is None:
        return se.init_tables(plan, key), se.init_id_maps(plan, key), state, 0, None, []
    if r.step > args.steps:
        raise SystemExit(f"{args.checkpoint_dir} is at step {r.step}, past --steps {args.steps}: pass --steps "
                         f"{r.step} or more to go on from it, or another --checkpoint-dir.")
    # the shuffle and the loader's position (in batches) are theirs; grain's state under mp_prefetch is per worker
    for flag in ("seed", "batch_size", "workers"):
        if r.data.get(flag, getattr(args, flag)) != getattr(args, flag):
            raise SystemExit(f"{args.checkpoint_dir} was trained with --{flag.replace('_', '-')} {r.data[flag]}: "
                             "resume with it, or use another --checkpoint-dir.")
    for k, v in layout.items():  # (checkpoints saved before these were kept: unchecked)
        if r.data.get(k, v) != v:
            raise SystemExit(f"{args.checkpoint_dir} was trained on {k.replace('_', ' ')} {r.data[k]}, this run has "
                             f"{v}: the shuffle of the training batches is theirs (and the held-out ones must stay "
                             "out). Resume with the same --data and --eval-batches, or use another --checkpoint-dir.")
    print(f"resumed from step {r.step} of {args.checkpoint_dir}")
    losses = [float.fromhex(x) for x in r.data["losses"]]
    return r.tables, r.id_maps, State(r.user["params"], r.user["opt"]), r.step, r.data["loader"], losses


def _save(ckpt, step: int, plan, tables, id_maps, state: State, losses: list[float], loader: sed.Loader,
          args, layout: dict[str, Any]) -> None:
    """Step `step`: tables, id maps, dense state; the loader's state, the losses so far (`step` of them), the
    seed, the batch size, the grain worker count and the data's layout (`_layout`) as `data`."""
    losses = [float(x).hex() for x in losses]
    if not ckpt.save(step, plan, tables, id_maps=id_maps or None, user={"params": state.params, "opt": state.opt},
                     data={"loader": loader.get_state(), "losses": losses, "seed": args.seed,
                           "batch_size": args.batch_size, "workers": args.workers, **layout}):
        raise SystemExit(f"{ckpt.directory} already holds step {step}; use another --checkpoint-dir.")
    ckpt.wait()
    print(f"checkpoint of step {step} saved", flush=True)


# A record is a whole batch, and the Loader prepares batches ahead itself: grain's default read-ahead (16 threads,
# 500 records) would parse hundreds of batches ahead of the loop, a second of CPU at every start and their memory.
READ = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)


def _dataset(args, source: sed.CriteoSource, train_batches: int):
    ds = grain.MapDataset.source(source)[:train_batches].shuffle(seed=args.seed).repeat(None).to_iter_dataset(READ)
    return ds.mp_prefetch(grain.MultiprocessingOptions(num_workers=args.workers)) if args.workers else ds


def train(args, plan, source, train_batches: int):
    """The loop: grain batches, preprocessed ahead; a checkpoint every `--checkpoint-every` steps (and the last)."""
    key = jax.random.key(args.seed)
    tx = optax.adam(args.dense_lr)

    def initial(key):  # one program, not an eager op (and a compile) per layer and slot
        params = init_params(key, args.embedding_dim)
        return State(params, tx.init(params))

    # replicated: a restore puts it back the same way
    state = jax.jit(initial, out_shardings=NamedSharding(plan.mesh, P()))(key)
    layout = _layout(args, train_batches)
    tables, id_maps, state, start, data, losses = _restore(args, plan, key, state, layout)
    train_step = make_train_step(plan, tx)
    every = args.checkpoint_every or args.steps
    ckpt = se.CheckpointManager(args.checkpoint_dir, max_to_keep=2) if args.checkpoint_dir else None
    began = time.perf_counter()
    with sed.Loader(plan, _dataset(args, source, train_batches), inputs=sed.criteo_ids, state=data) as batches:
        pending = []
        for step in range(start, args.steps):
            sparse, _, b = next(batches)
            tables, id_maps, state, loss = train_step(tables, id_maps, state, sparse, _rows(plan, b.dense),
                                                      _rows(plan, b.labels), jnp.int32(step))
            pending.append(loss)
            save = ckpt is not None and ((step + 1) % every == 0 or step + 1 == args.steps)
            if save or len(pending) == LOSSES_PENDING or step + 1 == args.steps:
                losses += [float(x) for x in jax.device_get(pending)]
                pending = []
            if save:
                _save(ckpt, step + 1, plan, tables, id_maps, state, losses, batches, args, layout)
    if ckpt is not None:
        ckpt.close()
    return tables, id_maps, state, losses, start, time.perf_counter() - began


def main(args: argparse.Namespace) -> dict[str, Any]:
    """Trains on `args.data`; prints and returns losses and AUCs."""
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    source = sed.CriteoSource(args.data, args.batch_size, vocabulary=args.table_rows if args.hashed else None,
                              on_malformed=args.on_malformed)
    held_out = max(1, min(args.eval_batches, len(source) // 4))
    if len(source) - held_out < 1:
        raise SystemExit(f"--data holds {len(source)} batches of {args.batch_size}: too few to train on and hold "
                         "one out for the eval.")
    plan = make_plan(args, mesh)
    print(f"{len(jax.devices())} device(s), {source}, {args.steps} steps, {held_out} batches held out; "
          f"{'hashed' if args.hashed else 'raw-id'} tables of {args.table_rows} rows")
    print(describe_kernels(plan))
    tables, id_maps, state, losses, start, seconds = train(args, plan, source, len(source) - held_out)
    losses = np.asarray(losses, np.float32)
    eval_auc = evaluate(plan, make_predict(plan), tables, id_maps, state.params, source,
                        range(len(source) - held_out, len(source)))
    ran = args.steps - start
    print(f"trained steps {start}..{args.steps} in {seconds:.1f} s ({ran * args.batch_size / seconds:,.0f} "
          f"examples/s); skipped malformed lines: {source.files.skipped}")
    print(f"loss curve (mean over {min(8, len(losses))} stretches): {loss_curve(losses)}")
    print(f"eval AUC ({held_out} held-out batches): {eval_auc:.4f}")
    return {"losses": losses.tolist(), "eval_auc": eval_auc, "seconds": seconds, "start": start}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of the Criteo path (the others are shared with the synthetic demo)."""
    p.add_argument("--data", nargs="+", metavar="PATH",
                   help="train on Criteo-format click logs (plain or gzip) instead of the synthetic teacher; "
                        "make a sample with `python -m sparse_embed.examples.criteo_data FILE`")
    p.add_argument("--table-rows", type=POSITIVE_INT, default=20_000,
                   help="--data: rows of each categorical table")
    p.add_argument("--hashed", action="store_true",
                   help="--data: hash the categorical values into static tables instead of raw-id tables")
    p.add_argument("--workers", type=COUNT, default=0, help="--data: grain worker processes reading the files")
    p.add_argument("--on-malformed", choices=("error", "skip"), default="error",
                   help="--data: a malformed line stops the run (naming file and line), or is skipped and counted")
    p.add_argument("--checkpoint-every", type=COUNT, default=0,
                   help="--data: save every N steps into --checkpoint-dir (resumed from when started again)")
