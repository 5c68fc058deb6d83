"""`sparse-embed`: inspect, verify and convert checkpoints, and print plans, from the command line.

    sparse-embed inspect CKPT
    sparse-embed verify CKPT [--step N]
    sparse-embed convert SRC DST [--devices N] [--serving] [--dtype bf16]
    sparse-embed plan MODULE:NAME [--devices 8] [--placement auto] [--memory-budget 2GiB]

CKPT / SRC is a checkpoint manager directory (its latest complete step is
used) or one step directory. `plan` prints `EmbeddingPlan.describe()` for
the FeatureSpecs that `MODULE.NAME` holds (or returns, if callable), on N
simulated devices. Errors print one line to stderr and exit 1; `verify`
exits 1 when any array is corrupt.
"""

from __future__ import annotations

import argparse
import os
import re
import sys



def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


def _inspect(args) -> None:
    from sparse_embed.io.checkpoint import read_info, resolve

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
    from sparse_embed.io.checkpoint import read_host_array
    from sparse_embed.io.id_checkpoint import IDS_KEY, PENDING

    used = int((read_host_array(step_dir, info, t.name, IDS_KEY)[:, 0] != -1).sum())
    text = f"{used} of {t.vocabulary_size} rows used ({100 * used / max(t.vocabulary_size, 1):.1f}%)"
    if info.kind == "training":
        waiting = int((read_host_array(step_dir, info, t.name + PENDING, IDS_KEY)[:, 0] != -1).sum())
        text += f", {waiting} ids waiting for admission"
    return text


def _verify(args) -> int:
    from tqdm import tqdm

    from sparse_embed.io.verify import verify_checkpoint

    v = verify_checkpoint(args.ckpt, step=args.step, progress=lambda it, **kw: tqdm(it, desc="verifying", **kw))
    for problem in v.problems:
        print(f"CORRUPT: {' '.join(problem.split())}")
    if not v.verified:
        print(f"{v.step_dir}: written without checksums (an older sparse_embed): {v.checked} arrays read, "
              "their values cannot be checked")
    elif v.ok:
        print(f"{v.step_dir}: all {v.checked} arrays match their checksums")
    else:
        print(f"{v.step_dir}: {len(v.problems)} of {v.checked} arrays are corrupt", file=sys.stderr)
    return 0 if v.ok else 1


def _convert(args) -> None:
    from tqdm import tqdm

    from sparse_embed.io.convert import convert_checkpoint

    out = convert_checkpoint(args.src, args.dst, devices=args.devices, serving=args.serving, dtype=args.dtype,
                             step=args.step, progress=lambda it, **kw: tqdm(it, desc="converting", **kw))
    print(f"wrote {out}")


def _bytes(text: str) -> int:
    """"2GiB", "512 MiB", "1e9" -> bytes."""
    m = re.fullmatch(r"\s*([\d.eE+]+)\s*([KMGT]i?B|B)?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 2GiB, 512MiB, 1e9)")
    unit = (m.group(2) or "B").replace("i", "")
    return int(float(m.group(1)) * 1024 ** "BKMGT".index(unit[0]))


def _plan(args) -> None:
    if "jax" not in sys.modules:  # simulated devices, before JAX starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}").strip()
    import importlib

    import jax
    import numpy as np

    import sparse_embed as se

    module, _, name = args.features.partition(":")
    sys.path.insert(0, os.getcwd())
    try:
        obj = getattr(importlib.import_module(module), name or "features")
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load the features {args.features!r}: {e}") from None
    devices = jax.devices()
    if len(devices) < args.devices:
        raise ValueError(f"--devices {args.devices}, but JAX has {len(devices)} devices")
    mesh = jax.sharding.Mesh(np.array(devices[: args.devices]), ("device",))
    plan = se.plan(obj() if callable(obj) else obj, mesh, placement=args.placement, memory_budget=args.memory_budget,
                   ids_per_sample=args.ids_per_sample)
    print(plan.describe())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparse-embed",
                                description="Inspect, verify and convert sparse_embed checkpoints; print plans.")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="tables, shapes, dtypes, stacking and memory of a checkpoint")
    i.add_argument("ckpt")
    i.add_argument("--step", type=int, default=None, help="step to read (default: the latest complete one)")
    i.set_defaults(fn=_inspect)
    v = sub.add_parser("verify", help="read every array of a step and check it against its checksum")
    v.add_argument("ckpt")
    v.add_argument("--step", type=int, default=None, help="step to check (default: the latest complete one)")
    v.set_defaults(fn=_verify)
    c = sub.add_parser("convert", help="rewrite a training checkpoint in the current format, or export a serving one")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--devices", type=int, default=None, help="record N devices as its mesh size (it restores onto any mesh)")
    c.add_argument("--serving", action="store_true", help="write a serving checkpoint: tables only, no slots")
    c.add_argument("--dtype", default=None, choices=["bf16", "bfloat16", "f16", "float16", "f32", "float32"],
                   help="table dtype of a serving export")
    c.add_argument("--step", type=int, default=None, help="step to read (default: the latest complete one)")
    c.set_defaults(fn=_convert)
    pl = sub.add_parser("plan", help="where each table of a model's features lives, its memory and traffic")
    pl.add_argument("features", help="MODULE:NAME of a list or dict of FeatureSpecs, or of a function returning one")
    pl.add_argument("--devices", type=int, default=8, help="devices of the mesh (simulated on CPU)")
    pl.add_argument("--placement", default="auto", choices=["auto", "row", "table", "replicated", "column"])
    pl.add_argument("--memory-budget", type=_bytes, default=None, help="bytes per device, e.g. 2GiB")
    pl.add_argument("--ids-per-sample", type=float, default=None, help="the cost model's ids per sample")
    pl.set_defaults(fn=_plan)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "convert" and args.dtype and not args.serving:
        print("sparse-embed: error: --dtype applies to --serving exports only", file=sys.stderr)
        return 2
    try:
        return args.fn(args) or 0
    except (ValueError, OSError) as e:  # CheckpointError is a ValueError
        msg = " ".join(str(e).split())
        print(f"sparse-embed: error: {msg}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
