"""One process of the multi-process tests (started by launch.run_workers). argv: out_dir ref_ckpt_dir."""

from __future__ import annotations

import itertools
import json
import os
import sys
import time

from launch import worker_init

pid, nproc = worker_init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import sparse_embed as se  # noqa: E402
from sparse_embed import distributed as sd  # noqa: E402
import scenario  # noqa: E402
from sparse_embed.core.sparsecore import layout as sparsecore_layout  # noqa: E402

out_dir, ref_ckpt = sys.argv[1], sys.argv[2]
mesh = Mesh(np.array(jax.devices()), ("x",))
assert len(jax.local_devices()) * nproc == 8 == mesh.size


def feed(plan, ids):
    return sd.process_slice(plan, ids)


def gathered_tables(plan, tables):
    return se.unstack_tables(plan, tables)  # gathers across processes itself


results = {}
# 1. training: several steps, auto capacity that grows once; then a checkpoint
plan = scenario.make_plan(mesh)
tables, losses, stats, programs = scenario.train(plan, feed)
results.update({f"trained/{k}": v for k, v in gathered_tables(plan, tables).items()})
results["losses"] = np.array(losses)
results["stats"] = scenario.stats_array(stats)
results["programs"] = np.array(programs)
with se.CheckpointManager(os.path.join(out_dir, "ckpt")) as ckpt:
    ckpt.save(scenario.STEPS, plan, tables)

# 2. a checkpoint saved by one process (8 devices) restored here
restored = se.CheckpointManager(ref_ckpt).restore(plan)
results.update({f"restored/{k}": v for k, v in gathered_tables(plan, restored.tables).items()})

# 2b. the same run with a table on one device, one replicated, one by columns; the checkpoint restored into it
placed = scenario.make_plan(mesh, placement=scenario.PLACEMENT)
tables_p, losses_p, _, _ = scenario.train(placed, feed)
results.update({f"placed/{k}": v for k, v in gathered_tables(placed, tables_p).items()})
results["placed_losses"] = np.array(losses_p)
restored = se.CheckpointManager(ref_ckpt).restore(placed)
results.update({f"placed_restored/{k}": v for k, v in gathered_tables(placed, restored.tables).items()})

# 3. explicit capacity with drops: global stats and the assembled batch
drop_plan = scenario.make_plan(mesh, capacity=8, on_overflow="drop")
ids = scenario.global_ids(drop_plan, scenario.GROW_AT)
batch, st = se.preprocess(drop_plan, feed(drop_plan, ids))
results["drop/stats"] = scenario.stats_array(st)
for name, coo in batch.items():
    for field, x in zip(coo._fields, multihost_utils.process_allgather(coo, tiled=True)):
        if x is not None:  # keys: raw-id tables only
            results[f"drop/{name}/{field}"] = x
    results[f"drop/{name}/layout"] = np.array(coo.layout.digest)  # the plan's mark: the same on every process

# 3b. SparseCore stacks: each process builds its devices' CSR; the limit is agreed by all
if sparsecore_layout.available():
    sc_plan = scenario.make_plan(mesh, sparsecores=2)
    for step in (0, scenario.GROW_AT):
        batch, st = se.preprocess(sc_plan, feed(sc_plan, scenario.global_ids(sc_plan, step)))
        results[f"sparsecore/{step}/needed"] = np.array(sorted(st.sparsecore_ids_per_partition.items())[0][1])
        for field, x in zip(batch["items_tags"].csr._fields,
                            multihost_utils.process_allgather(batch["items_tags"].csr, tiled=True)):
            results[f"sparsecore/{step}/{field}"] = x

# 3c. a prefetcher left early while the last process's input is slower: its worker fills its buffer first, as
# the others' do (it stopped an item short: the others' workers waited for it, and the plan's next exchanges
# below met another batch's numbers)
def slow_input():
    for i in itertools.count():
        if pid == nproc - 1:
            time.sleep(0.3)
        yield feed(plan, scenario.global_ids(plan, i % scenario.GROW_AT))


with se.prefetch(plan, slow_input()) as batches:
    for _ in zip(range(3), batches):
        pass
    if pid == 0:
        time.sleep(2)  # the first process's worker runs ahead

# 4. errors are raised on every process (nobody deadlocks in the next step)
messages = {}
error_plan = scenario.make_plan(mesh, capacity=8)
try:
    se.preprocess(error_plan, feed(error_plan, ids))
except ValueError as e:
    messages["overflow"] = str(e)
bad = feed(plan, scenario.global_ids(plan, 0))
if pid == nproc - 1:
    bad["user"] = bad["user"][:-1]  # one sample short on the last process only
try:
    se.preprocess(plan, bad)
except ValueError as e:
    messages["batch"] = str(e)
if pid == 0:
    bad = scenario.global_ids(plan, 0)  # the global batch instead of this process's rows
    bad["user"] = bad["user"][sd.process_rows(plan, "user")]
    try:
        se.preprocess(plan, bad)
    except ValueError as e:
        messages["global"] = str(e)
else:
    try:
        se.preprocess(plan, feed(plan, scenario.global_ids(plan, 0)))
    except ValueError as e:
        messages["global"] = str(e)
bad = feed(plan, scenario.global_ids(plan, 0))
if pid == nproc - 1:
    bad["user"] = bad["user"].copy()
    bad["user"][2, 0] = 1000  # out of range, in this process's sample 2
try:
    se.preprocess(plan, bad)
except ValueError as e:
    messages["id"] = str(e)
# still in step after the errors: one more good batch through the train step
batch, _ = se.preprocess(plan, feed(plan, scenario.global_ids(plan, 0)))
scenario.make_step(plan)(tables, batch, np.int32(0))[1].block_until_ready()

if pid == 0:
    np.savez(os.path.join(out_dir, "results.npz"), **results)
with open(os.path.join(out_dir, f"messages{pid}.json"), "w") as f:
    json.dump(messages, f)
multihost_utils.sync_global_devices("done")
print(f"worker {pid}/{nproc}: ok")
