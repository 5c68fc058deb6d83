"""Writes checkpoints the way sparse_embed 0.1-0.2 did (formats "sparse_embed/1" and "/2"), for read-compatibility tests.

Independent of the library's writer: natural arrays padded to the old
`stored_rows` (vocabulary rounded up to S*S), saved by orbax's PyTree handler
with its defaults of the time (OCDBT, zstd), metadata JSON as those versions
wrote it.
"""

import hashlib
import json

import numpy as np
import orbax.checkpoint as ocp

import sparse_embed as se


def save_old(step_dir, plan, state, step: int, fmt: str, user=None, checksum=None) -> None:
    S, host = plan.num_shards, se.unstack_state(plan, state)
    rows = {n: -(-t.vocabulary_size // (S * S)) * S * S for n, t in plan.tables.items()}
    arrays = {n: {k: np.pad(a, ((0, rows[n] - a.shape[0]), (0, 0))) for k, a in keys.items()} for n, keys in host.items()}
    tables = []
    for n in sorted(plan.tables):
        t = plan.tables[n]
        opt = t.resolved_optimizer
        slots = sorted([k, v.width] for k, v in opt.slots(t.embedding_dim).items())
        tables.append(dict(name=n, vocabulary_size=t.vocabulary_size, embedding_dim=t.embedding_dim,
                           dtype=str(np.dtype(t.dtype)), combiner=t.combiner, max_norm=t.max_norm,
                           optimizer=type(opt).__name__, slots=slots, stored_rows=rows[n]))
    meta = dict(kind="training", tables=tables, stacking=[[p.table.name for p in s.tables] for s in plan.stacks],
                num_shards=S, step=step, has_user=user is not None, format=fmt)
    if fmt == "sparse_embed/2":
        meta["checksums"] = {f"{n}/{k}": checksum(a, plan.tables[n].vocabulary_size)
                             for n, keys in arrays.items() for k, a in keys.items()}
        meta["user_checksums"] = None
        meta["algorithm"] = "oddmul32x2/1"
        meta["digest"] = hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()
    items = {"embeddings": ocp.args.PyTreeSave(arrays), "meta": ocp.args.JsonSave(meta)}
    if user is not None:
        items["user"] = ocp.args.PyTreeSave(user)
    handlers = dict(embeddings=ocp.PyTreeCheckpointHandler(), user=ocp.PyTreeCheckpointHandler(),
                    meta=ocp.JsonCheckpointHandler())
    ocp.Checkpointer(ocp.CompositeCheckpointHandler(**handlers)).save(step_dir, args=ocp.args.Composite(**items))
