"""The "row" placement (the default): every table's rows MOD-sharded over the devices.

Layout: stack row `r` lives on shard `r % S` at local row `r // S`. Every
table's padded size is a multiple of S, so table rows `[0, vocabulary_size)`
map to stack rows `[row_offset, row_offset + vocabulary_size)` and shard
`id % S` (for any table in a stack). A SparseCore stack (`sparsecores=C`)
is MOD-sharded over all N = S * C SparseCores instead, in
jax-tpu-embedding's layout: stack row `r` of a table rotated by `rotation`
lives on SparseCore `p = (r % N + rotation) % N` (device `p // C`) at its
row `r // N`, i.e. at local row `(p % C) * R + r // N` of its device (R =
`sc_rows`). The stacked array's global row `p * R + e` is row `e` of
SparseCore `p`, stack row `e * N + (p - rotation) % N`; with C = 1 and no
rotation this is the plain MOD layout, and one code path does both.

Exchange: each device sends segment s of its batch to shard s and gets
every shard's partial activations back (`all_to_all`), which it sums; the
backward gathers the activation gradients onto every shard (`all_gather`).

Cost per device and train step: `12 ids (D-1)/D + 8 rows dim (D-1)`
bytes through collectives (every shard's partials come back to every
device); `vocab / D` rows of memory.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparse_embed.core.collectives import gather, kernel_stack, send_segments
from sparse_embed.core.placements.base import Placement, padded_vocab, round_up, routed_bytes


class Row(Placement):
    name = "row"
    raw_ids = True  # each id's map entry lives on its owner shard
    sparsecores = True

    # ------------------------------------------------------------------ layout
    def rows_per_shard(self, stack) -> int:
        return stack.total_rows // stack.num_shards

    def segments(self, stack) -> int:
        return stack.num_shards

    def whole_activations(self, stack) -> bool:
        return stack.num_shards == 1

    # ---------------------------------------------------------------- relayout
    def from_shard_major(self, stack, array, width):
        N, w = stack.mod_shards, array.shape[-1]
        x = array.reshape(N, stack.sc_rows, w)
        parts = []
        for p in stack.tables:  # [N, rows, w] at its rows of every shard; shard (c + rotation) % N holds ids = c mod N
            o, n = p.row_offset // N, p.padded_rows // N
            parts.append(np.roll(x[:, o:o + n], -p.rotation, axis=0).transpose(1, 0, 2).reshape(-1, w))
        return np.concatenate(parts)

    def stack_rows(self, stack, global_rows):
        N, R = stack.mod_shards, stack.sc_rows
        shard, row = global_rows // R, global_rows % R
        if not any(p.rotation for p in stack.tables):
            return row * N + shard
        xp = jnp if isinstance(global_rows, jax.Array) else np
        which = xp.searchsorted(xp.asarray([p.row_offset // N for p in stack.tables]), row, side="right") - 1
        rotation = xp.asarray([p.rotation for p in stack.tables])[which]
        return row * N + (shard - rotation) % N

    def block_rows(self, stack, i, rows):
        """On SparseCores, a multiple of `S * N` that covers the table's padded rows, so every device's block is
        whole rows of all N SparseCores."""
        if not stack.sparsecores:
            return rows
        return round_up(max(rows, stack.tables[i].padded_rows), stack.num_shards * stack.mod_shards)

    def blocks_to_local(self, stack, blocks, axis):
        """Shard d holds ids `[d*n*N, (d+1)*n*N)` of a table; id i goes to MOD shard `p = (i % N + rotation) % N`
        (N = `mod_shards`), row `i // N`, on device `p // C` (C SparseCores per device, else 1): one all_to_all
        of `[S, n, C, w]`. Rows past a table's vocabulary come through as the blocks have them."""
        S, N = stack.num_shards, stack.mod_shards
        C = N // S
        out = []
        for p, block in zip(stack.tables, blocks):
            n = block.shape[0] // N
            x = jnp.roll(block.reshape(n, N, -1), p.rotation, axis=1).reshape(n, S, C, -1).transpose(1, 0, 2, 3)
            x = jax.lax.all_to_all(x, axis, 0, 0, tiled=True)  # [S (source d), n, C, w]: row d*n + a of each SparseCore
            out.append(x.transpose(2, 0, 1, 3).reshape(C, S * n, -1)[:, : p.padded_rows // N])
        return jnp.concatenate(out, axis=1).reshape(C * stack.sc_rows, -1)

    def chunk_align(self, stack) -> int:
        return stack.mod_shards

    def table_range(self, stack, i):
        """Its rows on every MOD shard (a device, or a SparseCore), and its rotation."""
        p = stack.tables[i]
        return p.row_offset // stack.mod_shards, p.padded_rows // stack.mod_shards, p.rotation

    def to_natural_chunk(self, stack, local, where, m, axis, width):
        """The chunk is rows `[c0 / C, c0 / C + k)` (k = m / C) of each of the N = S * C MOD shards (C
        SparseCores per device, else 1); row j of shard p is id `j * N + (p - rotation) % N`. One all_to_all of
        `[S, m / N, C, w]` gives device d the ids `[c0 * S + d * m, c0 * S + (d + 1) * m)`, in order."""
        S, N, R = stack.num_shards, stack.mod_shards, stack.sc_rows
        C, k = N // S, m // (N // S)
        c0, start, count, rotation = where[0], where[1], where[2], where[3]
        j = c0 // C + jnp.arange(k)
        rows = (jnp.arange(C) * R)[:, None] + (start + j)[None, :]
        x = jnp.where((j < count)[None, :, None], local[jnp.minimum(rows, local.shape[0] - 1)],
                      jnp.zeros((), local.dtype))
        x = x.reshape(C, S, k // S, -1).transpose(1, 2, 0, 3)  # [S (destination), k / S, C, w]
        x = jax.lax.all_to_all(x, axis, 0, 0, tiled=True)  # [S (source d), a, C (c), w]: row c0/C + me*k/S + a of d*C + c
        x = x.transpose(1, 0, 2, 3).reshape(k // S, N, -1)
        return jnp.roll(x, -rotation, axis=1).reshape(m, -1)  # shard p holds ids = (p - rotation) mod N

    def from_natural_chunk(self, stack, local, chunk, where, axis):
        S, m = stack.num_shards, chunk.shape[0]
        N, R = stack.mod_shards, stack.sc_rows
        C, k = N // S, m // (N // S)
        c0, start, count, rotation, valid = where[0], where[1], where[2], where[3], where[4]
        x = jnp.roll(chunk.reshape(k // S, N, -1), rotation, axis=1)  # [a, MOD shard p]
        x = x.reshape(k // S, S, C, -1).transpose(1, 0, 2, 3)  # [S (target), a, C, w]
        x = jax.lax.all_to_all(x, axis, 0, 0, tiled=True)  # [S (source d), a, C (c), w]: row c0/C + d*k/S + a of me*C + c
        x = x.transpose(2, 0, 1, 3).reshape(C * k, -1)
        j = c0 // C + jnp.arange(k)
        shard = jax.lax.axis_index(axis) * C + jnp.arange(C)[:, None]
        keep = (j < count)[None, :] & (j[None, :] * N + (shard - rotation) % N < valid)  # [C, k]
        rows = jnp.where(keep, (jnp.arange(C) * R)[:, None] + (start + j)[None, :], local.shape[0]).reshape(-1)
        return local.at[rows].set(x.astype(local.dtype), mode="drop")

    # ---------------------------------------------------------------- exchange
    def exchange(self, stack, axis, coo):
        return send_segments(stack.segments, axis, (coo.col_ids, coo.row_ids, coo.values))

    def activations(self, stack, axis, partials):
        return jax.lax.all_to_all(partials, axis, 0, 0, tiled=True).sum(axis=0)  # every shard's, summed

    def backward(self, stack, axis, kernel, rec, saved, state, grads, step, skip):
        g = jax.tree.map(lambda x: gather(x, axis), grads)  # [D, rpd, dim] (or blocks)
        return kernel.backward(self.view(stack, axis, stack.activations_per_feature), rec, saved, state, g, step,
                               skip)

    def nonfinite_rows(self, stack, axis, rec, grads, count):
        return jax.lax.psum(count(kernel_stack(stack), rec, gather(grads, axis)), axis)

    # -------------------------------------------------------------------- cost
    def traffic(self, load, num_devices, share=None):
        D = num_devices
        return 12.0 * load.ids * ((D - 1) / D) + 8.0 * load.rows * load.dim * (D - 1)

    def memory(self, load, num_devices):
        return float(padded_vocab(load, num_devices) * load.row_bytes // num_devices)

    def held_rows(self, stack, p) -> int:
        return p.padded_rows // stack.num_shards

    def collective_bytes(self, stack, capacity, skip_nonfinite):
        return routed_bytes(stack, capacity)
