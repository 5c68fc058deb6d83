"""The "table" placement: each table whole on one device, a stack's tables balanced over the devices.

Layout: table k lives on device `TablePlacement.shard`; device d holds
stack rows `[d * R, (d + 1) * R)` (R = `rows_per_shard`: the most rows one
device holds, its tables one after the other), so a stack row is a global
row of the array. The tables go to the device with the least traffic so far
in their stack, largest first (ties: the least memory of earlier "table"
stacks; `balance`).

Exchange: each device sends a table's ids to its device and gets that
device's activations back (`all_to_all`); the backward sends each device
the activation gradients of its tables' features (`all_to_all`).

Cost per device and train step: `12 ids (D-1)/D + 8 rows dim (D-1)/D`
bytes through collectives, counted as if the tables spread evenly (a stack
of k tables sends every shard `ceil(k/D)` tables' rows: `share`); the
device that holds a table holds all its rows, and every device as many as
the busiest one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_embed.core.collectives import kernel_stack, send_segments
from sparse_embed.core.placements.base import Where, padded_vocab, round_up, routed_bytes
from sparse_embed.core.placements.whole import WholeTables


def balance(items: list[tuple[str, object]], memory: list[float], name: str) -> dict[str, int]:
    """Assigns one stack's tables (`(name, TableLoad)`) to devices, largest first, each to the device with the
    least traffic (of placement `name`).

    Traffic is balanced within the stack (its collectives are as large as its
    busiest device's share); ties go to the device with the least `memory`
    (bytes per device of the plan's earlier "table" stacks), which is
    updated in place.
    """
    D = len(memory)
    owner, traffic = {}, [0.0] * D
    for n, load in sorted(items, key=lambda x: (-x[1].traffic(name, D), -x[1].memory(name, D), x[0])):
        d = min(range(D), key=lambda i: (traffic[i], memory[i], i))
        owner[n] = d
        traffic[d] += load.traffic(name, D)
        memory[d] += load.memory(name, D)
    return owner


class Table(WholeTables):
    name = "table"
    shares_stacks = True

    # ------------------------------------------------------------------ layout
    def assign(self, tables, loads, device_load, num_shards, sparsecores=0):
        owner = balance([(t.name, loads[t.name]) for t in tables], device_load, self.name)
        used = [0] * num_shards
        for t in tables:
            used[owner[t.name]] += round_up(t.vocabulary_size, num_shards)
        shard_rows, fill, out = max(used), [0] * num_shards, []
        for t in tables:
            d, padded = owner[t.name], round_up(t.vocabulary_size, num_shards)
            out.append(Where(d * shard_rows + fill[d], padded, d))
            fill[d] += padded
        return out, shard_rows

    def total_rows(self, stack) -> int:
        return stack.num_shards * stack.shard_rows

    def rows_per_shard(self, stack) -> int:
        return stack.shard_rows

    def segments(self, stack) -> int:
        return stack.num_shards

    def partial_rows(self, stack) -> int:
        """Only the features of the shard's own tables (the most on one device)."""
        per = [0] * stack.num_shards
        for f in stack.features:
            per[f.shard] += f.rows_per_device
        return max(per)

    # ---------------------------------------------------------------- relayout
    def from_shard_major(self, stack, array, width):
        return array

    def stack_rows(self, stack, global_rows):
        return global_rows

    def first_row(self, stack, start):
        return start // stack.rows_per_shard, start % stack.rows_per_shard

    def holds(self, owner, axis):
        return jax.lax.axis_index(axis) == owner

    def place(self, stack, whole, axis):
        me, R = jax.lax.axis_index(axis), stack.rows_per_shard
        local = jnp.zeros((R, whole[0].shape[1]), whole[0].dtype)
        for p, x in zip(stack.tables, whole):
            at = p.row_offset - p.shard * R
            local = local.at[at:at + p.padded_rows].set(jnp.where(me == p.shard, x.astype(local.dtype),
                                                                  local[at:at + p.padded_rows]))
        return local

    def pieces(self, stack, x, owner, m, width):
        return x[owner]  # real on the owner only

    # ---------------------------------------------------------------- exchange
    def exchange(self, stack, axis, coo):
        return send_segments(stack.segments, axis, (coo.col_ids, coo.row_ids, coo.values))

    def activations(self, stack, axis, partials):
        pooled = jax.lax.all_to_all(partials, axis, 0, 0, tiled=True)  # [S, partial_rows, dim], from each shard
        return jnp.concatenate([pooled[f.shard, f.partial_offset:f.partial_offset + f.rows_per_device]
                                for f in stack.features])  # each feature from its table's shard

    def to_owners(self, stack, axis, grads):
        """This device's activation gradients `[rows_per_device, dim]` -> each shard's share of every source's,
        `[D, partial_rows, dim]` (the transpose of `activations`)."""
        P, dim = stack.partial_rows, stack.embedding_dim
        send = []
        for d in range(stack.num_shards):
            mine = [grads[f.row_offset:f.row_offset + f.rows_per_device] for f in stack.features if f.shard == d]
            block = jnp.concatenate(mine) if mine else jnp.zeros((0, dim), grads.dtype)
            send.append(jnp.pad(block, ((0, P - block.shape[0]), (0, 0))))
        return jax.lax.all_to_all(jnp.stack(send), axis, 0, 0, tiled=True)

    def backward(self, stack, axis, kernel, rec, saved, state, grads, step, skip):
        g = self.to_owners(stack, axis, grads)
        return kernel.backward(self.view(stack, axis, stack.activations_per_feature), rec, saved, state, g, step,
                               skip)

    def nonfinite_rows(self, stack, axis, rec, grads, count):
        return jax.lax.psum(count(kernel_stack(stack), rec, self.to_owners(stack, axis, grads)), axis)

    # -------------------------------------------------------------------- cost
    def share(self, tables, num_devices):
        return -(-tables // num_devices) / tables

    def traffic(self, load, num_devices, share=None):
        """`share`: the part of the stack's ids and activation rows this table's device adds to every shard's
        (default `1/D`, tables spread evenly; 1 for a table alone in its stack). Both terms scale with it: the
        exchange's capacity is the busiest shard's, so with fewer tables than devices every source sends every
        shard a segment as large as one table's ids."""
        D = num_devices
        return (12.0 * load.ids + 8.0 * load.rows * load.dim) * (D - 1) * (1.0 / D if share is None else share)

    def memory(self, load, num_devices):
        """Every row of the table (the busiest device of the stack may hold more)."""
        return float(padded_vocab(load, num_devices) * load.row_bytes)

    def most_ids(self, stack):
        per = [0.0] * stack.num_shards
        for t in stack.tables:
            per[t.shard] += t.expected_ids
        return max(per)

    def collective_bytes(self, stack, capacity, skip_nonfinite):
        return routed_bytes(stack, capacity)
