"""Row-wise quantized serving tables: int8 and int4 codes with a per-row scale and bias, fused into one row.

Layout (like FBGEMM's fused row-wise tables, so one row is one contiguous
read): a quantized table is a `uint8 [vocab, width]` array whose row holds
the row's codes, then its scale and its bias as little-endian float32:

- int8: `dim` bytes of codes, `width = dim + 8`;
- int4: `ceil(dim / 2)` bytes, two codes a byte (element `2k` in the low
  nibble, `2k + 1` in the high one; an odd dim leaves the last high nibble
  0), `width = ceil(dim / 2) + 8`.

A uint8 array's width says which one it is (for dim 1 both are 9 bytes and
mean the same: a one-element row is constant, code 0). Rows whose width is a
multiple of 4 (int8 with dim % 4 == 0, int4 with dim % 8 == 0) are gathered
as 32-bit words by `serving_lookup`.
FBGEMM keeps int4's scale and bias in float16; float32 here costs 4 bytes a
row and keeps one layout, exact scales and no float16 overflow.

Rounding (b bits, `Q = 2^b - 1`), all in float32 per row:
`bias = min(row)`, `scale = (max(row) - min(row)) / Q`,
`code = clip(round_half_even((x - bias) / scale), 0, Q)`; a constant row
(`scale == 0`) gets codes 0 and reads back exactly. Dequantized:
`x' = code * scale + bias`. Min/max (asymmetric) uses every code for the
row's own range, and the min is represented exactly; the error of an
element is at most `scale / 2` (plus float32 rounding). Each row depends
only on itself, so a row re-exported in a delta has the same bytes as in a
full export.
"""

from __future__ import annotations

from typing import Any

import numpy as np

BITS = {"int8": 8, "int4": 4}
_TAIL = 8  # bytes of float32 scale and bias after the codes


def code_bytes(dim: int, bits: int) -> int:
    """Bytes of one row's codes."""
    return dim if bits == 8 else -(-dim // 2)


def fused_width(dim: int, bits: int) -> int:
    """Bytes of one fused row: codes, then float32 scale and bias."""
    return code_bytes(dim, bits) + _TAIL


def bits_of(width: int, dim: int) -> int | None:
    """8 or 4 for a uint8 table of `width` bytes a row holding `dim`-wide rows, None if it is neither."""
    for bits in (8, 4):
        if width == fused_width(dim, bits):
            return bits
    return None


def stored(dtype: str, dim: int) -> tuple[np.dtype, int]:
    """The dtype and width of a stored serving table of `dtype` ("int8", "int4" or a float dtype's name)."""
    if dtype in BITS:
        return np.dtype(np.uint8), fused_width(dim, BITS[dtype])
    return np.dtype(dtype), dim


def bad_row(what: str, bad: np.ndarray, names: np.ndarray | None, kind: str, why: str) -> ValueError:
    """A ValueError naming `what` and the first row `bad` (`[n]` bool) marks: as `kind` `names[i]`, else by index."""
    i = int(np.argmax(bad))
    return ValueError(f"{what}: {kind} {int(i if names is None else names[i])} {why}")


def quantize(x: np.ndarray, bits: int, *, what: str = "the table", names: np.ndarray | None = None,
             kind: str = "row") -> np.ndarray:
    """`[n, dim]` float rows -> `uint8 [n, fused_width(dim, bits)]` fused rows (see the module doc).

    Raises ValueError naming `what` and the first row that is not finite, or whose range (max - min) is past
    float32's (neither has a range to quantize): as `kind` `names[i]` (a delta's rows: their row numbers or raw
    ids), else by its index.
    """
    x = np.asarray(x, np.float32)
    dim = x.shape[1]
    q = np.float32(2**bits - 1)
    with np.errstate(over="ignore", invalid="ignore"):
        lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
        scale = ((hi - lo) / q).astype(np.float32)
    for bad, why in ((~np.isfinite(x).all(axis=1), "is not finite (NaN or inf)"),
                     (~np.isfinite(scale[:, 0]), "spans more than float32's range (max - min overflows)")):
        if bad.any():
            raise bad_row(what, bad, names, kind, f"{why}; it cannot be quantized. Fix the table (e.g. an earlier "
                          "checkpoint; plan(..., nonfinite_gradients='skip') keeps NaN gradients out of it) or "
                          "export it as float.")
    codes = np.clip(np.rint((x - lo) / np.where(scale > 0, scale, np.float32(1))), 0, q).astype(np.uint8)
    if bits == 4:
        codes = np.pad(codes, ((0, 0), (0, dim % 2)))
        codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
    tail = np.concatenate([scale, lo], axis=1).astype("<f4").view(np.uint8)
    return np.ascontiguousarray(np.concatenate([codes, tail], axis=1))


def dequantize(rows: Any, dim: int, xp: Any = np) -> Any:
    """Fused rows `uint8 [..., width]` -> float32 `[..., dim]` (`xp`: numpy or jax.numpy; jit-able)."""
    bits = bits_of(rows.shape[-1], dim)
    if bits is None:
        raise ValueError(f"a quantized table of dim {dim} has rows of {fused_width(dim, 8)} (int8) or "
                         f"{fused_width(dim, 4)} (int4) bytes, got {rows.shape[-1]}.")
    n = code_bytes(dim, bits)
    codes = rows[..., :n]
    if bits == 4:
        codes = xp.stack([codes & 15, codes >> 4], axis=-1).reshape(*codes.shape[:-1], 2 * n)[..., :dim]
    tail = _floats(rows[..., n:], xp)
    return codes.astype(xp.float32) * tail[..., :1] + tail[..., 1:]


def _floats(tail: Any, xp: Any) -> Any:
    """`uint8 [..., 8]` little-endian bytes -> float32 `[..., 2]` (scale, bias)."""
    if xp is np:
        return np.ascontiguousarray(tail).view("<f4")
    import jax

    return jax.lax.bitcast_convert_type(tail.reshape(*tail.shape[:-1], 2, 4), xp.float32)
