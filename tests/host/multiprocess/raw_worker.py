"""One process of the raw-id multi-process test. argv: out_dir."""

from __future__ import annotations

import os
import sys

from launch import worker_init

pid, nproc = worker_init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import sparse_embed as se  # noqa: E402
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
multihost_utils.sync_global_devices("done")
print(f"raw worker {pid}/{nproc}: ok")
