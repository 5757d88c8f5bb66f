"""What a replay shows: a table per reporting window (like the seed's: each metric's ours and
golden means over the window, the largest relative gap, the tolerance), the closing verdict, and
`replay.png` (every metric's curves, the gaps and each gap over its tolerance), from the typed
records of `parity.records`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.table import Table

from model.train_step import METRICS
from parity.records import ParamsCheck, ReplayRecord, StepCheck, TeacherForcedRecord

LABELS = {
    "ce": "CE",
    "z_loss": "z-loss",
    "lb_loss": "LB loss",
    "router_z_loss": "router z-loss",
    "lr": "LR",
    "grad_norm": "grad norm",
}


def window_table(steps: list[StepCheck], *, title: str) -> Table:
    """One row per metric over `steps`: mean ours, mean golden, the largest relative gap (the one
    nearest its tolerance) and its step, the tolerance there, ok."""
    table = Table(title=title, title_justify="left")
    for column in ("metric", "ours", "OLMo-core", "max gap", "step", "tol", ""):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for name in METRICS:
        rows = [s.metrics[name] for s in steps]
        worst = max(range(len(rows)), key=lambda i: rows[i].rel_gap / rows[i].tolerance)
        ok = all(r.ok for r in rows)
        table.add_row(
            LABELS[name],
            f"{np.mean([r.ours for r in rows]):.5g}",
            f"{np.mean([r.golden for r in rows]):.5g}",
            f"{rows[worst].rel_gap:.2e}",
            str(steps[worst].step),
            f"{rows[worst].tolerance:.1e}",
            "[green]ok[/]" if ok else "[red]over[/]",
        )
    return table


def params_line(check: ParamsCheck) -> str:
    """One saved step's params check: each tensor against its own tolerance."""
    if check.ok:
        head = f"params at step {check.step}: every tensor within its tolerance [green]ok[/]"
    else:
        over = ", ".join(check.over[:5]) + (" ..." if len(check.over) > 5 else "")
        head = f"params at step {check.step}: {len(check.over)} tensors over [red]{over}[/]"
    return (
        f"{head}; nearest its tolerance: {check.worst} {check.worst_rel_gap:.2e} "
        f"(tolerance {check.worst_tolerance:.1e}, OLMo-core's own {check.worst_spread:.1e}); "
        f"whole model {check.rel_gap:.2e}"
    )


def verdict(record: ReplayRecord | TeacherForcedRecord, *, what: str) -> str:
    """One line: passed, or the first step and metric that diverged and the worst layer."""
    first = record.first_divergence
    if first is None:
        return f"[green]{what}: every step within tolerance[/]"
    step = next(s for s in record.steps if s.step == first.step)
    metric = first.metric
    where = f"; MoE block with the largest aux-loss gap: {first.layer}"
    if metric == "params":
        check = next(p for p in record.params if p.step == first.step)
        detail = f"params: {check.worst} {check.worst_rel_gap:.2e} > "
        detail += f"{check.worst_tolerance:.1e} ({len(check.over)} tensors over)"
        where = ""
    elif metric == "skipped":
        detail = f"skipped: ours {step.skipped.ours}, OLMo-core {step.skipped.golden}"
    elif metric.endswith("_per_layer"):
        name = metric.removesuffix("_per_layer")
        m = step.layers[name]
        i = max(range(len(m.ok)), key=lambda j: m.rel_gap[j] / m.tolerance[j])
        detail = (
            f"{LABELS[name]} of MoE block {first.layer}: ours {m.ours[i]:.6g}, OLMo-core "
            f"{m.golden[i]:.6g}, gap {m.rel_gap[i]:.2e} > {m.tolerance[i]:.1e}"
        )
        where = ""
    else:
        m = step.metrics[metric]
        detail = (
            f"{LABELS[metric]}: ours {m.ours:.6g}, OLMo-core {m.golden:.6g}, "
            f"gap {m.rel_gap:.2e} > {m.tolerance:.1e}"
        )
    return f"[red]{what}: first divergence at step {first.step}, {detail}{where}[/]"


def plot(record: ReplayRecord, path: Path) -> None:
    """Curves of every metric (ours dashed over OLMo-core's), the relative gaps and each gap
    over its tolerance (above 1 = diverged), to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s.step for s in record.steps]
    fig, axes = plt.subplots(2, 4, figsize=(18, 8), constrained_layout=True)
    series = {
        name: {
            side: [getattr(s.metrics[name], side) for s in record.steps]
            for side in ("ours", "golden", "rel_gap", "spread", "tolerance")
        }
        for name in METRICS
    }
    for ax, name in zip(axes.flat, METRICS, strict=False):
        ax.plot(steps, series[name]["golden"], label="OLMo-core", lw=2, alpha=0.6)
        ax.plot(steps, series[name]["ours"], "--", label="JAX", lw=1.2)
        ax.set_title(LABELS[name])
        ax.set_xlabel("step")
        ax.legend()
    gaps, ratio = axes.flat[6], axes.flat[7]
    for color, name in enumerate(METRICS):
        gap = np.maximum(series[name]["rel_gap"], 1e-12)
        gaps.semilogy(steps, gap, color=f"C{color}", label=LABELS[name])
        own = np.maximum(series[name]["spread"], 1e-12)
        gaps.semilogy(steps, own, ":", color=f"C{color}")
        ratio.semilogy(steps, gap / np.asarray(series[name]["tolerance"]), label=LABELS[name])
    gaps.set_title("relative gap to OLMo-core (dotted: OLMo-core's own spread)")
    ratio.set_title("gap / tolerance (above 1: diverged)")
    ratio.axhline(1.0, color="red", lw=1)
    for ax in (gaps, ratio):
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.suptitle(f"replay against OLMo-core's trace, flags: {record.flags}")
    fig.savefig(path, dpi=90)
    plt.close(fig)
