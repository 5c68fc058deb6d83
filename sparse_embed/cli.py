"""`sparse-embed`: inspect, verify and convert checkpoints from the command line.

    sparse-embed inspect CKPT
    sparse-embed verify CKPT [--step N]
    sparse-embed convert SRC DST [--devices N] [--serving] [--dtype bf16]

CKPT / SRC is a checkpoint manager directory (its latest complete step is
used) or one step directory. Errors print one line to stderr and exit 1;
`verify` exits 1 when any array is corrupt.
"""

from __future__ import annotations

import argparse
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


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sparse-embed", description="Inspect, verify and convert sparse_embed checkpoints.")
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
