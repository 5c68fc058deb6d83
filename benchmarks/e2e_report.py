"""The report of `benchmarks/e2e.py`: one table per model, the profile, and the issue's goals with their ratios."""

from __future__ import annotations

from typing import Any

import numpy as np

OURS = ("linen", "nnx")
GOALS = ("examples/s >= 2x TorchRec's", "eval AUC within 0.002 of TorchRec's", "peak RSS (timed steps) <= TorchRec's",
         "step outside the embeddings <= 1.0x TorchRec's")


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.0f}"


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def outside_ms(r: dict[str, Any]) -> float | None:
    """The loop's time per step minus the embedding part (the step alone minus its dense part)."""
    if "dense_ms" not in r:
        return None
    return r["loop_ms"] - (r["step_ms"] - r["dense_ms"])


def line(r: dict[str, Any]) -> str:
    """One run in one line (progress)."""
    if "status" in r:
        return f"{r['model']:<10} {r['system']:<11} {r['status'][:300]}"
    return (f"{r['model']:<10} {r['system']:<11} {r['examples_per_s']:>9,.0f} ex/s  AUC {r['eval_auc']:.4f}  "
            f"RSS {_mib(r['rss_peak_steps_bytes'])} MiB  step {r['step_ms']:.1f} ms")


def _table(runs: list[dict[str, Any]], bases: dict[int, dict[str, Any]]) -> list[str]:
    out = ["| round | system | examples/s (median) | p10-p90 | vs TorchRec | eval AUC | AUC - TorchRec's | "
           "peak RSS steps (MiB) | process peak (MiB) | load (1 min, at the end) |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        head = f"| {r.get('round', 1)} | {r['system']} |"
        if "status" in r:
            out.append(f"{head} {r['status'][:120]} | | | | | | | |")
            continue
        base = bases.get(r.get("round", 1))
        ratio = r["examples_per_s"] / base["examples_per_s"] if base else None
        d_auc = r["eval_auc"] - base["eval_auc"] if base else None
        out.append(f"{head} {r['examples_per_s']:,.0f} | {r['examples_per_s_p10']:,.0f}-"
                   f"{r['examples_per_s_p90']:,.0f} | {_f(ratio, '.2f')}x | {r['eval_auc']:.4f} | "
                   f"{_f(d_auc, '+.4f')} | {_mib(r['rss_peak_steps_bytes'])} | {_mib(r['rss_peak_process_bytes'])} | "
                   f"{_f(r.get('loadavg', (None,))[0], '.1f')} |")
    return out


def _profile(runs: list[dict[str, Any]]) -> list[str]:
    out = ["| round | system | input, host (ms) | host->device (ms) | step alone (ms) | dense part (ms) | embedding "
           "part (ms) | loop per step (ms) | its CPU time (ms) | outside the embeddings (ms) |",
           "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        if "status" in r:
            continue
        emb = r["step_ms"] - r["dense_ms"] if "dense_ms" in r else None
        out.append(f"| {r.get('round', 1)} | {r['system']} | {r['input_host_ms']:.1f} | "
                   f"{_f(r.get('input_h2d_ms'), '.1f')} | "
                   f"{r['step_ms']:.1f} | {_f(r.get('dense_ms'), '.1f')} | {_f(emb, '.1f')} | {r['loop_ms']:.1f} | "
                   f"{_f(r.get('loop_cpu_ms'), '.1f')} | {_f(outside_ms(r), '.1f')} |")
    return out


def _bases(runs: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """TorchRec's run per (model, round)."""
    return {(r["model"], r.get("round", 1)): r for r in runs if r["system"] == "torchrec" and "status" not in r}


def goals(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each goal for each of our runs: the measured ratio (or difference) to TorchRec's in the same round, and
    whether it is met."""
    bases, out = _bases(runs), []
    for r in runs:
        base = bases.get((r["model"], r.get("round", 1)))
        if r["system"] not in OURS or "status" in r or base is None:
            continue
        speed = r["examples_per_s"] / base["examples_per_s"]
        auc = r["eval_auc"] - base["eval_auc"]
        rss = r["rss_peak_steps_bytes"] / base["rss_peak_steps_bytes"]
        outside = outside_ms(r) / outside_ms(base) if outside_ms(r) is not None and outside_ms(base) else None
        for goal, value, met in zip(GOALS, (speed, auc, rss, outside),
                                    (speed >= 2, abs(auc) <= 0.002, rss <= 1, outside is not None and outside <= 1)):
            out.append({"model": r["model"], "system": r["system"], "round": r.get("round", 1), "goal": goal,
                        "value": value, "met": met})
    return out


def _goal_rows(found: list[dict[str, Any]]) -> list[str]:
    """One row per (model, system, goal): the median and range over the rounds, and in how many it was met."""
    out = ["| model | system | goal | median (min-max over rounds) | met in |", "|---|---|---|---:|---:|"]
    keys = list(dict.fromkeys((g["model"], g["system"], g["goal"]) for g in found))
    for model, system, goal in keys:
        gs = [g for g in found if (g["model"], g["system"], g["goal"]) == (model, system, goal)]
        values = sorted(g["value"] for g in gs if g["value"] is not None)
        fmt = (lambda v: f"{v:+.4f}") if "AUC" in goal else (lambda v: f"{v:.2f}x")  # noqa: E731
        shown = f"{fmt(float(np.median(values)))} ({fmt(values[0])}-{fmt(values[-1])})" if values else "-"
        out.append(f"| {model} | {system} | {goal} | {shown} | {sum(g['met'] for g in gs)} of {len(gs)} |")
    return out


def format_report(results: dict[str, Any]) -> str:
    env = results["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in {"jax": env.get("jax"), **env.get("peers", {})}.items() if v)
    load = " ".join(f"{x:.1f}" for x in env.get("loadavg_start", ()))
    commit = env.get("sparse_embed", {}).get("commit", "?")
    lines = ["# End to end: the same DLRM in TorchRec and sparse_embed", "",
             f"{env.get('date', '')}; {env.get('cpu', '?')}, {env.get('threads', '?')} threads, load average at the "
             f"start {load}; sparse_embed {commit}; {versions}.", "", f"`{env.get('command', '')}`", ""]
    bases = _bases(results["runs"])
    for m in dict.fromkeys(r["model"] for r in results["runs"]):
        runs = [r for r in results["runs"] if r["model"] == m]
        pool = next((r for r in runs if "pool" in r), None)
        lines += [f"## {m}", "", *_table(runs, {k: b for (mm, k), b in bases.items() if mm == m}), ""]
        if pool:
            lines += [f"Training batches: a pool of {pool['pool']} made before the loop ({_mib(pool['pool_bytes'])} "
                      "MiB, inside every system's RSS), cycled.", ""]
        lines += ["Profile (medians):", "", *_profile(runs), ""]
    lines += ["## Goals", "", *_goal_rows(goals(results["runs"]))]
    return "\n".join(lines) + "\n"
