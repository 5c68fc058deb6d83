#!/usr/bin/env python
"""Init, save and restore of a giant table, beside numpy's save/load of the same arrays, each in a fresh process.

Default: one table of 10^7 x 64 f32 with Adagrad (table + accumulator,
4.8 GiB of state), on one CPU device. A restore usually runs in a fresh
process (after a preemption), so by default every phase runs in its own
Python process, started by this script (`--phase`):

- `save`: `init_tables`, then save + wait, then an fsync of the step's files (`+fsync`);
- `np.save`: `np.save` of the same arrays (made by `init_tables`, untimed), with an fsync of its files;
- `restore`: `restore_embeddings`, checksums verified, until the arrays are ready;
- `np.load`: `np.load` of those arrays.

Each is timed from after its imports (reported apart: `import s`), so the
restore's seconds hold everything else a user's restore pays: jax's backend
start, compiles, reads, checksum verification and device placement. Each of
`--repeats` rounds writes a fresh checkpoint and fresh `.npy` files, then
reads them, ours and numpy's interleaved (which goes first alternates), with
the page cache of the files a read phase reads in the same state for both
(`--cache`): `warm` reads them once just before the phase (as right after a
save), `cold` evicts them from this machine's page cache (fsync, then
`posix_fadvise(DONTNEED)`; a VM host's own cache may still hold them).
`--in-process` runs init, save, numpy and restore one after another in this
process instead (the old behaviour: a warm process, compiles and imports done
once).

Reported per operation: seconds, GiB/s of state, and peak RSS above the
process's resident memory before it (`measuring.RSS`), as a multiple of the
state; then the issue's goals: init >= 0.5 GiB/s; save >= 0.8x `np.save`'s
throughput and restore >= 0.8x `np.load`'s (checksums on); peak RSS <= 1.3x
the state. `--demo` adds the DLRM demo's state. Disk throughput on a VM
swings between runs: compare within one run.

    python benchmarks/checkpoint.py                     # 10^7 x 64, Adagrad, 3 rounds, fresh processes
    python benchmarks/checkpoint.py --repeats 5 --cache cold --json benchmarks/results/results_checkpoint.json
    python benchmarks/checkpoint.py --in-process        # one process (the old behaviour)
    python benchmarks/checkpoint.py --quick             # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.environment import cpu_threads, environment  # noqa: E402
from benchmarks import measuring  # noqa: E402
from benchmarks.measuring import RSS  # noqa: E402

GIB = 2**30
GOALS = {"init": ("GiB/s", 0.5), "save": ("vs np.save", 0.8), "restore": ("vs np.load", 0.8), "rss": ("x state", 1.3)}


def timed(fn: Callable[[], Any]) -> tuple[Any, float, int]:
    """Runs `fn`; returns (result, seconds, peak RSS bytes above the RSS before it)."""
    gc.collect()
    RSS.reset()
    base = RSS.current()
    t0 = time.perf_counter()
    out = fn()
    seconds = time.perf_counter() - t0
    return out, seconds, RSS.peak() - base


def _sync_dir(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def numpy_baseline(arrays: dict[str, np.ndarray], directory: str) -> dict[str, float]:
    """np.save (+ fsync) and np.load of the same arrays: seconds."""
    path = os.path.join(directory, "numpy")
    os.makedirs(path)

    def save():
        for k, a in arrays.items():
            np.save(os.path.join(path, k), a)
        _sync_dir(path)

    _, save_s, _ = timed(save)
    _, load_s, _ = timed(lambda: [np.load(os.path.join(path, k + ".npy")) for k in arrays])
    shutil.rmtree(path)
    return {"np_save_s": save_s, "np_load_s": load_s}


def run_case(name: str, plan, directory: str) -> dict[str, Any]:
    """Init, save+wait, restore (with checksums) of `plan`'s state; numpy's save/load of the same arrays."""
    import jax

    import sparse_embed as se

    state, init_s, init_rss = timed(lambda: jax.block_until_ready(se.init_tables(plan, jax.random.key(0))))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    path = os.path.join(directory, name)

    def save(state=state):
        with se.CheckpointManager(path) as m:
            m.save(1, plan, state)
            m.wait()

    _, save_s, save_rss = timed(save)
    _, sync_s, _ = timed(lambda: _sync_dir(path))  # what np.save's timing includes: the data on disk
    host = {f"{s}_{k}": np.asarray(a) for s, v in state.items() for k, a in [("table", v.table), *v.slots.items()]}
    del state
    gc.collect()
    baseline = numpy_baseline(host, directory)
    del host
    gc.collect()
    restored, restore_s, restore_rss = timed(lambda: jax.block_until_ready(se.restore_embeddings(plan, path)))
    del restored
    shutil.rmtree(path)
    return {"name": name, "state_bytes": nbytes, "init_s": init_s, "save_s": save_s, "sync_s": sync_s,
            "restore_s": restore_s,
            **baseline, "rss_over_state": {"init": init_rss / nbytes, "save": save_rss / nbytes,
                                           "restore": restore_rss / nbytes}}


def goals(r: dict[str, Any]) -> list[tuple[str, float, float]]:
    """(what, value, goal) of the issue's goals for one case."""
    gib = r["state_bytes"] / GIB
    return [("init GiB/s", gib / r["init_s"], 0.5),
            ("save throughput / np.save", r["np_save_s"] / r["save_s"], 0.8),
            ("save+fsync / np.save+fsync", r["np_save_s"] / (r["save_s"] + r["sync_s"]), 0.8),
            ("restore throughput / np.load", r["np_load_s"] / r["restore_s"], 0.8),
            *((f"{op} peak RSS / state", r["rss_over_state"][op], 1.3) for op in ("init", "save", "restore"))]


def report(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'case':<26}{'state GiB':>10}{'init s':>9}{'save s':>9}{'+fsync':>8}{'np.save s':>10}{'restore s':>10}"
             f"{'np.load s':>10}{'RSS/state init/save/restore':>30}"]
    for r in rows:
        rss = r["rss_over_state"]
        lines.append(f"{r['name']:<26}{r['state_bytes'] / GIB:10.2f}{r['init_s']:9.2f}{r['save_s']:9.2f}{r['sync_s']:8.2f}"
                     f"{r['np_save_s']:10.2f}{r['restore_s']:10.2f}{r['np_load_s']:10.2f}"
                     f"{rss['init']:12.2f}{rss['save']:9.2f}{rss['restore']:9.2f}")
    lines.append("")
    for r in rows:
        for what, value, goal in goals(r):
            ok = value >= goal if "RSS" not in what else value <= goal
            lines.append(f"  {r['name']:<24} {what:<30} {value:7.2f}  goal {'<=' if 'RSS' in what else '>='} "
                         f"{goal}  {'pass' if ok else 'FAIL'}")
    return "\n".join(lines)


def demo_plan():
    """The DLRM demo's plan (its default sizes), on one device."""
    import jax

    import sparse_embed as se
    from sparse_embed.examples import dlrm

    args = dlrm.parse_args([])
    optimizer = se.optimizers.Adagrad(args.embedding_lr, initial_accumulator_value=args.embedding_init_acc)
    feats = dlrm.feature_specs(dlrm.DataConfig(), args.batch_size, args.embedding_dim, optimizer,
                               args.embedding_init_std)
    return se.plan(feats, jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",)))


# ----------------------------------------------------------------- each phase in a fresh process
PHASES = ("save", "np.save", "restore", "np.load")
CACHE_MODES = {
    "warm": "warm: each read phase's files read once just before it (as right after a save), the other "
            "system's evicted",
    "cold": "cold: each read phase's files, and the other system's, evicted from this machine's page cache just "
            "before it (fsync + posix_fadvise DONTNEED; a VM host's cache may still hold them)",
}


def _plans(rows: int, dim: int, demo: bool) -> dict[str, Any]:
    import jax

    import sparse_embed as se

    table = se.TableSpec("t", rows, dim, optimizer=se.optimizers.Adagrad(0.1))
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    plans = {f"{rows:,} x {dim} Adagrad": se.plan({"f": se.FeatureSpec("f", table, 8)}, mesh)}
    if demo:
        plans["DLRM demo"] = demo_plan()
    return plans


def _host_arrays(state) -> dict[str, np.ndarray]:
    return {f"{s}_{k}": np.asarray(a) for s, v in state.items() for k, a in [("table", v.table), *v.slots.items()]}


def _files(path: str) -> list[str]:
    return sorted(os.path.join(root, f) for root, _, files in os.walk(path) for f in files)


def page_cache(path: str, mode: str) -> None:
    """Puts the files under `path` in the page-cache state `mode`: "warm" (read once) or "cold" (evicted)."""
    buf = bytearray(1 << 24)
    for name in _files(path):
        with open(name, "rb", buffering=0) as f:
            if mode == "warm":
                while f.readinto(buf):
                    pass
            else:
                os.fsync(f.fileno())
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def _usage() -> dict[str, float]:
    """This process's CPU seconds (user, system), faults, and bytes read from storage (not the page cache)."""
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    out = {"cpu_user_s": r.ru_utime, "cpu_sys_s": r.ru_stime, "minor_faults": r.ru_minflt,
           "major_faults": r.ru_majflt}
    try:
        with open("/proc/self/io") as f:
            out["disk_read_bytes"] = next(int(x.split()[1]) for x in f if x.startswith("read_bytes:"))
    except (OSError, StopIteration):
        pass
    return out


def _since(before: dict[str, float]) -> dict[str, float]:
    now = _usage()
    return {k: now[k] - v for k, v in before.items()}


def run_phase(phase: str, case: str, path: str, rows: int, dim: int) -> dict[str, Any]:
    """One phase of one case, in this (fresh) process; `path`: its checkpoint or `.npy` directory. Besides its
    seconds: the CPU time, faults and bytes read from disk of its timed part (`usage`)."""
    t = time.perf_counter()
    if phase in ("save", "np.save", "restore"):
        import jax

        import sparse_embed as se
        from sparse_embed.io import checkpoint, restoring  # noqa: F401 - what the first save or restore imports
    import_s = time.perf_counter() - t
    out: dict[str, Any] = {"phase": phase, "case": case, "import_s": import_s}
    if phase == "np.load":
        names = sorted(os.listdir(path))
        before = _usage()
        loaded, out["seconds"], rss = timed(lambda: [np.load(os.path.join(path, n)) for n in names])
        out.update(usage=_since(before), state_bytes=sum(a.nbytes for a in loaded), rss=rss)
        return out
    t = time.perf_counter()
    jax.devices()
    out["backend_s"] = time.perf_counter() - t
    if phase == "restore":  # from here on, what a user's restore pays
        gc.collect()
        RSS.reset()
        before = _usage()
        base, t0 = RSS.current(), time.perf_counter()
        jax.devices()
        plan = _plans(rows, dim, case == "demo")[_case_name(rows, dim, case)]
        t1 = time.perf_counter()
        restored = jax.block_until_ready(se.restore_embeddings(plan, path))
        t2 = time.perf_counter()
        out.update(seconds=out["backend_s"] + t2 - t0, plan_s=t1 - t0, restore_call_s=t2 - t1, usage=_since(before),
                   rss=RSS.peak() - base, state_bytes=sum(x.nbytes for x in jax.tree.leaves(restored)))
        return out
    plan = _plans(rows, dim, case == "demo")[_case_name(rows, dim, case)]
    state, init_s, init_rss = timed(lambda: jax.block_until_ready(se.init_tables(plan, jax.random.key(0))))
    out["state_bytes"] = sum(x.nbytes for x in jax.tree.leaves(state))
    if phase == "save":
        def save():
            with se.CheckpointManager(path) as m:
                m.save(1, plan, state)
                m.wait()

        before = _usage()
        _, out["seconds"], out["rss"] = timed(save)
        out["usage"] = _since(before)
        out.update(sync_s=timed(lambda: _sync_dir(path))[1], init_s=init_s, init_rss=init_rss)
        return out
    host = _host_arrays(state)
    os.makedirs(path, exist_ok=True)

    def np_save():
        for k, a in host.items():
            np.save(os.path.join(path, k), a)
        _sync_dir(path)

    before = _usage()
    _, out["seconds"], out["rss"] = timed(np_save)
    out["usage"] = _since(before)
    return out


def _case_name(rows: int, dim: int, case: str) -> str:
    return "DLRM demo" if case == "demo" else f"{rows:,} x {dim} Adagrad"


def _subprocess(phase: str, case: str, path: str, rows: int, dim: int) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--phase", phase, "--case", case, "--path", path,
           "--rows", str(rows), "--dim", str(dim)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"phase {phase} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def run_separate(case: str, rows: int, dim: int, directory: str, repeats: int, cache: str) -> dict[str, Any]:
    """`repeats` rounds of the four phases, each in a fresh process, ours and numpy's interleaved."""
    rounds = []
    for r in range(repeats):
        ck, npy = os.path.join(directory, f"ck{r}"), os.path.join(directory, f"npy{r}")
        got = {}
        pairs = [[("save", ck), ("np.save", npy)], [("restore", ck), ("np.load", npy)]]
        for pair in pairs:
            for phase, path in (pair if r % 2 == 0 else pair[::-1]):
                if phase in ("restore", "np.load"):  # the other's files out of memory, then this one's as asked
                    page_cache(npy if path == ck else ck, "cold")
                    page_cache(path, cache)
                got[phase] = _subprocess(phase, case, path, rows, dim)
                print(f"  round {r + 1} {phase:<8} {got[phase]['seconds']:7.2f} s "
                      f"(imports {got[phase]['import_s']:.2f} s apart)", file=sys.stderr, flush=True)
        shutil.rmtree(ck)
        shutil.rmtree(npy)
        s, ns, rs, nl = got["save"], got["np.save"], got["restore"], got["np.load"]
        rounds.append({
            "first": "ours" if r % 2 == 0 else "numpy", "state_bytes": s["state_bytes"], "init_s": s["init_s"],
            "save_s": s["seconds"], "sync_s": s["sync_s"], "np_save_s": ns["seconds"], "restore_s": rs["seconds"],
            "restore_parts": {k: rs[k] for k in ("backend_s", "plan_s", "restore_call_s")},
            "np_load_s": nl["seconds"], "import_s": {p: got[p]["import_s"] for p in PHASES},
            "usage": {p: got[p]["usage"] for p in PHASES},
            "rss_over_state": {"init": s["init_rss"] / s["state_bytes"], "save": s["rss"] / s["state_bytes"],
                               "restore": rs["rss"] / rs["state_bytes"]},
        })
    return {"name": _case_name(rows, dim, case), "state_bytes": rounds[0]["state_bytes"], "rounds": rounds}


def report_separate(cases: list[dict[str, Any]], cache: str) -> str:
    lines = [f"each phase in a fresh process; page cache {CACHE_MODES[cache]}",
             f"{'case':<26}{'round':>6}{'init s':>8}{'save s':>8}{'+fsync':>8}{'np.save':>9}{'restore s':>10}"
             f"{'np.load':>9}{'load/rest':>10}{'RSS/state init/save/restore':>30}"]
    for c in cases:
        for i, r in enumerate(c["rounds"]):
            rss = r["rss_over_state"]
            lines.append(f"{c['name'] if i == 0 else '':<26}{i + 1:>6}{r['init_s']:8.2f}{r['save_s']:8.2f}"
                         f"{r['sync_s']:8.2f}{r['np_save_s']:9.2f}{r['restore_s']:10.2f}{r['np_load_s']:9.2f}"
                         f"{r['np_load_s'] / r['restore_s']:9.2f}x{rss['init']:12.2f}{rss['save']:9.2f}"
                         f"{rss['restore']:9.2f}")
        for i, r in enumerate(c["rounds"]):
            u = {p: (r["usage"][p]["cpu_user_s"], r["usage"][p]["cpu_sys_s"],
                     r["usage"][p].get("disk_read_bytes", 0) / GIB) for p in ("restore", "np.load")}
            lines.append(f"{'':<26}round {i + 1}: CPU s (user+sys) / GiB read from disk: restore "
                         "{:.2f}+{:.2f} / {:.2f}, np.load {:.2f}+{:.2f} / {:.2f}".format(*u["restore"], *u["np.load"]))
        parts = [r["restore_parts"] for r in c["rounds"]]
        lines.append(f"{'':<26}restore = backend start {min(p['backend_s'] for p in parts):.2f}-"
                     f"{max(p['backend_s'] for p in parts):.2f} s + plan + restore_embeddings; imports apart: "
                     f"restore {min(r['import_s']['restore'] for r in c['rounds']):.2f} s, np.load "
                     f"{min(r['import_s']['np.load'] for r in c['rounds']):.2f} s")
    lines.append("")
    for c in cases:
        per_round = [goals(r) for r in c["rounds"]]  # each round is a case of `goals`
        for k, (what, _, goal) in enumerate(per_round[0]):
            values = [g[k][1] for g in per_round]
            ok = [v <= goal if "RSS" in what else v >= goal for v in values]
            lines.append(f"  {c['name']:<24} {what:<30} median {float(np.median(values)):5.2f} (rounds: "
                         f"{' / '.join(f'{v:.2f}' for v in values)})  goal {'<=' if 'RSS' in what else '>='} {goal}  "
                         f"{'met' if all(ok) else 'MISSED'}: met in {sum(ok)} of {len(ok)} rounds")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--demo", action="store_true", help="also the DLRM demo's state")
    p.add_argument("--quick", action="store_true", help="a 10^5-row table: a smoke run")
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--repeats", type=int, default=3, help="rounds of the four phases (fresh processes)")
    p.add_argument("--cache", choices=sorted(CACHE_MODES), default="warm",
                   help="page cache of the files before each read phase (fresh processes)")
    p.add_argument("--in-process", action="store_true", help="every phase in this process (the old behaviour)")
    p.add_argument("--phase", choices=PHASES, help=argparse.SUPPRESS)  # one phase, in this process
    p.add_argument("--case", choices=("table", "demo"), default="table", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    rows = 100_000 if args.quick else args.rows
    if args.phase:
        out = run_phase(args.phase, args.case, args.path, rows, args.dim)
        print("RESULT " + json.dumps(out), flush=True)
        return out
    if args.in_process:
        plans = _plans(rows, args.dim, args.demo)
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            rows_out = [run_case(name, plan, directory) for name, plan in plans.items()]
        results = {"env": environment(argv, cpu_threads(), script="benchmarks/checkpoint.py"),
                   "mode": "in-process", "cases": rows_out}
        print(report(rows_out))
    else:
        env = environment(argv, cpu_threads(), script="benchmarks/checkpoint.py")
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            cases = [run_separate(case, rows, args.dim, directory, args.repeats, args.cache)
                     for case in (("table", "demo") if args.demo else ("table",))]
        results = {"env": env, "mode": "fresh process per phase", "page_cache": CACHE_MODES[args.cache],
                   "cases": cases}
        print(report_separate(cases, args.cache))
    if args.json:
        measuring.write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
