#!/usr/bin/env python
"""Serving lookups from an offloaded table's store through a RAM cache, beside an in-memory table's lookups.

Default (issue 42's serving point): a store of 10^8 x 64 f32 rows
(RowwiseAdagrad: 264-byte records, a sparse 26 GB file) in which only the
Zipf-hot rows have been written: the 2*10^6 most frequent ranks of
Zipf(1.05), scattered over the rows as benchmarks/workload.py scatters
them, random values, written with `RowStore.write` and one `commit_step`
(cheap to build: no training; the other rows read the default vector).
`StoreServer` serves it with a 1 GiB RAM cache, starting cold (the store's
pages evicted from the OS page cache: misses read the disk); the lookups
are batches of 4096 x 20 Zipf(1.05) ids over all 10^8 rows (drawn before
timing), each a `lookup(ids) -> [81920, 64]`.

Beside it, a table that fits in memory (10^7 x 64, the same Zipf over its
rows): a numpy take of the same `[81920, 64]` rows, and
`sparse_embed.serving_lookup` (jitted; unpooled, max_sequence_length 20, so
it returns the same rows as `[4096, 20, 64]`). Blocks of batches alternate
between the systems, `--rounds` times, after `--warmup` batches have filled
the server's cache. Reported: ms per batch (median, p10-p90), million ids
per second, the ratios to the numpy take, the server's hit rate, not-found
share and rows read per batch; and the time of a `refresh()` that picks up a
commit changing `--changed` of the hot rows.

    python benchmarks/offload_serving.py                   # 10^8-row store, 1 GiB cache
    python benchmarks/offload_serving.py --cache-bytes 67108864   # a cache smaller than the hot rows
    python benchmarks/offload_serving.py --dir /data/serving_store   # keep the store, reuse it next time
    python benchmarks/offload_serving.py --quick           # smoke run, seconds

The store goes in a temporary directory (on disk) unless `--dir`; it is
removed in the background afterwards (a detached `rm -rf`: see
`remove_later`). A `--dir` on tmpfs (/dev/shm) measures the same store
with every miss read from memory instead of the disk.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Sequence

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from benchmarks import measuring  # noqa: E402
from benchmarks.measuring import RSS  # noqa: E402
from benchmarks.workload import HASH_PRIME  # noqa: E402

GIB = 2**30
SEEN = "store server, seen ids"  # the first timed block's batches again: their rows are cached by then


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=100_000_000, help="rows of the store")
    p.add_argument("--written", type=int, default=2_000_000, help="Zipf-hottest rows written to the store")
    p.add_argument("--memory-rows", type=int, default=10_000_000, help="rows of the in-memory table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--cache-bytes", type=int, default=GIB)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--ids-per-sample", type=int, default=20)
    p.add_argument("--zipf", type=float, default=1.05)
    p.add_argument("--warmup", type=int, default=60, help="server batches before timing (fill the cache)")
    p.add_argument("--batches", type=int, default=30, help="timed batches per block")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--changed", type=int, default=100_000, help="hot rows a commit changes before the refresh")
    p.add_argument("--no-jax", action="store_true", help="leave out serving_lookup")
    p.add_argument("--keep-page-cache", action="store_true",
                   help="serve with the store's pages as the build left them in the page cache (default: evicted)")
    p.add_argument("--dir", default=None, help="where the store goes (default: a temporary directory)")
    p.add_argument("--quick", action="store_true", help="a smoke run: small store, few batches")
    p.add_argument("--json", metavar="PATH")
    a = p.parse_args(argv)
    if a.quick:
        a.rows, a.written, a.memory_rows, a.cache_bytes = 1_000_000, 20_000, 100_000, 16 << 20
        a.batch, a.warmup, a.batches, a.rounds, a.changed = 512, 5, 5, 1, 1000
    return a


def zipf_ranks(rng: np.random.Generator, a: float, n: int, shape: tuple[int, ...]) -> np.ndarray:
    """int64 ranks in [0, n), P(rank k) proportional to (k + 1)^-a: Zipf(a) draws rejected above n (exactly the
    truncated distribution; no [n] table of the CDF)."""
    out = np.empty(int(np.prod(shape)), np.int64)
    filled = 0
    while filled < out.size:
        draw = rng.zipf(a, 2 * (out.size - filled) + 1024)
        draw = draw[draw <= n][:out.size - filled]
        out[filled:filled + draw.size] = draw - 1
        filled += draw.size
    return out.reshape(shape)


def scatter(ranks: np.ndarray, rows: int) -> np.ndarray:
    """Rank -> row, a bijection mod `rows` (as benchmarks/workload.py's id_sampler)."""
    return ranks * HASH_PRIME % rows


def build_store(args: argparse.Namespace, path: str) -> tuple[Any, float]:
    """The store: the `--written` hottest ranks' rows written with random values, one commit. `(RowStore, s)`.
    A store already at `path` (`--dir` of an earlier run with the same sizes) is reused: build time 0."""
    import sparse_embed as se
    from sparse_embed.tiers.store import RowStore

    t0 = time.perf_counter()
    spec = se.TableSpec("items", args.rows, args.dim, optimizer=se.optimizers.RowwiseAdagrad(0.05),
                        storage=se.offload.Offload(path, cache_rows=1))
    store = RowStore(spec)
    if store.commit:
        print(f"reusing the store at {path} (commit {store.commit}, {int(store.written.sum())} rows written)")
        return store, 0.0
    rng = np.random.default_rng(3)
    hot = np.sort(scatter(np.arange(args.written, dtype=np.int64), args.rows))
    for lo in range(0, hot.size, 1 << 18):
        part = hot[lo:lo + (1 << 18)]
        store.write(part, rng.standard_normal((part.size, store.width - 1), np.float32))
    store.commit_step(0)
    return store, time.perf_counter() - t0


def in_memory_table(rows: int, dim: int) -> np.ndarray:
    """`[rows, dim]` float32 standard normal, 64-byte aligned (so that jax on the CPU takes it without a copy),
    drawn in chunks (no temporaries the size of the table)."""
    raw = np.empty(rows * dim * 4 + 64, np.uint8)
    at = -raw.ctypes.data % 64
    table = raw[at:at + rows * dim * 4].view(np.float32).reshape(rows, dim)
    rng = np.random.default_rng(4)
    for lo in range(0, rows, 1 << 20):
        rng.standard_normal(dtype=np.float32, out=table[lo:lo + (1 << 20)])
    return table


class Systems:
    """The server over the store, and the in-memory table (numpy take, serving_lookup): one batch each."""

    def __init__(self, args: argparse.Namespace, path: str) -> None:
        import sparse_embed as se

        self.server = se.offload.StoreServer(path, cache_bytes=args.cache_bytes, refresh_seconds=None)
        self.table, self.jitted = in_memory_table(args.memory_rows, args.dim), None
        if args.no_jax:
            return
        import jax

        table = jax.device_put(self.table)  # 64-byte aligned: jax uses the same memory on the CPU (no copy)
        spec = se.TableSpec("items", args.memory_rows, args.dim, combiner="sum")
        feature = se.FeatureSpec("f", spec, args.batch, max_sequence_length=args.ids_per_sample)
        fn = jax.jit(lambda t, ids: se.serving_lookup({"f": feature}, t, {"f": ids}, oov="zero")["f"])
        self.jitted = lambda ids: jax.block_until_ready(fn({"items": table}, ids))

    def run(self, name: str, batches: list[np.ndarray]) -> list[float]:
        times = []
        for ids in batches:
            t0 = time.perf_counter()
            if name in ("store server", SEEN):
                self.server.lookup(ids.reshape(-1))
            elif name == "numpy take":
                self.table[ids.reshape(-1)]  # (fancy indexing: faster than np.take here)
            else:
                self.jitted(ids)
            times.append(time.perf_counter() - t0)
        return times


def _ms(times: list[float]) -> dict[str, float]:
    t = np.asarray(times) * 1e3
    return {"median": float(np.median(t)), "p10": float(np.percentile(t, 10)), "p90": float(np.percentile(t, 90))}


_COUNTS = ("lookups", "hits", "misses", "not_found", "rows_read", "read_seconds")


def measure(args: argparse.Namespace, store: Any, path: str) -> dict[str, Any]:
    """Warm-up, then rounds of alternating blocks: the server on new batches, the server on the same batches again
    (their rows cached by then), the in-memory lookups; then a commit of `--changed` hot rows and the refresh."""
    shape, rng = (args.batch, args.ids_per_sample), np.random.default_rng(5)
    count = args.warmup + args.rounds * args.batches
    served = [scatter(zipf_ranks(rng, args.zipf, args.rows, shape), args.rows) for _ in range(count)]
    memory = [scatter(zipf_ranks(rng, args.zipf, args.memory_rows, shape), args.memory_rows).astype(np.int32)
              for _ in range(args.rounds * args.batches)]
    if not args.keep_page_cache:  # the server starts cold: its misses read the disk
        fd = os.open(os.path.join(path, "records", "c", "0", "0"), os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    systems = Systems(args, path)
    names = ["store server", SEEN, "numpy take"] + ([] if args.no_jax else ["serving_lookup (jit)"])
    warm = systems.run("store server", served[:args.warmup])
    warm_hit_rate = systems.server.stats().hit_rate
    for name in names[2:]:
        systems.run(name, memory[:3])  # compile, touch
    times: dict[str, list[float]] = {n: [] for n in names}
    counts = {n: dict.fromkeys(_COUNTS, 0) for n in names[:2]}
    for r in range(args.rounds):
        block = slice(r * args.batches, (r + 1) * args.batches)
        for name in names:
            before = systems.server.stats()
            times[name] += systems.run(name, served[args.warmup:][block] if name in counts else memory[block])
            for k in _COUNTS if name in counts else ():
                counts[name][k] += getattr(systems.server.stats(), k) - getattr(before, k)
    out: dict[str, Any] = {"warmup_ms": _ms(warm), **{n: _ms(t) for n, t in times.items()}}
    for n in names:
        out[n]["mids_per_s"] = args.batch * args.ids_per_sample / out[n]["median"] / 1e3
        out[n]["vs_numpy_take"] = out[n]["median"] / out["numpy take"]["median"]
    for n, d in counts.items():
        out[n].update({"hit_rate": d["hits"] / max(d["hits"] + d["misses"], 1),
                       "not_found_share": d["not_found"] / max(d["lookups"], 1),
                       "rows_read_per_batch": d["rows_read"] / len(times[n]),
                       "read_ms_per_batch": 1e3 * d["read_seconds"] / len(times[n]),
                       "us_per_row_read": 1e6 * d["read_seconds"] / max(d["rows_read"], 1)})
    out["server"] = {"cached_rows": systems.server.stats().cached_rows, "warm_hit_rate": warm_hit_rate}
    out["refresh"] = refresh_time(args, store, systems.server)
    out["rss_now_gib"] = rss_now()
    return out


def rss_now() -> dict[str, float]:
    """This process's resident memory now: anonymous (arrays, the cache) and file-backed (mapped store pages)."""
    with open("/proc/self/status") as f:
        kib = {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in ("RssAnon", "RssFile")}
    return {k: v / 2**20 for k, v in kib.items()}


def refresh_time(args: argparse.Namespace, store: Any, server: Any) -> dict[str, float]:
    """A commit that rewrites `--changed` random hot rows, then the server's `refresh()`: its ms, rows dropped."""
    rows = np.flatnonzero(store.written)
    rows = np.sort(np.random.default_rng(6).choice(rows, min(args.changed, rows.size), replace=False))
    store.write(rows, np.zeros((rows.size, store.width - 1), np.float32))
    store.commit_step(store.commit)
    before = server.stats().invalidated
    t0 = time.perf_counter()
    assert server.refresh()
    ms = (time.perf_counter() - t0) * 1e3
    return {"changed": int(rows.size), "ms": ms, "invalidated": server.stats().invalidated - before}


def report(args: argparse.Namespace, r: dict[str, Any]) -> None:
    print(f"\nstore {args.rows:.1e} x {args.dim} ({args.written:.1e} hot rows written, built in "
          f"{r['build_seconds']:.0f} s, in {r['store_dir']}), cache {args.cache_bytes / 2**20:.0f} MiB; in memory "
          f"{args.memory_rows:.1e} x {args.dim}; batches of {args.batch} x {args.ids_per_sample} Zipf({args.zipf}) ids")
    print(f"  {'':24s} {'ms/batch median (p10-p90)':>28s} {'M ids/s':>9s} {'vs numpy take':>14s}")
    for name in ("store server", SEEN, "numpy take", "serving_lookup (jit)"):
        if name in r:
            m = r[name]
            print(f"  {name:24s} {m['median']:10.2f} ({m['p10']:7.2f}-{m['p90']:7.2f}) {m['mids_per_s']:9.2f} "
                  f"{m['vs_numpy_take']:13.2f}x")
    s, f, n = r["server"], r["refresh"], r["store server"]
    print(f"  server: warm-up {r['warmup_ms']['median']:.1f} ms/batch (hit rate {s['warm_hit_rate']:.3f}); new "
          f"batches: hit rate {n['hit_rate']:.4f}, not found {n['not_found_share']:.3f} of ids, "
          f"{n['rows_read_per_batch']:.0f} rows read per batch in {n['read_ms_per_batch']:.1f} ms "
          f"({n['us_per_row_read']:.1f} us a row); seen batches: hit rate {r[SEEN]['hit_rate']:.4f}; "
          f"{s['cached_rows']} rows cached")
    print(f"  refresh after a commit of {f['changed']} changed rows: {f['ms']:.1f} ms, {f['invalidated']} cached "
          f"rows dropped; peak RSS {r['peak_rss_gib']:.2f} GiB (at the end: {r['rss_now_gib']['RssAnon']:.2f} GiB "
          f"anonymous, {r['rss_now_gib']['RssFile']:.2f} GiB file-backed)")


def remove_later(where: str) -> None:
    """Removes the store in a detached `rm -rf`: freeing a sparse file's scattered rows takes an extent each, and
    where the filesystem is mounted with `discard` (this VM's ext4) that took over 30 minutes for 2*10^6 rows."""
    print(f"removing {where} in the background (rm -rf)")
    subprocess.Popen(["rm", "-rf", where], start_new_session=True, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    where = args.dir or tempfile.mkdtemp(prefix="sparse_embed_serving_")
    path = os.path.join(where, "store")
    try:
        store, seconds = build_store(args, path)
        results = {"store_dir": where, "build_seconds": seconds, **measure(args, store, path)}
        store.close()
        results["peak_rss_gib"] = RSS.final_process_peak() / GIB
        report(args, results)
        if args.json:
            measuring.write_json(args.json, {"args": vars(args), "results": results})
    finally:
        if not args.dir:
            remove_later(where)
    return results


if __name__ == "__main__":
    main()
