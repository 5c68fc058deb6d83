"""The placement planner's cost model: what each placement of one table costs a device per train step.

With D devices, a table `vocab` rows long and `dim` wide, read by features
with `rows` output rows and `ids` ids per device (`TableLoad`), bytes a
device receives through collectives in one forward and backward of
`lookup` (`EmbeddingPlan.collective_bytes` counts the same for a whole
plan, exactly, and a test checks it against the compiled program):

- "row": ids to their shards (3 words each), every shard's partial
  activations back and the activation gradients to every shard:
  `12 ids (D-1)/D + 8 rows dim (D-1)`.
- "table": the same ids to the table's one device, its activations back and
  its gradients to it, counted as if the tables spread evenly over the
  devices: `12 ids (D-1)/D + 8 rows dim (D-1)/D`; that device holds the
  whole table.
- "replicated": nothing forward; the backward sums a dense gradient and
  touch counts over the devices (an all-reduce of `vocab x (dim + 1)` f32):
  `8 vocab (dim + 1) (D-1)/D`, plus the work of that dense pass, `12 vocab
  (dim + 1)` bytes; every device holds the whole table.
- "column": every device's ids to every device, and each device's share
  of the columns of every activation and gradient:
  `12 ids (D-1) + 8 rows ceil(dim/D) (D-1)`, plus `8 ids (D-1)` for each
  whole-row statistic summed over the devices (`column_row_sums`: max_norm,
  RowwiseAdagrad); each device holds all rows, `dim/D` columns wide (a
  per-row slot whole). Never chosen for `Custom` optimizers (their rows
  are gathered whole, `StackPlan.row_gathers`) or raw-id tables.

`cheapest` takes the least; ties go to the earlier of row, table,
replicated, column; `choose` then corrects "table" for the stacks it
makes. Memory per device (`TableLoad.memory`: the padded rows and columns
a device holds, times the bytes of the table's and its slots' row) decides
where `to_move` takes a table when the plan exceeds a `memory_budget`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

ORDER = ("row", "table", "replicated", "column")
# Where `to_move` may take a table to need less memory: never "column", which needs at least what "row" needs
# (`ceil(dim/D)` columns of every row, per-row slots whole), so "row" is always among the least.
MOVE_TARGETS = ("row", "table", "replicated")
SLOT_ITEMSIZE = 4  # optimizer slots are float32 (`core.state.SLOT_DTYPE`)


def column_row_sums(max_norm: bool, elementwise: bool, skip_nonfinite: bool = True) -> int:
    """f32 per id that a "column" table all-reduces per train step for statistics of whole rows.

    A row's norm (max_norm: 1 in the forward, 2 in the backward), a
    row-wise optimizer's mean (1), and on that path, under the "skip"
    policy, whether any device's columns of a row's summed gradient are
    non-finite (1), so every device skips the same rows.
    """
    n = 3 * max_norm + (not elementwise)
    return n + (skip_nonfinite and n > 0)


@dataclasses.dataclass(frozen=True)
class TableLoad:
    """What one table costs to keep and to read, per device and step."""

    vocab: int
    dim: int
    row_bytes: int  # bytes of one row of the table and its slots
    rows: int  # output rows of its features on one device
    ids: float  # ids of its features on one device
    row_sums: int | None = 0  # "column": whole-row statistics all-reduced per id (None: it cannot be split)
    whole_bytes: int = 0  # bytes of a row that "column" keeps whole on every device (per-row slots)

    def traffic(self, placement: str, num_devices: int, share: float | None = None) -> float:
        """Bytes one device receives through collectives per train step (see the module docstring).

        `share`: "table", the part of the stack's activation rows this
        table's device adds to every shard's (default `1/D`, tables spread
        evenly; 1 for a table alone in its stack).
        """
        D = num_devices
        if D == 1:
            return 0.0
        f = (D - 1) / D
        if placement == "replicated":
            return 8.0 * self.vocab * (self.dim + 1) * f
        if placement == "column":
            return (12.0 + 8.0 * self.row_sums) * self.ids * (D - 1) + 8.0 * self.rows * -(-self.dim // D) * (D - 1)
        activations = 8.0 * self.rows * self.dim * (D - 1)
        if placement == "table":
            activations *= 1.0 / D if share is None else share
        return 12.0 * self.ids * f + activations

    def cost(self, placement: str, num_devices: int, share: float | None = None) -> float:
        """Traffic, plus the dense gradient pass of a replicated table."""
        work = 12.0 * self.vocab * (self.dim + 1) if placement == "replicated" and num_devices > 1 else 0.0
        return self.traffic(placement, num_devices, share) + work

    def memory(self, placement: str, num_devices: int) -> float:
        """Bytes of the table and its slots on the devices that hold it, as the plan pads them.

        Rows are padded to a multiple of D (`StackPlan`), and "column" gives
        each device `ceil(dim/D)` columns of every row (its per-row slots
        whole), so a table whose dim D does not divide needs more by columns
        than by rows. Exact for every placement but "table", where a device
        holds as many rows as the busiest device of the stack.
        """
        D = num_devices
        rows = -(-self.vocab // D) * D
        if placement == "column":
            split = (self.row_bytes - self.whole_bytes) // max(self.dim, 1)  # bytes of one column of a row
            return float(rows * (-(-self.dim // D) * split + self.whole_bytes))
        return float(rows * self.row_bytes // (D if placement == "row" else 1))


def row_bytes(table) -> int:
    """Bytes of one row of a `TableSpec` and of its optimizer's slots."""
    slots = table.resolved_optimizer.slots(table.embedding_dim)
    return int(table.embedding_dim * np.dtype(table.dtype).itemsize + sum(s.width for s in slots.values()) * SLOT_ITEMSIZE)


def table_loads(feats: dict, tables: dict, num_devices: int, ids_per_sample: dict[str, float]) -> dict[str, TableLoad]:
    """`{table: TableLoad}` from the features (`{name: FeatureSpec}`) that read each table."""
    out = {}
    for name, t in tables.items():
        users = [f for f in feats.values() if f.table.name == name]
        rows = sum(f.batch_size // num_devices * max(f.max_sequence_length, 1) for f in users)
        ids = sum(f.batch_size / num_devices * ids_per_sample[f.name] for f in users)
        o = t.resolved_optimizer
        sums = column_row_sums(t.max_norm is not None, o.elementwise) if o.splits_columns and not t.dynamic else None
        whole = sum(s.width for s in o.slots(t.embedding_dim).values() if s.width != t.embedding_dim) * SLOT_ITEMSIZE
        out[name] = TableLoad(t.vocabulary_size, t.embedding_dim, row_bytes(t), rows, ids, sums, whole)
    return out


def cheapest(load: TableLoad, num_devices: int, share: float | None = None) -> str:
    """The placement with the least `cost` (ties: row, table, replicated, column)."""
    allowed = [p for p in ORDER if p != "column" or load.row_sums is not None]
    return min(allowed, key=lambda p: (load.cost(p, num_devices, share), ORDER.index(p)))


def choose(loads: dict[str, TableLoad], fixed: dict[str, str], stack_of, num_devices: int) -> dict[str, str]:
    """Each table's cheapest placement, then again with the stacks the "table" choices make.

    A stack of k tables placed "table" sends every shard `ceil(k/D)` tables'
    activation rows, not `k/D`: `stack_of(chosen)` (`{table: stack key}`)
    gives the k of each table's stack, and a table whose stack is too small
    to spread goes back to its cheapest other placement.
    """
    D = num_devices
    chosen = {n: fixed.get(n) or cheapest(load, D) for n, load in loads.items()}
    keys = stack_of(chosen)
    together = {}
    for n, p in chosen.items():
        if p == "table":
            together.setdefault(keys[n], []).append(n)
    for group in together.values():
        share = -(-len(group) // D) / len(group)
        for n in group:
            if n not in fixed:
                chosen[n] = cheapest(loads[n], D, share)
    return chosen


def to_move(chosen: dict[str, str], fixed: dict[str, str], loads: dict[str, TableLoad],
            num_devices: int) -> tuple[str, str] | None:
    """`(table, placement)`: where to move a table so the plan needs less memory per device, or None.

    The largest table (by its memory where it is) that is not fixed and has
    a `MOVE_TARGETS` placement needing less memory goes to the cheapest of
    those (`cost`; ties as in `ORDER`): replicated to table, table to row,
    column to row when its padding or per-row slots make it larger. Each
    move lowers one table's memory, so the moves end, at worst with every
    movable table on "row".
    """
    D = num_devices
    moves = {}
    for n, p in chosen.items():
        now = loads[n].memory(p, D)
        less = [q for q in MOVE_TARGETS if q != p and loads[n].memory(q, D) < now]
        if n not in fixed and less:
            moves[n] = min(less, key=lambda q: (loads[n].cost(q, D), ORDER.index(q)))
    n = max(moves, key=lambda n: (loads[n].memory(chosen[n], D), n), default=None)
    return None if n is None else (n, moves[n])


def balance(items: list[tuple[str, TableLoad]], memory: list[float]) -> dict[str, int]:
    """Assigns one stack's tables to devices, largest first, each to the device with the least traffic.

    Traffic is balanced within the stack (its collectives are as large as its
    busiest device's share); ties go to the device with the least `memory`
    (bytes per device of the plan's earlier "table" stacks), which is
    updated in place.
    """
    D = len(memory)
    owner, traffic = {}, [0.0] * D
    for name, load in sorted(items, key=lambda x: (-x[1].traffic("table", D), -x[1].memory("table", D), x[0])):
        d = min(range(D), key=lambda i: (traffic[i], memory[i], i))
        owner[name] = d
        traffic[d] += load.traffic("table", D)
        memory[d] += load.memory("table", D)
    return owner
