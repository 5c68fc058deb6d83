#!/usr/bin/env python
"""Host preprocessing throughput: `sparse_embed.preprocess` vs jax-tpu-embedding's C++, side by side.

Workload W1's input: 8 features (one per 1M-row table), global batch 4096,
20 ids per sample (dense `[B, 20]`), or ragged rows of 1..40 ids
(`--ragged`); uniform ids. Both libraries get the very same ids and build
their per-device buffers for 1 and 8 devices (sparse_embed: numpy arrays,
`device_put=False`; jax-tpu-embedding: `preprocess_sparse_dense_matmul_input`
with its own thread pool). Reported: median seconds per batch, M ids/s, and
the ratio sparse_embed / jax-tpu-embedding throughput (goal >= 1.0).
sparse_embed runs its C kernels (one thread) unless `--numpy` (or a build
without the extension) selects its numpy path.

    python benchmarks/preprocess.py            # dense and ragged, 1 and 8 devices
    python benchmarks/preprocess.py --quick    # a small smoke run
    python benchmarks/preprocess.py --numpy    # sparse_embed's numpy fallback
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Sequence

import numpy as np

ROWS, TABLES, BATCH, IDS = 1_000_000, 8, 4096, 20
# jax-tpu-embedding partitions per SparseCore (2 or 4 per chip); 2 = fewest partitions it allows.
JTE_SC_PER_DEVICE = 2


def make_inputs(rng: np.random.Generator, tables: int, batch: int, ids: int, ragged: bool) -> dict[str, Any]:
    """{feature: ids}: dense `[B, ids]` int32, or a list of B arrays of 1..2*ids ids."""
    if not ragged:
        return {f"f{i}": rng.integers(0, ROWS, (batch, ids), dtype=np.int32) for i in range(tables)}
    return {f"f{i}": [rng.integers(0, ROWS, n, dtype=np.int32) for n in rng.integers(1, 2 * ids + 1, batch)]
            for i in range(tables)}


def sparse_embed_fn(tables: int, batch: int, devices: int) -> Callable[[dict], Any]:
    import jax
    import sparse_embed as se

    specs = {f"f{i}": se.FeatureSpec(f"f{i}", se.TableSpec(f"t{i}", ROWS, 64, combiner="sum"), batch)
             for i in range(tables)}
    plan = se.plan(specs, jax.sharding.Mesh(np.array(jax.devices()[:devices]), ("x",)))
    return lambda ids: se.preprocess(plan, ids, device_put=False)


def jte_fn(tables: int, batch: int, devices: int, ragged: bool) -> Callable[[dict], Any] | None:
    """jax-tpu-embedding's C++ preprocessing of the same features, or None if it is not installed."""
    try:
        import jax
        from jax_tpu_embedding.sparsecore.lib.nn import embedding, embedding_spec
    except ImportError:
        return None
    feats = {}
    for i in range(tables):
        t = embedding_spec.TableSpec(
            name=f"t{i}", vocabulary_size=ROWS, embedding_dim=64, initializer=jax.nn.initializers.zeros,
            optimizer=embedding_spec.SGDOptimizerSpec(), combiner="sum",
            max_ids_per_partition=batch * 2 * IDS, max_unique_ids_per_partition=batch * 2 * IDS)
        feats[f"f{i}"] = embedding_spec.FeatureSpec(name=f"f{i}", table_spec=t, input_shape=[batch, IDS],
                                                    output_shape=[batch, 64])
    embedding.prepare_feature_specs_for_training(feats, global_device_count=devices, num_sc_per_device=JTE_SC_PER_DEVICE)

    def run(ids):
        if ragged:
            ids = {k: np.array(v, dtype=object) for k, v in ids.items()}
        weights = {k: (np.ones_like(v, np.float32) if not ragged else
                       np.array([np.ones(len(r), np.float32) for r in v], dtype=object)) for k, v in ids.items()}
        return embedding.preprocess_sparse_dense_matmul_input(
            ids, weights, feats, local_device_count=devices, global_device_count=devices,
            num_sc_per_device=JTE_SC_PER_DEVICE)

    return run


def timeit(fn: Callable[[dict], Any], inputs: Sequence[dict], reps: int) -> float:
    """Median seconds per call, cycling through `inputs` (one warm-up call first)."""
    fn(inputs[0])
    times = []
    for r in range(reps):
        t0 = time.perf_counter()
        fn(inputs[r % len(inputs)])
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small batch, 2 tables, 3 reps (smoke run)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--numpy", action="store_true", help="sparse_embed's numpy path, not its C extension")
    args = p.parse_args(argv)
    if "jax" not in sys.modules:  # simulate 8 CPU devices for the 8-device plan (before JAX starts)
        os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    from sparse_embed.host import native

    saved = os.environ.get(native.ENV)
    if args.numpy:
        os.environ[native.ENV] = "0"
    try:
        return _run(args, "numpy" if native.extension() is None else "native")
    finally:
        if saved is None:
            os.environ.pop(native.ENV, None)
        else:
            os.environ[native.ENV] = saved


def _run(args: argparse.Namespace, path: str) -> dict[str, Any]:
    print(f"sparse_embed path: {path}")
    tables, batch, reps = (2, 256, 3) if args.quick else (TABLES, BATCH, args.reps)
    rng = np.random.default_rng(0)
    results = []
    print(f"{'input':<8}{'devices':>8}{'sparse_embed s':>16}{'M ids/s':>9}{'jte s':>10}{'M ids/s':>9}{'ratio':>8}")
    for ragged in (False, True):
        inputs = [make_inputs(rng, tables, batch, IDS, ragged) for _ in range(3)]
        n_ids = sum(int(np.size(v)) if not ragged else sum(map(len, v)) for v in inputs[0].values())
        for devices in (1, 8):
            ours = timeit(sparse_embed_fn(tables, batch, devices), inputs, reps)
            jte = jte_fn(tables, batch, devices, ragged)
            theirs = timeit(jte, inputs, reps) if jte else float("nan")
            row = {"input": "ragged" if ragged else "dense", "devices": devices, "ids": n_ids, "path": path,
                   "sparse_embed_s": ours, "jte_s": theirs, "ratio": theirs / ours}
            results.append(row)
            print(f"{row['input']:<8}{devices:>8}{ours:>16.4f}{n_ids / ours / 1e6:>9.1f}{theirs:>10.4f}"
                  f"{n_ids / theirs / 1e6:>9.1f}{row['ratio']:>8.2f}")
    print("ratio = sparse_embed throughput / jax-tpu-embedding throughput (goal >= 1.0)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return {"rows": results}


if __name__ == "__main__":
    main()
