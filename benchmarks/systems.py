"""The systems side by side: sparse_embed per (kernel, device count) and the peers, on the same problem."""

from __future__ import annotations

import argparse
import dataclasses
import functools
from typing import Any, Callable

import numpy as np

from benchmarks import peers
from benchmarks.environment import make_mesh
from benchmarks.measuring import Runner, free_memory, measure
from benchmarks.ours import Setup, prepare_forward, prepare_sparse_embed, prepare_train
from benchmarks.peers import FORWARD
from benchmarks.workload import Workload


AGREEMENT_TOLERANCE = 1e-5  # max |difference| of forward outputs and of the tables after one SGD step (--check)


def prepare_peer(peer: peers.Peer, problem: peers.Problem, threads: int, measurement: str):
    """A peer's runner (and state bytes) for one measurement, on fresh tables."""
    s = peer.build(measurement, problem, threads)
    return Runner(s.call, s.state, s.batches), {"state_bytes": s.state_bytes}


KERNELS = ("generic", "native")  # sparse_embed's lookup kernels, each its own row group (see docs/lookup.md)


def kernel_missing(kernel: str) -> str:
    """Why sparse_embed cannot run `kernel` here ("" if it can)."""
    from sparse_embed.core.kernels import native_cpu

    if kernel == "native" and not native_cpu.available():
        return "not built (no C++ extension: pip install with a C++17 compiler)"
    return ""


def primary_kernel(kernels: tuple[str, ...]) -> str:
    """The kernel the targets, the agreement check and the vocabulary test use: native if it runs."""
    runnable = [k for k in kernels if not kernel_missing(k)]
    return "native" if "native" in runnable else (runnable or ["generic"])[0]


@dataclasses.dataclass
class System:
    """One row group of the comparison: sparse_embed with one kernel on a mesh, or a peer."""

    key: str
    label: str
    measurements: tuple[str, ...]
    prepare: Callable[[str], tuple[Runner, dict[str, Any]]] | None  # None: not available
    status: str = "ok"
    slow_train: bool = False
    devices: int | None = None  # sparse_embed's mesh; peers: one process
    kernel: str | None = None  # sparse_embed's lookup kernel; peers: None

    def steps(self, measurement: str, args: argparse.Namespace) -> tuple[int, int]:
        """(timed steps, warmup steps) for a measurement: fewer for slow train steps."""
        if self.slow_train and measurement != FORWARD:
            return min(args.steps, args.slow_steps), min(args.warmup, 1)
        return args.steps, args.warmup


def sparse_embed_key(kernel: str, devices: int = 1) -> str:
    return f"sparse_embed_{kernel}" + ("" if devices == 1 else f"_{devices}dev")


def make_systems(args: argparse.Namespace, w: Workload, problem: peers.Problem, threads: int,
                 measurements: tuple[str, ...]) -> list[System]:
    """sparse_embed per kernel and device count, then the peers asked for (unavailable ones without a prepare)."""
    systems = []
    for kernel in args.kernels:
        missing = kernel_missing(kernel)
        for n in args.devices:
            wn, mesh = dataclasses.replace(w, devices=n), make_mesh(n)
            prepare = None if missing else functools.partial(prepare_sparse_embed, wn, mesh, problem, args.seed, kernel)
            label = f"sparse_embed {kernel}" + (f" ({n} dev)" if n > 1 else "")
            systems.append(System(sparse_embed_key(kernel, n), label, measurements, prepare, missing or "ok",
                                  devices=n, kernel=kernel))
    for key in args.peers:
        peer = peers.PEERS[key]
        missing = peer.missing()
        prepare = None if missing else functools.partial(prepare_peer, peer, problem, threads)
        systems.append(System(key, peer.label, peer.measurements, prepare, missing or "ok", peer.slow_train))
    return systems


def run_systems(systems: list[System], measurements: list[str], args: argparse.Namespace,
                ids_per_step: int) -> dict[str, Any]:
    """Each measurement for every available system in turn, `args.rounds` times over, each time a share of the
    steps on fresh tables (so a slow stretch of this shared machine falls on every system, not on the one that
    ran then); tables freed between systems."""
    out = {s.key: {"label": s.label, "status": s.status, "devices": s.devices, "kernel": s.kernel, "steps": {}}
           for s in systems}
    measured: dict[tuple[str, str], Any] = {}
    for _ in range(args.rounds):
        for m in measurements:
            for s in systems:
                if s.prepare is None or m not in s.measurements:
                    continue
                steps, warmup = s.steps(m, args)
                steps = -(-steps // args.rounds)  # this round's share
                measured[s.key, m] = measure(functools.partial(s.prepare, m), steps, warmup, ids_per_step,
                                             measured.get((s.key, m)))
                out[s.key]["steps"][m] = measured[s.key, m][1]
                free_memory()
    return out


def _ours_after_one_step(w: Workload, problem: peers.Problem, args: argparse.Namespace, kernel: str):
    """sparse_embed's initial tables, and its forward outputs + tables after one SGD step on batch 0."""
    import sparse_embed as se

    setup = Setup.create(w, "sgd", make_mesh(args.devices[0]), problem, args.seed, kernel)
    names = [f"t{i}" for i in range(w.tables)]
    init = se.unstack_tables(setup.plan, setup.tables)
    forward, _ = prepare_forward(setup)
    pooled = forward.call(forward.state, forward.batches[0])[1]
    outputs = [np.asarray(pooled[f"f{i}"]) for i in range(w.tables)]
    train, _ = prepare_train(setup)
    train.run(1)
    outputs += [np.asarray(se.unstack_tables(setup.plan, train.state)[n]) for n in names]
    return [np.array(init[n]) for n in names], outputs


def _peer_after_one_step(peer: peers.Peer, problem: peers.Problem, threads: int) -> list:
    """A peer's forward outputs + tables after one SGD step on batch 0."""
    s = peer.build(FORWARD, problem, threads)
    outputs = s.pooled(s.call(s.state, s.batches[0])[1])
    s = peer.build("train_sgd", problem, threads)
    runner = Runner(s.call, s.state, s.batches)
    runner.run(1)
    return outputs + s.tables(runner.state)


def check_agreement(w: Workload, problem: peers.Problem, args: argparse.Namespace, threads: int) -> dict[str, float]:
    """Max |difference| of each other kernel and each installed peer from sparse_embed's primary kernel.

    Compared, from the same tables: the forward outputs of the first batch,
    and the tables after one SGD step on it. Raises AssertionError above
    AGREEMENT_TOLERANCE: a benchmark comparing different math would be worthless.
    """
    primary = primary_kernel(args.kernels)
    init, ours = _ours_after_one_step(w, problem, args, primary)
    same_init = dataclasses.replace(problem, init=init)
    others = {sparse_embed_key(k): lambda k=k: _ours_after_one_step(w, same_init, args, k)[1]
              for k in args.kernels if k != primary and not kernel_missing(k)}
    others.update({key: functools.partial(_peer_after_one_step, peers.PEERS[key], same_init, threads)
                   for key in args.peers if not peers.PEERS[key].missing()})
    diffs = {key: max(float(np.max(np.abs(x - y))) for x, y in zip(ours, run())) for key, run in others.items()}
    bad = {k: d for k, d in diffs.items() if not d <= AGREEMENT_TOLERANCE}
    assert not bad, f"forward outputs or SGD-updated tables differ from sparse_embed's: {bad} > {AGREEMENT_TOLERANCE}"
    return diffs
