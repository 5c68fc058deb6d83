"""The report of `benchmarks/e2e.py`: one table per model, the profile, and the issue's goals with their ratios."""

from __future__ import annotations

from typing import Any

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


def _table(runs: list[dict[str, Any]], base: dict[str, Any] | None) -> list[str]:
    out = ["| system | examples/s (median) | p10-p90 | vs TorchRec | eval AUC | AUC - TorchRec's | "
           "peak RSS steps (MiB) | process peak (MiB) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        if "status" in r:
            out.append(f"| {r['system']} | {r['status'][:120]} | | | | | | |")
            continue
        ratio = r["examples_per_s"] / base["examples_per_s"] if base else None
        d_auc = r["eval_auc"] - base["eval_auc"] if base else None
        out.append(f"| {r['system']} | {r['examples_per_s']:,.0f} | {r['examples_per_s_p10']:,.0f}-"
                   f"{r['examples_per_s_p90']:,.0f} | {_f(ratio, '.2f')}x | {r['eval_auc']:.4f} | "
                   f"{_f(d_auc, '+.4f')} | {_mib(r['rss_peak_steps_bytes'])} | {_mib(r['rss_peak_process_bytes'])} |")
    return out


def _profile(runs: list[dict[str, Any]]) -> list[str]:
    out = ["| system | input, host (ms) | host->device (ms) | step alone (ms) | dense part (ms) | embedding part (ms) "
           "| loop per step (ms) | outside the embeddings (ms) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        if "status" in r:
            continue
        emb = r["step_ms"] - r["dense_ms"] if "dense_ms" in r else None
        out.append(f"| {r['system']} | {r['input_host_ms']:.1f} | {_f(r.get('input_h2d_ms'), '.1f')} | "
                   f"{r['step_ms']:.1f} | {_f(r.get('dense_ms'), '.1f')} | {_f(emb, '.1f')} | {r['loop_ms']:.1f} | "
                   f"{_f(outside_ms(r), '.1f')} |")
    return out


def goals(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each goal for each of our systems: the measured ratio (or difference) and whether it is met."""
    bases = {r["model"]: r for r in runs if r["system"] == "torchrec" and "status" not in r}
    out = []
    for r in runs:
        base = bases.get(r["model"])
        if r["system"] not in OURS or "status" in r or base is None:
            continue
        speed = r["examples_per_s"] / base["examples_per_s"]
        auc = r["eval_auc"] - base["eval_auc"]
        rss = r["rss_peak_steps_bytes"] / base["rss_peak_steps_bytes"]
        outside = outside_ms(r) / outside_ms(base) if outside_ms(r) is not None and outside_ms(base) else None
        for goal, value, met in zip(GOALS, (speed, auc, rss, outside),
                                    (speed >= 2, abs(auc) <= 0.002, rss <= 1, outside is not None and outside <= 1)):
            out.append({"model": r["model"], "system": r["system"], "goal": goal, "value": value, "met": met})
    return out


def format_report(results: dict[str, Any]) -> str:
    env = results["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in {"jax": env.get("jax"), **env.get("peers", {})}.items() if v)
    load = " ".join(f"{x:.1f}" for x in env.get("loadavg_start", ()))
    commit = env.get("sparse_embed", {}).get("commit", "?")
    lines = ["# End to end: the same DLRM in TorchRec and sparse_embed", "",
             f"{env.get('date', '')}; {env.get('cpu', '?')}, {env.get('threads', '?')} threads, load average at the "
             f"start {load}; sparse_embed {commit}; {versions}.", "", f"`{env.get('command', '')}`", ""]
    models = list(dict.fromkeys(r["model"] for r in results["runs"]))
    for m in models:
        runs = [r for r in results["runs"] if r["model"] == m]
        base = next((r for r in runs if r["system"] == "torchrec" and "status" not in r), None)
        lines += [f"## {m}", "", *_table(runs, base), "", "Profile (medians):", "", *_profile(runs), ""]
    lines += ["## Goals", "", "| model | system | goal | measured | met |", "|---|---|---|---:|---|"]
    for g in goals(results["runs"]):
        value = f"{g['value']:+.4f}" if "AUC" in g["goal"] else _f(g["value"], ".2f") + "x"
        lines.append(f"| {g['model']} | {g['system']} | {g['goal']} | {value} | {'yes' if g['met'] else 'no'} |")
    return "\n".join(lines) + "\n"
