"""One process of tests/tiers/test_offload_processes.py (started by launch.run_workers). argv: out_dir store_root."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import sys

from launch import worker_init

pid, nproc = worker_init()

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import offload_scenario as sc  # noqa: E402
import sparse_embed as se  # noqa: E402
from sparse_embed import distributed as sd  # noqa: E402

out_dir, root = sys.argv[1], sys.argv[2]
mesh = Mesh(np.array(jax.devices()), ("x",))
memory = sc.train_in_memory(se.plan(sc.features(None), mesh), sd.process_slice)
results = {f"memory/{t}/{k}": v for t, s in memory.items() for k, v in s.items()}

plan = se.plan(sc.features(root), mesh)
rng = jax.random.key(0)
tiers = se.offload.Tiers(plan, rng)
step, tables, planned = sc.linear_step(plan), se.init_tables(plan, rng), collections.deque()
data = [(sd.process_slice(plan, ids), sd.process_slice(plan, w)) for ids, w in sc.batches()]
for i, (ids, weights) in enumerate(data[:sc.FLUSH_AT]):  # by hand, two batches ahead of the swaps
    planned.append((i, *tiers.preprocess(ids, weights, step=i)))
    while len(planned) > 2 or (planned and i == sc.FLUSH_AT - 1):
        j, batch, _, swap = planned.popleft()
        _, tables, _, _ = step(tiers.swap(tables, swap), {}, batch, j)
tables = tiers.flush(tables, sc.FLUSH_AT)
ckpt = se.CheckpointManager(os.path.join(out_dir, "ckpt"))
ckpt.save(sc.FLUSH_AT, plan, tables, tiers=tiers)
ckpt.wait()

messages = {}
bad = dict(data[sc.FLUSH_AT][0])
if pid == nproc - 1:  # bad input on the last process only: every process raises, and nothing changes
    bad["f"] = bad["f"].copy()
    bad["f"][0, 0] = sc.V + 5
try:
    tiers.preprocess(bad, data[sc.FLUSH_AT][1], step=sc.FLUSH_AT)
except ValueError as e:
    messages["bad_id"] = str(e)

batches = tiers.prefetch(data[sc.FLUSH_AT:], inputs=lambda b: b, buffer_size=2, step=sc.FLUSH_AT)
assert isinstance(batches, se.Prefetcher) and batches.running  # prepared in the loop here (a raw-id table)
for i, item in enumerate(batches, sc.FLUSH_AT):
    _, tables, _, _ = step(tiers.swap(tables, item.swap), {}, item.batch, i)
assert not batches.running and all(s.wait_seconds > 0 for s in tiers.stats().values())
tables = tiers.flush(tables, sc.STEPS)
results.update({f"tiered/plain/{k}": v for k, v in se.unstack_state(plan, tables)["plain"].items()})
stats = {n: dataclasses.asdict(s) for n, s in tiers.stats().items()}

# a damaged row read by the last process only: every process raises
t = tiers.tables["adagrad"]
touched = np.unique(np.concatenate([ids[f][ids[f] >= 0] for ids, _ in sc.batches() for f in ("f", "seq")]))
rows = touched[(touched % nproc == nproc - 1) & (t.cache.slot_of[touched] < 0)][:sc.B]  # stored, not cached
first_words = t.store._records.map[rows, 0].copy()
if pid == nproc - 1:
    assert rows.size and t.store.written[rows].all()
    t.store._records.map[rows, 0] += 1.0  # the checksums no longer match
ids, weights = data[0]
ids = {**ids, "f": np.full((sc.B // nproc, sc.L), -1, np.int64)}
ids["f"][:, 0] = sd.process_slice(plan, {"f": np.resize(rows, sc.B)})["f"]
try:
    tiers.preprocess(ids, weights, train=False, step=0)
except ValueError as e:
    messages["damaged"] = f"{type(e).__name__}: {e}"
t.store._records.map[rows, 0] = first_words  # undamaged again
tiers.close()

# restored at FLUSH_AT (the stores go back a commit), trained on through a new Tiers: the same stores again
restored = ckpt.restore(plan)
ckpt.close()
tiers = se.offload.Tiers(plan, rng)
tables = restored.tables
for i, item in enumerate(tiers.prefetch(data[sc.FLUSH_AT:], inputs=lambda b: b, buffer_size=2, step=sc.FLUSH_AT),
                         sc.FLUSH_AT):
    _, tables, _, _ = step(tiers.swap(tables, item.swap), {}, item.batch, i)
tables = tiers.flush(tables, sc.STEPS)
results.update({f"resumed/plain/{k}": v for k, v in se.unstack_state(plan, tables)["plain"].items()})
tiers.close()

with open(os.path.join(out_dir, f"worker{pid}.json"), "w") as f:
    json.dump({"stats": stats, "messages": messages}, f)
if pid == 0:
    np.savez(os.path.join(out_dir, "results.npz"), **results)
multihost_utils.sync_global_devices("done")
print(f"offload worker {pid}/{nproc}: ok")
