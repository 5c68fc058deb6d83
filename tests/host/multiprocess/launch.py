"""Starts test scripts as separate processes, and N local workers under jax.distributed (bounded, kills all on
failure).

`start` runs a script (`runpy`, as `python <script> <args...>` would) in a process forked from a server that has
already imported jax, grain, orbax, optax and sparse_embed but started no backend (multiprocessing's "forkserver"):
a fresh process without a second or more of imports each time, which is most of what the kill-and-resume tests'
many restarts cost. The environment is the script's own (XLA flags are read when the backend starts, after the
fork; the few `JAX_*` settings jax reads at import are applied as config), stdout and stderr go to a log file,
and SIGKILL kills it like any process. A test that needs a truly fresh interpreter (what importing loads, flags
read at import) must use subprocess instead.

Each worker of `run_workers` runs `<script> <args...>` that way with the environment variables
SE_COORDINATOR (127.0.0.1:<free port>), SE_NUM_PROCESSES and SE_PROCESS_ID,
`JAX_PLATFORMS=cpu` and `XLA_FLAGS` with `--xla_force_host_platform_device_count=<devices_per_process>`;
it calls `worker_init()` (below) first.
"""

from __future__ import annotations

import atexit
import faulthandler
import multiprocessing
import os
import runpy
import signal
import socket
import sys
import tempfile
import time
from typing import Callable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))  # the repository: tests/host/multiprocess/..
# imported once by the fork server; nothing in them starts a backend or a thread that a fork would lose. The demo's
# heavy imports too (a second less for each of its runs in tests/test_dlrm_resume.py), not the demo itself: runpy
# warns when the module it runs was imported before.
PRELOAD = ["numpy", "jax", "jax.numpy", "optax", "grain", "orbax.checkpoint", "sparse_embed", "sparse_embed.data",
           "sparse_embed.io.checkpoint", "sparse_embed.offload", "flax.linen", "tqdm", "sparse_embed.flax.linen"]
# settings jax reads from the environment at import (already done by the server): applied as config instead
_JAX_ENV = {"JAX_PLATFORMS": ("jax_platforms", str), "JAX_COMPILATION_CACHE_DIR": ("jax_compilation_cache_dir", str),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": ("jax_persistent_cache_min_compile_time_secs", float),
            "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": ("jax_persistent_cache_min_entry_size_bytes", int),
            "JAX_DISABLE_MOST_OPTIMIZATIONS": ("jax_disable_most_optimizations",
                                               lambda v: v.strip().lower() in ("1", "y", "yes", "t", "true", "on"))}
# passed on to scripts: the suite compiles every process of a test alike (tests/conftest.py)
_PASSED_ON = ("JAX_DISABLE_MOST_OPTIMIZATIONS",)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkersFailed(AssertionError):
    pass


def worker_env(devices: int, **extra: str) -> dict[str, str]:
    """This process's environment without its XLA/JAX/SE settings but those `_PASSED_ON`, for a script on `devices`
    CPU devices."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XLA_", "JAX_", "SE_")) or k in _PASSED_ON}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} "
                         "--xla_cpu_copy_insertion_use_region_analysis=true",
               PYTHONPATH=os.pathsep.join([HERE, SRC, env.get("PYTHONPATH", "")]).rstrip(os.pathsep), **extra)
    return env


def _forked_main(script: str, args: list[str], env: dict[str, str], log: str) -> None:
    """In the forked process: the script's environment, output and argv, then the script as `__main__`."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for std in (1, 2):
        os.dup2(fd, std)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `Child.dump_stacks`: where a hung script waits
    os.environ.clear()
    os.environ.update(env)
    import jax

    for key, value in env.items():
        if key.startswith("JAX_"):
            if key not in _JAX_ENV:
                raise ValueError(f"{key} is read by jax at import: the fork server cannot apply it; add it to _JAX_ENV")
            name, kind = _JAX_ENV[key]
            jax.config.update(name, kind(value))
    sys.path[:0] = [os.path.dirname(os.path.abspath(script)), *env.get("PYTHONPATH", "").split(os.pathsep)]
    sys.argv = [script, *args]
    try:
        if script.startswith("-m "):
            runpy.run_module(script[3:], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()  # a forked process ends with os._exit: jax.distributed's shutdown, open files
        sys.stdout.flush()
        sys.stderr.flush()


class Child:
    """A script running in a forked process (`start`); its output is the log file."""

    def __init__(self, script: str, args: list[str], env: dict[str, str], log: str) -> None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts (the first Child of a process)
        self.log = log
        self.process = ctx.Process(target=_forked_main, args=(script, args, env, log), daemon=True)
        self.process.start()

    def lines(self, poll: float = 0.02) -> Iterator[str]:
        """Every line of the output as it is written, until the process has ended and all is read."""
        with open(self.log, "a+") as f:
            f.seek(0)
            partial = ""
            while True:
                ended = not self.process.is_alive()
                chunk = f.read()
                partial += chunk
                *whole, partial = partial.split("\n")
                yield from (line + "\n" for line in whole)
                if ended and not chunk:
                    if partial:
                        yield partial
                    return
                if not chunk:
                    time.sleep(poll)

    def output(self) -> str:
        with open(self.log) as f:
            return f.read()

    def kill(self) -> None:
        self.process.kill()

    def dump_stacks(self) -> None:
        """Every thread's Python stack into the log (a script that timed out: where it waits)."""
        if self.poll() is None:
            os.kill(self.process.pid, signal.SIGUSR1)

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int | None:
        self.process.join(timeout)
        return self.process.exitcode


def start(script: str, args: list[str], env: dict[str, str], log: str) -> Child:
    """Runs `script` (a path, or "-m module") with `args` in a forked process; output appended to `log`."""
    return Child(script, args, env, log)


def run_until(procs: list[Child], stop: Callable[[str], bool] | None = None, timeout: float = 240.0) -> bool:
    """Follows process 0's output: True once every process has ended with exit code 0 (an AssertionError with
    their outputs if one did not, or is still running after `timeout`), or False as soon as `stop(line)` holds,
    after SIGKILLing every process. No process is left running either way."""
    killed = False
    try:
        for line in procs[0].lines():
            if stop is not None and stop(line):
                for p in procs:
                    p.kill()
                killed = True
                break
        codes = [p.wait(timeout) for p in procs]
        if not killed and any(c != 0 for c in codes):
            raise AssertionError(f"exit codes {codes}:" + "".join(f"\n--- process {i} ---\n" + p.output()[-6000:]
                                                                  for i, p in enumerate(procs)))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return not killed


def run_workers(script: str, num_processes: int, args: list[str], *, devices_per_process: int,
                timeout: float = 120.0) -> list[str]:
    """Runs the workers; returns their outputs. Raises WorkersFailed (with every output) on failure or timeout."""
    port = free_port()
    logs = tempfile.TemporaryDirectory(prefix="workers_")
    procs = [start(script, args, worker_env(devices_per_process, SE_COORDINATOR=f"127.0.0.1:{port}",
                                            SE_NUM_PROCESSES=str(num_processes), SE_PROCESS_ID=str(i)),
                   os.path.join(logs.name, f"worker{i}.log"))
             for i in range(num_processes)]
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
                for p in procs:
                    p.dump_stacks()
                time.sleep(1)
            else:
                time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    outputs = [p.output() for p in procs]
    logs.cleanup()
    if why is not None:
        text = "\n".join(f"----- worker {i} (exit {p.poll()}) -----\n{o[-6000:]}"
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
