"""`sparse-embed`: inspect, verify and convert checkpoints, and print plans, from the command line.

    sparse-embed inspect CKPT
    sparse-embed verify CKPT [--step N]
    sparse-embed convert SRC DST [--devices N | --serving [--dtype bf16|int8|int4]] [--step N]
    sparse-embed plan MODULE:NAME [--devices 8] [--placement auto] [--memory-budget 2GiB]

CKPT / SRC is a checkpoint manager directory (its latest complete step is
used) or one step directory. `plan` prints `EmbeddingPlan.describe()` for
the FeatureSpecs that `MODULE.NAME` holds (or returns, if callable), on N
simulated devices. Errors print one line to stderr and exit 1, and a bad
command line (an argument out of range, a missing one) prints one line and
exits 2, as argparse does; `verify` exits 1 when any array is corrupt.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping

from sparse_embed._argtypes import number

PROG = "sparse-embed"
DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


def _inspect(args) -> None:
    from sparse_embed.io.ckpt_format import resolve
    from sparse_embed.io.orbax_items import read_info

    step_dir = resolve(args.ckpt, args.step)
    info = read_info(step_dir)
    print(f"checkpoint {step_dir}")
    print(f"kind {info.kind}, step {info.step}, saved on {info.num_shards} device(s), user pytree: "
          f"{'yes' if info.has_user else 'no'}")
    print("stacking: " + "; ".join("[" + ", ".join(g) + "]" for g in info.stacking))
    print(f"{'table':<20} {'shape':<18} {'dtype':<9} {'combiner':<8} {'optimizer':<16} {'slots':<28} memory")
    for t in info.tables:
        slots = ", ".join(f"{k}[{w}]" for k, w in t.slots) or "-"
        shape = f"[{t.vocabulary_size}, {t.embedding_dim}]"
        print(f"{t.name:<20} {shape:<18} {t.dtype:<9} {t.combiner:<8} {t.optimizer:<16} {slots:<28} {_human(t.nbytes)}")
        if t.dynamic:
            print(f"  raw ids: {_occupancy(step_dir, info, t)}")
    print(f"total {_human(sum(t.nbytes for t in info.tables))} in {len(info.tables)} table(s)")


def _occupancy(step_dir: str, info, t) -> str:
    """"n of capacity rows used (p%), m ids waiting" of a raw-id table."""
    from sparse_embed.io.restoring import read_host_array
    from sparse_embed.io.id_checkpoint import IDS_KEY, PENDING

    used = int((read_host_array(step_dir, info, t.name, IDS_KEY)[:, 0] != -1).sum())
    text = f"{used} of {t.vocabulary_size} rows used ({100 * used / max(t.vocabulary_size, 1):.1f}%)"
    if info.kind == "training":
        waiting = int((read_host_array(step_dir, info, t.name + PENDING, IDS_KEY)[:, 0] != -1).sum())
        text += f", {waiting} ids waiting for admission"
    return text


@contextlib.contextmanager
def _bars(desc: str) -> Iterator[Callable[..., Iterable]]:
    """A `progress=` wrapper drawing tqdm bars titled `desc`, each closed on leaving.

    Closed also when the command fails, so that its error prints on a line
    of its own, not after a bar left half drawn (and redrawn below it at exit).
    """
    from tqdm import tqdm

    bars = []

    def progress(it, **kw):
        bars.append(tqdm(it, desc=desc, **kw))
        return bars[-1]

    try:
        yield progress
    finally:
        for bar in bars:
            bar.close()


def _verify(args) -> int:
    from sparse_embed.io.verify import verify_checkpoint

    with _bars("verifying") as progress:
        v = verify_checkpoint(args.ckpt, step=args.step, progress=progress)
    for problem in v.problems:
        print(f"CORRUPT: {' '.join(problem.split())}")
    if not v.verified:
        print(f"{v.step_dir}: written without checksums (an older sparse_embed): {v.checked} arrays read, "
              "their values cannot be checked")
    elif v.ok:
        print(f"{v.step_dir}: all {v.checked} arrays match their checksums")
    elif not v.checked:
        print(f"{v.step_dir}: corrupt: its metadata cannot be read, so none of its arrays can be checked",
              file=sys.stderr)
    else:
        print(f"{v.step_dir}: {len(v.problems)} of {v.checked} arrays are corrupt", file=sys.stderr)
    return 0 if v.ok else 1


def _convert(args) -> None:
    from sparse_embed.io.convert import convert_checkpoint

    with _bars("converting") as progress:
        out = convert_checkpoint(args.src, args.dst, devices=args.devices, serving=args.serving, dtype=args.dtype,
                                 step=args.step, progress=progress)
    print(f"wrote {out}")


_positive_int = number(int, 1, what="a positive integer")  # a count of devices
MAX_SIMULATED = 4096  # `plan --devices`: XLA starts every simulated CPU device (100k took minutes, then failed)


def _simulated_count(text: str) -> int:
    n = _positive_int(text)
    if n > MAX_SIMULATED:
        raise argparse.ArgumentTypeError(f"at most {MAX_SIMULATED} simulated devices, got {text!r}")
    return n
_step = number(int, 0, what="a step number (an integer >= 0)")  # a checkpoint step
_positive_float = number(float, 0, strict=True, what="a finite number above 0")  # e.g. ids per sample


def _bytes(text: str) -> int:
    """An argparse type: "2GiB" (2 * 1024**3), "2GB" (2e9), "512 MiB", "1e9" -> bytes, at least 1."""
    m = re.fullmatch(r"\s*((?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)\s*([KMGT]i?B|B)?\s*", text)
    unit = (m.group(2) or "B") if m else "B"
    size = float(m.group(1)) * (1024 if "i" in unit else 1000) ** "BKMGT".index(unit[0]) if m else math.nan
    if not (math.isfinite(size) and size >= 1):
        raise argparse.ArgumentTypeError(f"not a size of at least 1 byte: {text!r} (e.g. 2GiB, 512MiB, 1e9)")
    return int(size)


@contextlib.contextmanager
def _simulated_devices(n: int) -> Iterator[None]:
    """`XLA_FLAGS` asking for `n` CPU devices while JAX starts its backends, restored after.

    XLA reads the flag when the first backend starts (the first `jax.devices()`
    or computation), not at `import jax`, and importing sparse_embed starts
    none; restoring it keeps a caller's environment (and its subprocesses') as it was.
    """
    old = os.environ.get("XLA_FLAGS")
    others = re.sub(rf"{DEVICE_COUNT_FLAG}=\S*", "", old or "")
    os.environ["XLA_FLAGS"] = f"{others} {DEVICE_COUNT_FLAG}={n}".strip()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("XLA_FLAGS", None)
        else:
            os.environ["XLA_FLAGS"] = old


def _load_features(target: str):
    """The list or dict of FeatureSpecs that `MODULE:NAME` holds (or returns, if callable).

    Whatever the user's module raises, and anything but FeatureSpecs, becomes a
    ValueError naming `target`, which `main` prints as one line.
    """
    from sparse_embed.core.specs import FeatureSpec

    module, _, name = target.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        obj = getattr(importlib.import_module(module), name or "features")
        obj = obj() if callable(obj) else obj
    except Exception as e:  # the user's code: any error is an error of the argument  # noqa: BLE001
        raise ValueError(f"cannot load the features {target!r}: {type(e).__name__}: {e}") from None
    want = f"{target!r} must name a non-empty list or dict of FeatureSpecs (or a function returning one), got"
    specs = list(obj.values()) if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else None
    if specs is None:
        raise ValueError(f"{want} {type(obj).__name__} {obj!r:.60}")
    if not specs:
        raise ValueError(f"{want} an empty {type(obj).__name__}")
    bad = next((f for f in specs if not isinstance(f, FeatureSpec)), None)
    if bad is not None:
        raise ValueError(f"{want} a {type(obj).__name__} holding {type(bad).__name__} {bad!r:.60}")
    return obj


def _plan(args) -> None:
    import jax
    import numpy as np

    import sparse_embed as se

    with _simulated_devices(args.devices):  # before the user's module, which may start a backend
        features = _load_features(args.features)
        devices = jax.devices()
        devices = devices if len(devices) >= args.devices else jax.devices("cpu")
    if len(devices) < args.devices:
        raise ValueError(f"--devices {args.devices}, but JAX had started with {len(devices)} devices already")
    mesh = jax.sharding.Mesh(np.array(devices[: args.devices]), ("device",))
    plan = se.plan(features, mesh, placement=args.placement, memory_budget=args.memory_budget,
                   ids_per_sample=args.ids_per_sample)
    print(plan.describe())


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is reported as one line on stderr (exit 2), like every other error."""

    def error(self, message: str):
        self.exit(2, f"{PROG}: error: {' '.join(message.split())}\n")


def parser() -> argparse.ArgumentParser:
    from sparse_embed.core import placements  # light: the registry only (no jax backend, no orbax)

    p = _Parser(prog=PROG, description="Inspect, verify and convert sparse_embed checkpoints; print plans.")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="tables, shapes, dtypes, stacking and memory of a checkpoint")
    i.add_argument("ckpt")
    i.add_argument("--step", type=_step, default=None, help="step to read (default: the latest complete one)")
    i.set_defaults(fn=_inspect)
    v = sub.add_parser("verify", help="read every array of a step and check it against its checksum")
    v.add_argument("ckpt")
    v.add_argument("--step", type=_step, default=None, help="step to check (default: the latest complete one)")
    v.set_defaults(fn=_verify)
    c = sub.add_parser("convert", help="rewrite a training checkpoint in the current format, or export a serving one")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--devices", type=_positive_int, default=None,
                   help="record N devices as its mesh size (it restores onto any mesh)")
    c.add_argument("--serving", action="store_true", help="write a serving checkpoint: tables only, no slots")
    c.add_argument("--dtype", default=None,
                   choices=["bf16", "bfloat16", "f16", "float16", "f32", "float32", "int8", "int4"],
                   help="table dtype of a serving export (int8 / int4: row-wise quantized)")
    c.add_argument("--step", type=_step, default=None, help="step to read (default: the latest complete one)")
    c.set_defaults(fn=_convert)
    pl = sub.add_parser("plan", help="where each table of a model's features lives, its memory and traffic")
    pl.add_argument("features", help="MODULE:NAME of a list or dict of FeatureSpecs, or of a function returning one")
    pl.add_argument("--devices", type=_simulated_count, default=8, help="devices of the mesh (simulated on CPU)")
    pl.add_argument("--placement", default=placements.AUTO, choices=[placements.AUTO, *placements.names()])
    pl.add_argument("--memory-budget", type=_bytes, default=None, help="bytes per device, e.g. 2GiB")
    pl.add_argument("--ids-per-sample", type=_positive_float, default=None, help="the cost model's ids per sample")
    pl.set_defaults(fn=_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if args.command == "convert" and args.dtype and not args.serving:
        p.error("argument --dtype: applies to --serving exports only")
    if args.command == "convert" and args.devices is not None and args.serving:
        p.error("argument --devices: applies to training checkpoints only (a --serving export is read on one device)")
    try:
        return args.fn(args) or 0
    except BrokenPipeError:  # stdout's reader left (`sparse-embed inspect CKPT | head`): not an error to report
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor at exit, when Python flushes stdout
        return 1
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        msg = " ".join(str(e).split())
        print(f"{PROG}: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
