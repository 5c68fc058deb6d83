"""One process of the raw-id multi-process test. argv: out_dir."""

from __future__ import annotations

import os
import sys

from launch import worker_init

pid, nproc = worker_init()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import sparse_embed as se  # noqa: E402
import sparse_embed.serving as ss  # noqa: E402
from sparse_embed import distributed as sd  # noqa: E402
import raw_scenario  # noqa: E402

out_dir = sys.argv[1]
mesh = Mesh(np.array(jax.devices()), ("x",))
plan = raw_scenario.make_plan(mesh)
tables, maps, stats = raw_scenario.train(plan, sd.process_slice)
results = raw_scenario.contents(plan, tables, maps)
results["stats"] = stats
with se.CheckpointManager(os.path.join(out_dir, "ckpt")) as ckpt:
    ckpt.save(raw_scenario.STEPS, plan, tables, id_maps=maps)
se.export_serving(os.path.join(out_dir, "serving"), plan, tables, id_maps=maps)  # every process calls it
if pid == 0:
    np.savez(os.path.join(out_dir, "results.npz"), **results)

# live updates: each process tracks the ids it feeds; the delta (process 0 writes it) holds every process's rows
se.export_serving(os.path.join(out_dir, "served8"), plan, tables, id_maps=maps, dtype="int8", step=raw_scenario.STEPS)
multihost_utils.sync_global_devices("served8")
changes = ss.Changes.since(os.path.join(out_dir, "served8"))


@jax.jit
def step_fn(tables, maps, batch, step):
    b, tables, maps, _ = se.map_ids(plan, batch, tables, maps, step)
    loss = lambda t: sum(jnp.sum(jnp.sin(x)) for x in se.lookup(plan, b, t, step).values())  # noqa: E731
    return jax.grad(loss)(tables), maps


for step in range(raw_scenario.STEPS, raw_scenario.STEPS + 2):
    ids = sd.process_slice(plan, raw_scenario.global_ids(step))
    tables, maps = step_fn(tables, maps, se.preprocess(plan, ids)[0], step)
    changes = changes.touched_ids(plan, ids)
ss.export_delta(os.path.join(out_dir, "deltas"), plan, tables, changes, id_maps=maps, step=step + 1)
se.export_serving(os.path.join(out_dir, "full8"), plan, tables, id_maps=maps, dtype="int8", step=step + 1)
multihost_utils.sync_global_devices("done")
print(f"raw worker {pid}/{nproc}: ok")
