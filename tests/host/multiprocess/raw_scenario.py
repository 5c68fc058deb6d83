"""A raw-id training run (admission, expiry, eviction) shared by the test process and the workers."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

import sparse_embed as se

STEPS, BATCH = 6, 32
SPACE = np.random.default_rng(11).integers(0, 2**63 - 1, 90, dtype=np.int64)
SPACE32 = np.random.default_rng(12).integers(0, 2**32, 90, dtype=np.int64)  # "visits": 4-byte keys
RAW = ("users", "visits")


def make_plan(mesh):
    users = se.TableSpec("users", 40, 4, combiner="sum", optimizer=se.optimizers.Adagrad(0.3),
                         dynamic=se.Dynamic(admit_after=2, expire_after=3, pending_capacity=6))
    visits = se.TableSpec("visits", 40, 4, optimizer=se.optimizers.SGD(0.5), dynamic=se.Dynamic(id_bits=32))
    items = se.TableSpec("items", 50, 4, optimizer=se.optimizers.SGD(0.5))
    return se.plan([se.FeatureSpec("u", users, BATCH), se.FeatureSpec("v", visits, BATCH),
                    se.FeatureSpec("i", items, BATCH)], mesh)


def global_ids(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([step, 5])
    u = SPACE[rng.integers(0, SPACE.size, (BATCH, 3))]
    u[rng.random((BATCH, 3)) < 0.2] = -1
    return {"u": u, "v": SPACE32[rng.integers(0, SPACE32.size, (BATCH, 2))], "i": rng.integers(0, 50, BATCH)}


def train(plan, feed=lambda plan, ids: ids):
    """Tables, id maps and each step's `IdMapStats` (as ints)."""
    rng = jax.random.key(0)
    tables, maps = se.init_tables(plan, rng), se.init_id_maps(plan, rng)

    @jax.jit
    def step_fn(tables, maps, batch, step):
        b, tables, maps, stats = se.map_ids(plan, batch, tables, maps, step)
        loss = lambda t: sum(jnp.sum(jnp.sin(x)) for x in se.lookup(plan, b, t, step).values())
        return jax.grad(loss)(tables), maps, stats

    stats = []
    for step in range(STEPS):
        batch, _ = se.preprocess(plan, feed(plan, global_ids(step)))
        tables, maps, st = step_fn(tables, maps, batch, step)
        stats.append([int(x) for name in RAW for x in st[name]])
    return tables, maps, np.array(stats)


def contents(plan, tables, maps) -> dict[str, np.ndarray]:
    """The raw-id tables and the static one, mesh-independent, as flat named arrays."""
    out = {}
    for name, t in se.raw_ids.id_table_contents(plan, tables, maps).items():
        out.update({f"{name}/{k}": np.asarray(v) for k, v in t._asdict().items() if k != "slots"})
        out.update({f"{name}/slot/{k}": v for k, v in t.slots.items()})
    static = [s for s in plan.stacks if s.dynamic is None]
    out["items"] = se.unstack_tables(dataclasses.replace(plan, stacks=tuple(static)),
                                     {s.name: tables[s.name] for s in static})["items"]
    return out
