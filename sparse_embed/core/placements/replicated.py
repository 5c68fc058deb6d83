"""The "replicated" placement: every device holds every row of the stack.

Layout: the stacked array is S copies of the `total_rows` rows, one after
the other; a stack row is a row of each copy.

Exchange: none forward (each device reads its own ids locally). The
backward sums every device's gradients per touched row into a dense
`[total_rows, dim + 1]` buffer (the last column counts touches), one
all-reduce adds them up, and every replica applies the same update to the
rows any device touched, so the replicas never drift.

Cost per device and train step: `8 vocab (dim + 1) (D-1)/D` bytes through
collectives (the all-reduce of the dense gradient and touch counts), plus
`12 vocab (dim + 1)` bytes of work for the dense pass; `vocab` rows of
memory. Right for small tables, wrong for a large one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparse_embed.core.collectives import joined, kernel_stack
from sparse_embed.core.placements.base import padded_vocab
from sparse_embed.core.placements.whole import WholeTables


class Replicated(WholeTables):
    name = "replicated"

    # ------------------------------------------------------------------ layout
    def segments(self, stack) -> int:
        return 1  # the device's own ids, read locally

    def whole_activations(self, stack) -> bool:
        return True

    # ---------------------------------------------------------------- relayout
    def from_shard_major(self, stack, array, width):
        return array[: stack.total_rows]  # the first copy

    def place(self, stack, whole, axis):
        return jnp.concatenate(whole, axis=0)

    def to_natural_chunk(self, stack, local, where, m, axis, width):
        """Every device reads its own natural rows from its copy."""
        c0, _, rows = self.reader(stack, local, where)
        return rows(c0 + jax.lax.axis_index(axis) * m + jnp.arange(m))

    # ---------------------------------------------------------------- exchange
    def exchange(self, stack, axis, coo):
        return tuple(x.reshape(1, -1) for x in (coo.col_ids, coo.row_ids, coo.values))  # one source: this device

    def view(self, stack, axis, per_feature=False):
        return kernel_stack(stack, sources=1, per_feature=per_feature)

    def activations(self, stack, axis, partials):
        return partials[0]

    def combined(self, stack, axis, rec, grads):
        """Every device's gradients summed into one entry per touched row (an all-reduce).

        Returns entries `[1, total_rows]` (row r reads output row r; untouched
        rows are padding) and their gradients `[1, total_rows, dim]`, equal on
        every device. A row is touched when any entry reads it, whatever its gain.
        """
        n, dim = stack.total_rows, stack.embedding_dim
        g = jnp.pad(grads, ((0, 1), (0, 0)))[rec.row_ids.reshape(-1)] * rec.values.reshape(-1, 1)  # padding: row 0s
        contrib = jnp.concatenate([g, jnp.ones_like(g[:, :1])], axis=1)
        dense = jax.lax.psum(jnp.zeros((n, dim + 1), jnp.float32).at[rec.col_ids.reshape(-1)].add(contrib,
                                                                                                   mode="drop"),
                             axis)
        rows = jnp.arange(n, dtype=jnp.int32)
        touched = rec._replace(col_ids=jnp.where(dense[:, dim] > 0, rows, n)[None], row_ids=rows[None],
                               values=jnp.ones((1, n), jnp.float32))
        # Equal on every device, but typed as varying like the table they update (shard_map's scan carries).
        return jax.lax.pcast((touched, dense[None, :, :dim]), axis, to="varying")

    def backward(self, stack, axis, kernel, rec, saved, state, grads, step, skip):
        """Every replica applies the same update: the summed gradients."""
        rec, g = self.combined(stack, axis, rec, joined(grads))
        view = kernel_stack(stack, sources=1, out_rows=stack.total_rows)
        fwd = kernel.forward(view, rec, state.table)  # what the kernel's backward needs of its forward
        return kernel.backward(view, rec, fwd.saved, state._replace(table=fwd.table), g, step, skip)

    def nonfinite_rows(self, stack, axis, rec, grads, count):
        """The same rows on every device: counted once."""
        rec, g = self.combined(stack, axis, rec, grads)
        return jax.lax.pmax(count(kernel_stack(stack, sources=1, out_rows=stack.total_rows), rec, g), axis)

    # -------------------------------------------------------------------- cost
    def traffic(self, load, num_devices, share=None):
        return 8.0 * load.vocab * (load.dim + 1) * ((num_devices - 1) / num_devices)

    def work(self, load, num_devices):
        return 12.0 * load.vocab * (load.dim + 1)

    def memory(self, load, num_devices):
        return float(padded_vocab(load, num_devices) * load.row_bytes)

    def collective_bytes(self, stack, capacity, skip_nonfinite):
        D = stack.num_shards
        return 2 * (D - 1) * stack.total_rows * (stack.embedding_dim + 1) * 4 // D
