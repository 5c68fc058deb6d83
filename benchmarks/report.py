"""What `benchmarks/step.py` reports: lower bounds, the side-by-side rows, the issue's targets, the text."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from benchmarks import peers
from benchmarks.peers import FORWARD
from benchmarks.workload import LEARNING_RATE, OPTIMIZERS, Workload, optimizer_of


MIB = 2**20



@dataclasses.dataclass(frozen=True)
class Target:
    """A goal of the native-kernel issue for sparse_embed (primary kernel, 1 device) on one workload.

    `against`: "fbgemm" (FBGEMM's time for the same measurement), "sgd" (our
    own SGD step in the same run) or "fbgemm_rss" (FBGEMM's peak RSS during
    its steps).
    """

    workload: str  # a Workload.key: "W1", "W1 zipf 1.05", "small"
    measurement: str
    against: str
    goal: float


_FBGEMM_STEPS = (FORWARD, "train_sgd", "train_adagrad", "train_rowwise_adagrad")
TARGETS = (
    Target("W1", FORWARD, "fbgemm", 0.6), Target("W1", "train_sgd", "fbgemm", 0.45),
    Target("W1", "train_adagrad", "fbgemm", 0.35), Target("W1", "train_rowwise_adagrad", "fbgemm", 0.5),
    Target("W1", "train_adam", "sgd", 2.0),  # FBGEMM has no Adam on CPU
    *(Target("W1", m, "fbgemm_rss", 1.0) for m in _FBGEMM_STEPS),
    *(Target("W1 zipf 1.05", m, "fbgemm", 0.7) for m in _FBGEMM_STEPS),
    *(Target("small", f"train_{o}", "sgd", 2.0) for o in OPTIMIZERS if o != "sgd"),
)
VOCAB_GOAL = 1.3


def slot_floats(optimizer: str, dim: int) -> int:
    """f32 slot values per table row of a sparse_embed optimizer (0 for SGD, dim for Adagrad, 1 row-wise)."""
    import sparse_embed as se

    opt = getattr(se.optimizers, OPTIMIZERS[optimizer])(LEARNING_RATE)
    return sum(spec.width for spec in opt.slots(dim).values())


def lower_bounds(w: Workload, problem: peers.Problem, measurements: list[str], threads: int) -> dict[str, Any]:
    """The memory-traffic bound of each measurement, with the issue's and with this run's bandwidths."""
    unique = peers.unique_rows_per_step(problem)
    measured = peers.measure_bandwidth(w.tables * w.rows, w.dim, w.ids_per_step, round(unique), threads)
    out: dict[str, Any] = {"unique_rows_per_step": unique,
                           "bandwidth": {"issue": peers.ISSUE_BANDWIDTH, "measured": measured}, "ms": {}}
    for source in ("issue", "measured"):
        ms = {}
        for m in measurements:
            b = peers.lower_bound(w.ids_per_step, unique, w.dim, slot_floats(optimizer_of(m), w.dim),
                                  out["bandwidth"][source])
            ms[m] = b["forward_ms"] if m == FORWARD else b["train_ms"]
        out["ms"][source] = ms
    return out


def _ratio_to(r: dict[str, Any], reference_ms: float | None) -> float | None:
    return r["median_ms"] / reference_ms if reference_ms else None


def _rss_ratio(r: dict[str, Any], fbgemm: dict[str, Any] | None) -> float | None:
    return r["rss_peak_steps_bytes"] / fbgemm["rss_peak_steps_bytes"] if fbgemm else None


def comparison(systems: dict[str, Any], bound: dict[str, Any], measurements: list[str]) -> list[dict[str, Any]]:
    """One row per (measurement, system) measured: times, ratios to FBGEMM and to the bounds, memory."""
    rows = []
    fbgemm = systems.get("fbgemm", {}).get("steps", {})
    for m in measurements:
        for key, s in systems.items():
            r = s["steps"].get(m)
            if r is None:
                continue
            rows.append({
                "measurement": m, "system": key, "label": s["label"],
                **{k: r[k] for k in ("median_ms", "p10_ms", "p90_ms", "cpu_median_ms", "state_bytes",
                                     "rss_peak_steps_bytes")},
                "vs_fbgemm": _ratio_to(r, fbgemm.get(m, {}).get("median_ms")),
                "vs_sgd": _ratio_to(r, s["steps"].get("train_sgd", {}).get("median_ms")),
                "rss_vs_fbgemm": _rss_ratio(r, fbgemm.get(m)),
                "vs_bound": _ratio_to(r, bound["ms"]["issue"][m]),
                "vs_bound_measured": _ratio_to(r, bound["ms"]["measured"][m]),
            })
    return rows


_AGAINST = {"fbgemm": ("vs_fbgemm", "FBGEMM"), "sgd": ("vs_sgd", "our SGD step"),
            "fbgemm_rss": ("rss_vs_fbgemm", "FBGEMM's peak RSS")}


def targets(rows: list[dict[str, Any]], vocab: dict[str, Any] | None, system: str,
            workload: str) -> list[dict[str, Any]]:
    """The issue's goals for `workload` (W1's, marked not applicable, if this run's workload has none).

    Judged on `system` (sparse_embed's primary kernel on 1 device); `pass` is None where a number is missing.
    """
    applicable = any(g.workload == workload for g in TARGETS)
    ours = {r["measurement"]: r for r in rows if r["system"] == system}
    out = []
    for g in TARGETS:
        if g.workload != (workload if applicable else "W1"):
            continue
        field, name = _AGAINST[g.against]
        value = ours.get(g.measurement, {}).get(field)
        out.append({"what": f"{g.measurement} / {name}", "value": value, "goal": g.goal,
                    "pass": None if value is None else value <= g.goal, "applicable": applicable})
    value = vocab["same_batch"]["ratio"] if vocab else None
    out.append({"what": "vocabulary independence (same batches)", "value": value, "goal": VOCAB_GOAL,
                "pass": None if value is None else value <= VOCAB_GOAL, "applicable": applicable})
    return out


def _mib(r: dict[str, Any], key: str) -> str:
    return f"{r[key] / MIB:9.0f}" if key in r else f"{'-':>9}"


def _row(name: str, r: dict[str, Any]) -> str:
    return (f"{name:<24}{r['median_ms']:9.1f}{r['p10_ms']:9.1f}{r['p90_ms']:9.1f}{r['cpu_median_ms']:9.1f}"
            f"{r['lookups_per_s'] / 1e6:10.2f}{_mib(r, 'state_bytes')}{_mib(r, 'temp_bytes')}"
            f"{_mib(r, 'rss_peak_steps_bytes')}{r['minor_faults_per_step'] / 1e3:9.1f}{r['hlo_table_copies']:8d}")


DETAIL_HEADER = [
    f"{'measurement':<24}{'median':>9}{'p10':>9}{'p90':>9}{'cpu':>9}{'Mlookup/s':>10}{'state':>9}"
    f"{'temp':>9}{'peakRSS':>9}{'faults':>9}{'copies':>8}",
    f"{'':<24}{'ms':>9}{'ms':>9}{'ms':>9}{'ms':>9}{'':>10}{'MiB':>9}{'MiB':>9}{'MiB':>9}{'k/step':>9}{'(HLO)':>8}",
]


def _ratio(x: float | None) -> str:
    return f"{x:8.2f}x" if x is not None else f"{'-':>9}"


def format_comparison(results: dict[str, Any]) -> list[str]:
    """The side-by-side table: per measurement, each system and the lower bound."""
    env, bound = results["env"], results["lower_bound"]
    bw = bound["bandwidth"]
    lines = [
        f"side by side (peers: one process, {env['threads']} threads; {results.get('rounds', 1)} rounds; ratios of "
        "medians over all rounds):",
        f"{'measurement':<22}{'system':<26}{'median':>9}{'p10-p90':>16}{'/FBGEMM':>9}{'/SGD':>9}{'/bound':>9}"
        f"{'/bnd(np)':>9}{'state':>9}{'peakRSS':>9}",
        f"{'':<22}{'':<26}{'ms':>9}{'ms':>16}{'':>9}{'(own)':>9}{'':>9}{'':>9}{'MiB':>9}{'MiB':>9}",
    ]
    for m, rows in itertools.groupby(results["comparison"], key=lambda r: r["measurement"]):
        for i, r in enumerate(rows):
            lines.append(f"{m if i == 0 else '':<22}{r['label']:<26}{r['median_ms']:9.1f}"
                         f"{r['p10_ms']:8.1f}-{r['p90_ms']:<7.1f}{_ratio(r['vs_fbgemm'])}{_ratio(r['vs_sgd'])}{_ratio(r['vs_bound'])}"
                         f"{_ratio(r['vs_bound_measured'])}{_mib(r, 'state_bytes')}{_mib(r, 'rss_peak_steps_bytes')}")
        lines.append(f"{'':<22}{'lower bound':<26}{bound['ms']['issue'][m]:9.1f}"
                     f"{'(numpy: ' + format(bound['ms']['measured'][m], '.1f') + ')':>16}")
    lines += [f"{s['label']}: {s['status']}" for s in results["systems"].values() if s["status"] != "ok"]
    load = max((r["loadavg_1min"] for s in results["systems"].values() for r in s["steps"].values()), default=0.0)
    if load > env["threads"] + 0.5:
        lines.append(f"WARNING: 1-minute load average up to {load:.1f} on {env['threads']} threads: other work was "
                     "running; torch/FBGEMM (OpenMP) steps stall when a core is taken (see peers.py).")
    lines.append(
        f"bound: memory traffic at the issue's {bw['issue']['gather_gbps']:.0f} GB/s gather, "
        f"{bw['issue']['rmw_gbps']:.0f} GB/s row read-modify-write; bnd(np): at this run's numpy-measured "
        f"{bw['measured']['gather_gbps']:.1f} / {bw['measured']['rmw_gbps']:.1f} GB/s "
        f"({bw['measured']['threads']} threads); {bound['unique_rows_per_step']:,.0f} distinct rows/step.")
    return lines


def format_targets(results: dict[str, Any]) -> list[str]:
    lines = ["", f"targets (the issue's, for {results['target_system']} on 1 device, workload "
                 f"{results['workload_key']}):"]
    for t in results["targets"]:
        verdict = "n/a" if t["pass"] is None else ("pass" if t["pass"] else "FAIL")
        if not t["applicable"] and t["pass"] is not None:
            verdict += " (no targets for this workload: W1's, informational)"
        value = "-" if t["value"] is None else f"{t['value']:.2f}x"
        lines.append(f"  {t['what']:<44} {value:>8}  goal <= {t['goal']}x  {verdict}")
    return lines


def format_report(results: dict[str, Any]) -> str:
    env, w = results["env"], results["workload"]
    lib = env["sparse_embed"]
    zipf = "uniform" if w["zipf"] is None else f"zipf {w['zipf']}"
    lines = [
        f"sparse_embed step benchmark  ({env['date']}, sparse_embed {lib['commit']}{'+dirty' * lib['dirty']}, "
        f"jax {env['jax']}, {env['backend']}, {env['cpu_count']} cpus)",
        f"workload {w['name']}: {w['tables']} tables x {w['rows']:,} rows x {w['dim']}, batch {w['batch']}, "
        f"{w['ids_per_sample']} ids/sample/table ({zipf}), sum combiner; {results['ids_per_step']:,} ids/step",
        f"allocator: {' '.join(f'{k}={v}' for k, v in env['malloc_env'].items()) or 'glibc defaults'}",
    ]
    for s in results["systems"].values():
        if s["devices"] is not None and s["steps"]:
            lines += ["", f"{s['label']} on {s['devices']} device(s):", *DETAIL_HEADER]
            lines += [_row(name, r) for name, r in s["steps"].items()]
    lines += ["", *format_comparison(results)]
    vocab = results.get("vocab")
    if vocab:
        large, small = vocab["sizes"]
        for key, what in (("same_batch", f"the same batches, ids < {small:,}"),
                          ("full_range", "ids over each table's whole vocabulary")):
            v = vocab[key]
            lines += ["", f"vocabulary independence, {what} (1 table x {w['dim']}, batch {w['batch']} x "
                          f"{w['ids_per_sample']} ids, SGD, {v['rounds']} alternating blocks of {v['block_steps']} steps):"]
            lines += [_row(f"{int(rows):,} rows", r) for rows, r in v["by_rows"].items()]
            goal = (f" (goal <= {VOCAB_GOAL}x: " + ("ok" if v["ratio"] <= VOCAB_GOAL else "ABOVE GOAL") + ")"
                    if key == "same_batch" else " (memory hierarchy included; reported, not a goal)")
            lines.append(f"ratio {large:,} / {small:,} rows: {v['ratio']:.2f}x{goal}")
    lines += format_targets(results)
    if "agreement" in results:
        lines.append("from the same tables, max |difference| from sparse_embed's forward output and SGD-updated "
                     "tables: " + (", ".join(
            f"{k} {d:.1e}" for k, d in results["agreement"].items()) or "no peer installed"))
    lines += [
        "",
        f"process peak RSS: {results['rss_process_peak_bytes'] / MIB:.0f} MiB",
        "cpu: median process CPU time per step (all threads); temp: compiled memory_analysis(); "
        "peakRSS: peak during the timed steps;",
        "faults: minor page faults per step (thousands); copies: table-shaped copy ops in the compiled HLO.",
    ]
    return "\n".join(lines)
