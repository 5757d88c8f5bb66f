"""What a replay shows: a table per reporting window (like the seed's: each metric's ours and
golden means over the window, the largest relative gap, the tolerance), the closing verdict, and
`replay.png` (every metric's curves, the gaps and each gap over its tolerance), from the typed
records of `parity.records`."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from rich.console import Group
from rich.table import Table

from model.train_step import AUX_TERMS, METRICS
from parity.lockstep_check import REROUTED_STEPS, TENSOR_KINDS, TOLERANCES, tensor_bounds
from parity.records import (
    LockstepDivergence,
    LockstepRecord,
    LockstepStep,
    ParamsCheck,
    ReplayRecord,
    StepCheck,
    TeacherForcedRecord,
)

LABELS = {
    "ce": "CE",
    "z_loss": "z-loss",
    "lb_loss": "LB loss",
    "router_z_loss": "router z-loss",
    "lr": "LR",
    "grad_norm": "grad norm",
}


def window_table(steps: list[StepCheck] | list[LockstepStep], *, title: str) -> Table:
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


TENSOR_LABELS = {
    "grad": "gradient",
    "update": "update",
    "step_exp_avg": "Adam m",
    "step_exp_avg_sq": "Adam v",
    "optimizer_update": "optimizer's update",
    "exp_avg": "optimizer's Adam m",
    "exp_avg_sq": "optimizer's Adam v",
}
"""The optimizer's: the JAX optimizer alone, on OLMo-core's gradients."""
WORST_SHOWN = 5
"""Tensors printed for a failing lockstep step."""


def _tensor_ratios(step: LockstepStep, kind: str) -> list[tuple[float, float, float, str]]:
    """(gap / tolerance, gap, tolerance, tensor) of every tensor for one `TensorGaps` kind."""
    field = TENSOR_KINDS[kind]
    out = []
    for name, gaps in step.tensors.items():
        gap = getattr(gaps, f"{kind}_rel_gap")
        tol = getattr(tensor_bounds(step.step, step.rerouted_blocks, name), field)
        out.append((gap / tol, gap, tol, name))
    return out


def lockstep_table(steps: list[LockstepStep], *, title: str) -> Group:
    """`window_table`'s metric rows with the MoE layers' largest LB and router z-loss gaps and
    token slots rerouted; then, per tensor gap kind, the tensor nearest (or farthest over) its
    tolerance."""
    metrics = window_table(steps, title=title)
    mark = lambda ok: "[green]ok[/]" if ok else "[red]over[/]"  # noqa: E731
    for name in AUX_TERMS:
        checks = [(s.layers[name], s.step) for s in steps]
        ratio, gap, tol, step = max(
            (g / t, g, t, step)
            for c, step in checks
            for g, t in zip(c.rel_gap, c.tolerance, strict=True)
        )
        row = (f"{LABELS[name]}, a layer", "", "", f"{gap:.2e}", str(step), f"{tol:.1e}")
        metrics.add_row(*row, mark(ratio <= 1))
    moved, step = max((max(s.tokens_rerouted), s.step) for s in steps)
    tol = TOLERANCES.rerouted_tokens
    row = ("tokens rerouted, a layer", "", "", str(moved), str(step), str(tol), mark(moved <= tol))
    metrics.add_row(*row)
    tensors = Table(title_justify="left")
    for column in ("tensor gap", "nearest its tolerance", "gap", "step", "tol", ""):
        tensors.add_column(column, justify="right" if column in ("gap", "step", "tol") else "left")
    for kind in TENSOR_KINDS:
        worst = max((*r, s.step) for s in steps for r in _tensor_ratios(s, kind))
        ratio, gap, tol, name, step = worst
        row = (TENSOR_LABELS[kind], name, f"{gap:.2e}", str(step), f"{tol:.1e}")
        tensors.add_row(*row, mark(ratio <= 1))
    return Group(metrics, tensors)


def _describe(d: LockstepDivergence) -> str:
    if d.kind == "skipped":
        return "the skip decision differs"
    if d.kind == "routing" and d.name == REROUTED_STEPS:
        window = TOLERANCES.rerouted_window
        return (
            f"{d.rel_gap:.0f} of the last {window} steps rerouted a token slot > {d.tolerance:.0f}"
        )
    if d.kind == "routing":
        return f"{d.rel_gap:.0f} token slots rerouted in MoE block {d.block} > {d.tolerance:.0f}"
    if d.kind == "trace":
        return "OLMo-core's metrics left the golden trace's envelope"
    if d.kind in TENSOR_LABELS:
        what = f"{TENSOR_LABELS[d.kind]} of {d.name}"
    elif d.kind == "layer":
        what = f"{LABELS[d.name]} of MoE block {d.block}"
    else:
        what = LABELS[d.name]
    return f"{what} {d.rel_gap:.2e} > {d.tolerance:.1e}"


def failing_step(check: LockstepStep, over: list[LockstepDivergence]) -> list[str]:
    """For a failing step, its WORST_SHOWN farthest over tolerance; nothing for a passing one."""
    if not over:
        return []
    head = f"[red]step {check.step}: {len(over)} over tolerance[/]"
    return [head, *(f"  {_describe(d)}" for d in over[:WORST_SHOWN])]


def lockstep_verdict(record: LockstepRecord) -> str:
    first = record.first_divergence
    if first is None:
        return "[green]lockstep: every step within tolerance[/]"
    block = "" if first.block is None else f" (block {first.block})"
    return f"[red]lockstep: first divergence at step {first.step}, {_describe(first)}{block}[/]"


def plot_lockstep(record: LockstepRecord, path: Path) -> None:
    """Each metric's gap per step, and the worst gradient, update and moment gap per step, each
    over its tolerance (above 1 = diverged), to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s.step for s in record.steps]
    fig, (metrics, tensors) = plt.subplots(1, 2, figsize=(14, 5), constrained_layout=True)
    for name in METRICS:
        ratio = [s.metrics[name].rel_gap / s.metrics[name].tolerance for s in record.steps]
        metrics.semilogy(steps, np.maximum(ratio, 1e-9), label=LABELS[name])
    for kind in TENSOR_KINDS:
        worst = [max(r[0] for r in _tensor_ratios(s, kind)) for s in record.steps]
        tensors.semilogy(steps, np.maximum(worst, 1e-9), label=f"worst {TENSOR_LABELS[kind]}")
    metrics.set_title("metric gap / tolerance")
    tensors.set_title("worst tensor gap / tolerance per step")
    for ax in (metrics, tensors):
        ax.axhline(1.0, color="red", lw=1)
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    fig.suptitle("lockstep: JAX against OLMo-core, every step from OLMo-core's state")
    fig.savefig(path, dpi=90)
    plt.close(fig)


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
