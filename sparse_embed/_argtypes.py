"""argparse types shared by the command line (`cli`) and the demos (`examples`): one rule and one message each."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def number(kind: type, low: float, *, strict: bool = False, what: str | None = None) -> Callable[[str], int | float]:
    """An argparse type: `kind(text)` (int or float), finite, above `low` (`strict`) or at least `low`. Its error
    (one line, after argparse's "argument --x:") says `what` the value must be (default: e.g. "an integer > 0")
    and what it got."""
    what = what or f"{'an integer' if kind is int else 'a finite number'} {'>' if strict else '>='} {low}"

    def parse(text: str) -> int | float:
        try:
            x = kind(text)
        except ValueError:
            x = math.nan
        if not (math.isfinite(x) and (x > low if strict else x >= low)):
            raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
        return x

    parse.__name__ = kind.__name__  # argparse names the type in its own messages
    return parse


POSITIVE_INT = number(int, 0, strict=True)
COUNT = number(int, 0)  # an integer >= 0
POSITIVE = number(float, 0, strict=True)  # a finite number > 0
