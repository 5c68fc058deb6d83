"""A training run that checkpoints every step and resumes from its last checkpoint (tests/io/test_resume.py).

    python resume_run.py DATA CKPT LOSSES STEPS

Trains a tiny click model on a Criteo-format file through `se.data.Loader`
(grain: shuffled batches), two raw-id tables (C1, C2) and a static one (C3,
hashed), a linear head with Adam; after step k it saves step k + 1 (tables,
id maps, dense state, the loader's state), appends `k <loss as float hex>`
to LOSSES and prints `step k`. Started again, it continues from its last
checkpoint. With SE_COORDINATOR set: one process of a jax.distributed run
(`launch.worker_init`); each process reads its own rows.
"""

from __future__ import annotations

import os
import sys

if "SE_COORDINATOR" in os.environ:
    from launch import worker_init

    worker_init()

import grain  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import sparse_embed as se  # noqa: E402
from sparse_embed import data as sed  # noqa: E402

BATCH, DIM, STATIC_ROWS = 32, 4, 97


def make_plan(mesh) -> se.EmbeddingPlan:
    opt = se.optimizers.Adagrad(0.1)
    raw = [se.TableSpec(n, 1024, DIM, optimizer=opt, dynamic=se.Dynamic()) for n in ("C1", "C2")]
    static = se.TableSpec("C3", STATIC_ROWS, DIM, optimizer=opt)
    return se.plan([se.FeatureSpec(t.name, t, BATCH) for t in (*raw, static)], mesh)


def inputs(batch: sed.CriteoBatch) -> dict[str, np.ndarray]:
    return {"C1": batch.categorical[:, 0], "C2": batch.categorical[:, 1],
            "C3": sed.hash_ids(batch.categorical[:, 2], STATIC_ROWS)}


def init_dense(mesh) -> dict:
    """The linear head and its Adam state, replicated over the mesh."""
    params = {"w": jnp.zeros((13 + 3 * DIM,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    state = {"params": params, "opt": optax.adam(0.05).init(params)}
    return jax.device_put(state, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))


def make_step(plan: se.EmbeddingPlan):
    tx = optax.adam(0.05)

    def loss_fn(params, tables, sparse, dense, labels, step):
        acts = se.lookup(plan, sparse, tables, step)
        x = jnp.concatenate([dense, acts["C1"], acts["C2"], acts["C3"]], axis=1)
        return optax.sigmoid_binary_cross_entropy(x @ params["w"] + params["b"], labels).mean()

    def step_fn(tables, id_maps, dense_state, sparse, dense, labels, step):
        sparse, tables, id_maps, _ = se.map_ids(plan, sparse, tables, id_maps, step)
        loss, (g, tables) = jax.value_and_grad(loss_fn, argnums=(0, 1))(dense_state["params"], tables, sparse,
                                                                         dense, labels, step)
        updates, opt = tx.update(g, dense_state["opt"], dense_state["params"])
        return tables, id_maps, {"params": optax.apply_updates(dense_state["params"], updates), "opt": opt}, loss

    return jax.jit(step_fn, donate_argnums=(0, 1, 2))


def global_array(plan, x: np.ndarray) -> jax.Array:
    """This process's rows -> the global batch array, sharded over the plan's devices."""
    sharding = jax.sharding.NamedSharding(plan.mesh, jax.sharding.PartitionSpec(plan.axis_name))
    return jax.make_array_from_process_local_data(sharding, x, (BATCH, *x.shape[1:]))


def main(data: str, ckpt_dir: str, losses_path: str, steps: int) -> None:
    plan = make_plan(Mesh(np.array(jax.devices()), ("x",)))
    key = jax.random.key(0)
    ckpt = se.CheckpointManager(ckpt_dir, max_to_keep=2, async_save=False)
    if ckpt.latest_step() is not None:  # tables made only when there is nothing to restore (as the demo)
        r = ckpt.restore(plan, user=init_dense(plan.mesh))
        tables, id_maps, dense_state, start, state = r.tables, r.id_maps, r.user, r.step, r.data
    else:
        tables, id_maps, dense_state, start, state = se.init_tables(plan, key), se.init_id_maps(plan, key), \
            init_dense(plan.mesh), 0, None
    source = sed.CriteoSource(data, BATCH)
    # a record is a batch: a few read ahead (grain's default, 500 records on 16 threads, parses the file at start)
    read = grain.ReadOptions(num_threads=2, prefetch_buffer_size=8)
    dataset = grain.MapDataset.source(source).shuffle(seed=3).repeat(None).to_iter_dataset(read)
    step_fn = make_step(plan)
    with sed.Loader(plan, dataset, inputs=inputs, state=state) as batches, open(losses_path, "a") as log:
        for step in range(start, steps):
            sparse, _, item = next(batches)
            tables, id_maps, dense_state, loss = step_fn(tables, id_maps, dense_state, sparse,
                                                         global_array(plan, item.dense),
                                                         global_array(plan, item.labels), jnp.int32(step))
            if jax.process_index() == 0:
                log.write(f"{step} {float(np.asarray(loss.addressable_data(0))).hex()}\n")
                log.flush()
            ckpt.save(step + 1, plan, tables, id_maps=id_maps, user=dense_state, data=batches.get_state())
            print(f"step {step}", flush=True)
    ckpt.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
