"""Starts N local worker processes under jax.distributed and waits for them (bounded, kills all on failure).

Each worker runs `python <script> <args...>` with the environment variables
SE_COORDINATOR (127.0.0.1:<free port>), SE_NUM_PROCESSES and SE_PROCESS_ID,
`JAX_PLATFORMS=cpu` and `XLA_FLAGS` with `--xla_force_host_platform_device_count=<devices_per_process>`;
it calls `worker_init()` (below) first.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkersFailed(AssertionError):
    pass


def run_workers(script: str, num_processes: int, args: list[str], *, devices_per_process: int,
                timeout: float = 120.0) -> list[str]:
    """Runs the workers; returns their outputs. Raises WorkersFailed (with every output) on failure or timeout."""
    port = free_port()
    logs, procs = [], []
    src = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # the repository: tests/host/multiprocess/..
    for i in range(num_processes):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "SE_"))}
        env.update(
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=f"--xla_force_host_platform_device_count={devices_per_process} "
                      "--xla_cpu_copy_insertion_use_region_analysis=true",
            SE_COORDINATOR=f"127.0.0.1:{port}",
            SE_NUM_PROCESSES=str(num_processes),
            SE_PROCESS_ID=str(i),
            PYTHONPATH=os.pathsep.join([HERE, src, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            PYTHONUNBUFFERED="1",
        )
        log = tempfile.TemporaryFile(mode="w+")
        logs.append(log)
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    deadline, why = time.monotonic() + timeout, None
    try:
        while why is None:
            codes = [p.poll() for p in procs]
            bad = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                why = f"worker(s) {[i for i, _ in bad]} exited with {[c for _, c in bad]}"
            elif all(c == 0 for c in codes):
                break
            elif time.monotonic() > deadline:
                why = f"timed out after {timeout:g} s (still running: {[i for i, c in enumerate(codes) if c is None]})"
            else:
                time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
    if why is not None:
        text = "\n".join(f"----- worker {i} (exit {p.returncode}) -----\n{o[-6000:]}"
                         for i, (p, o) in enumerate(zip(procs, outputs)))
        raise WorkersFailed(f"{num_processes} workers: {why}\n{text}")
    return outputs


def worker_init() -> tuple[int, int]:
    """In a worker: jax.distributed.initialize from the launcher's environment. Returns (process_id, count)."""
    import sparse_embed  # noqa: F401  (its XLA flags go in before the backend starts)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    n, i = int(os.environ["SE_NUM_PROCESSES"]), int(os.environ["SE_PROCESS_ID"])
    jax.distributed.initialize(coordinator_address=os.environ["SE_COORDINATOR"], num_processes=n, process_id=i,
                               initialization_timeout=60)
    assert jax.process_count() == n and jax.process_index() == i
    return i, n
