"""The one check of every reader: values read, bound to their dtype and shape, against what the step saved.

Each stored array's checksum (`io.integrity`) is recomputed from the values
as read (restore, convert, `load_serving`, `sparse-embed verify`) and
compared here; a mismatch raises `CorruptCheckpointError` naming the step
and the array.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping

import jax
import numpy as np

from sparse_embed.core.relayout import TABLE_KEY
from sparse_embed.io.ckpt_format import WHAT_TO_DO, CheckpointInfo, CorruptCheckpointError
from sparse_embed.io.integrity import bind, checksum, matches, meaning


def leaf_key(path: tuple) -> str:
    """A user leaf's path as a container-independent string ("opt/0/mu/dense/kernel"), as orbax names it."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _key_data(x: Any) -> Any:
    """A typed PRNG key array (`jax.random.key`) as its key data, uint32 with one more axis (a `ShapeDtypeStruct`
    of one as the struct of its data): what it holds, in a dtype numpy knows; any other leaf as it is."""
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return x
    return jax.eval_shape(jax.random.key_data, x) if isinstance(x, jax.ShapeDtypeStruct) else jax.random.key_data(x)


def user_checksums(user: Any) -> dict[str, str]:
    """`{leaf_key: "checksum dtype shape"}` of a user pytree's array leaves (others, e.g. strings, are skipped).

    The checksum is of the values' bytes: numeric dtypes, and those numpy knows only as bytes of a size (kind "V":
    ml_dtypes' bfloat16, float8, int4), alike.
    """
    out = {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(user):
        leaf = _key_data(leaf)
        a = leaf if isinstance(leaf, jax.Array) else np.asarray(leaf)
        if a.dtype.kind in "biufcV" and a.dtype.itemsize in (1, 2, 4, 8):
            out[leaf_key(path)] = bind(checksum(a), a.dtype, a.shape)
    return out


def array_name(table: str, key: str) -> str:
    return f"table {table!r}" if key == TABLE_KEY else f"slot {key!r} of table {table!r}"


def verify_embeddings(step_dir: str, info: CheckpointInfo, arrays: Mapping[str, Mapping[str, Any]]) -> None:
    """Raises CorruptCheckpointError naming every array whose values do not match its saved checksum."""
    def bound(name: str, a: Any) -> str:
        rows = info.table(name).vocabulary_size
        return bind(checksum(a, rows), a.dtype, (rows, *a.shape[1:]))

    check_sums(step_dir, info, {f"{name}/{key}": bound(name, a) for name, keys in arrays.items()
                                for key, a in keys.items()})


def check_sums(step_dir: str, info: CheckpointInfo, sums: Mapping[str, str]) -> None:
    """Raises CorruptCheckpointError naming every array ("table/key") whose bound checksum (of the values as
    read, with their dtype and shape) is not the saved one. The one check of every reader."""
    if not info.verified:
        return
    bad = [array_name(*k.split("/", 1)) for k, v in sums.items() if not matches(info.checksums.get(k), v)]
    if bad:
        raise CorruptCheckpointError(f"{step_dir} (step {info.step}) is corrupt: the values of {', '.join(bad)} do not "
                                     f"match the checksum saved with them; {WHAT_TO_DO}.")


def _typed_leaves(tree: Any) -> dict[str, Any]:
    """`{leaf_key: leaf}` of a pytree's leaves that have a dtype (arrays, `ShapeDtypeStruct`s), and its Python
    numbers as the numpy scalars `user_checksums` saw (else a target's `7` asked for nothing, unchecked)."""
    out = {}
    for p, x in jax.tree_util.tree_leaves_with_path(tree):
        if isinstance(x, (bool, int, float, complex)):
            x = np.asarray(x)
        x = _key_data(x)
        if hasattr(x, "dtype"):
            out[leaf_key(p)] = x
    return out


def leaf_meanings(tree: Any) -> dict[str, str]:
    """`{leaf_key: "dtype shape"}` of a pytree's leaves that have a dtype, Python numbers included."""
    return {k: meaning(x.dtype, x.shape) for k, x in _typed_leaves(tree).items()}


def verify_user(step_dir: str, info: CheckpointInfo, user: Any, target: Any = None) -> int:
    """Checks a restored user pytree's leaves against their checksums; returns how many could not be checked.

    A leaf for which `target` asked another dtype or shape than it was saved
    with (a cast) cannot be checked, nor one saved without a checksum. Any
    other leaf must come back as saved: its values, dtype and shape.
    Without `target` (read as stored) nothing is asked for.
    """
    if not info.verified or info.user_checksums is None:
        return 0
    asked = None if target is None else leaf_meanings(target)
    # what jax makes of an asked dtype: without x64, a float64 target leaf comes back float32 (a cast, not damage)
    narrowed = {} if target is None else {k: meaning(jax.dtypes.canonicalize_dtype(x.dtype), x.shape)
                                          for k, x in _typed_leaves(target).items()}
    bad, unchecked = [], 0
    for key, got in user_checksums(user).items():
        want = info.user_checksums.get(key, "")
        read_as = got.split(" ", 1)[-1]
        cast = read_as != want.split(" ", 1)[-1] and read_as == narrowed.get(key)
        if not want or cast or (asked is not None and asked.get(key) != want.split(" ", 1)[-1]):
            unchecked += 1
        elif not matches(want, got):
            bad.append(key)
    if bad:
        raise CorruptCheckpointError(f"{step_dir} (step {info.step}) is corrupt: the user pytree's leaves {bad} do not "
                                     f"match the checksums saved with them; {WHAT_TO_DO}.")
    return unchecked


def warn_unverified(step_dir: str, info: CheckpointInfo) -> None:
    if not info.verified:
        warnings.warn(f"{step_dir} was written by an older sparse_embed, without checksums: its values are restored "
                      "unverified. Save it again to add them.", stacklevel=3)
