"""Comparing a run with OLMo-core's trace, step by step and at the saved params.

A metric (each MoE layer's LB and router z-loss too) passes a step when its relative gap is within
the issue's bar (`REPLAY_CE`, `REPLAY_METRIC`, `REPLAY_PARAMS`) or within `REPLAY_SPREAD_FACTOR`
times the spread OLMo-core shows against itself when its step-0 weights move by one ulp
(goldens.envelope: that metric's or layer's largest gap up to that step, that tensor's distance at
that step). The teacher-forced view is held to the issue's bars alone.
"""

from __future__ import annotations

import numpy as np

from goldens.envelope import metric_spread, norm_gap, param_spread, rel_gap
from goldens.tolerances import REPLAY_CE, REPLAY_METRIC, REPLAY_PARAMS, REPLAY_SPREAD_FACTOR
from model.train_step import AUX_TERMS, METRICS
from parity.records import (
    Check,
    Divergence,
    ParamsCheck,
    ReplayRecord,
    Skipped,
    StepCheck,
    TeacherForcedRecord,
    TensorCheck,
    Tolerances,
)
from parity.run import Metrics
from parity.trace import GoldenTrace

BARS = {name: REPLAY_CE if name == "ce" else REPLAY_METRIC for name in METRICS}


def spread(trace: GoldenTrace, name: str) -> np.ndarray:
    """[steps, ...]: OLMo-core's own spread of metric `name` (or "<name>_per_block") up to each
    step: the largest relative gap of its one-ulp-perturbed runs to the trace."""
    return metric_spread(trace.perturbed[name], trace.metrics[name])


def checked(ours, golden, own, bar: float) -> Check:
    """Within `bar` or `REPLAY_SPREAD_FACTOR` times OLMo-core's own spread `own`."""
    gap = rel_gap(ours, golden)
    tol = np.maximum(bar, REPLAY_SPREAD_FACTOR * np.asarray(own))
    plain = lambda a: np.asarray(a).tolist()  # noqa: E731
    return Check(ours, plain(golden), plain(gap), plain(own), plain(tol), plain(gap <= tol))


def compare_step(trace: GoldenTrace, step: int, ours: Metrics, *, free: bool) -> StepCheck:
    """One step's checks; OLMo-core's own spread counts only when `free` (running)."""
    i = step - 1
    own = lambda key: spread(trace, key)[i] if free else np.zeros_like(trace.metrics[key][i])  # noqa: E731
    metrics = {
        name: checked(ours[name], float(trace.metrics[name][i]), float(own(name)), BARS[name])
        for name in METRICS
    }
    layers = {
        name: checked(
            ours[f"{name}_per_layer"],
            trace.metrics[f"{name}_per_block"][i],
            own(f"{name}_per_block"),
            BARS[name],
        )
        for name in AUX_TERMS
    }
    skipped = Skipped(bool(ours["skipped"]), bool(trace.metrics["skipped"][i]))
    return StepCheck(step, metrics, layers, skipped)


def _worst_layer(trace: GoldenTrace, layers: dict[str, Check]) -> int:
    """OLMo-core block index of the MoE layer whose LB or router z-loss is farthest over (or
    nearest) its tolerance."""
    over = np.max([np.divide(layers[n].rel_gap, layers[n].tolerance) for n in AUX_TERMS], 0)
    return trace.moe_blocks[int(np.argmax(over))]


def divergence(trace: GoldenTrace, check: StepCheck) -> Divergence | None:
    """The first metric over its tolerance at this step (totals first, then each MoE layer's
    "<name>_per_layer"), the skip flag, and the MoE block farthest over."""
    bad = [name for name in METRICS if not check.metrics[name].ok]
    bad += [f"{n}_per_layer" for n in AUX_TERMS if not all(check.layers[n].ok)]
    if check.skipped.ours != check.skipped.golden:
        bad.append("skipped")
    if not bad:
        return None
    return Divergence(check.step, bad[0], _worst_layer(trace, check.layers))


def compare_params(trace: GoldenTrace, step: int, ours: dict[str, np.ndarray]) -> ParamsCheck:
    """Each parameter tensor's |ours - golden| / |golden| at a saved step against
    max(REPLAY_PARAMS, REPLAY_SPREAD_FACTOR x its own spread: the farthest perturbed run's
    distance for that tensor); the whole model's gap for reference."""
    golden = trace.params(step)
    names = trace.param_names
    gaps = np.array([norm_gap(ours[n], golden[n]) for n in names])
    own = param_spread(trace.perturbed[f"params_rel_diff_step{step}"])
    tol = np.maximum(REPLAY_PARAMS, REPLAY_SPREAD_FACTOR * own)
    worst = int(np.argmax(gaps / tol))
    whole = norm_gap(
        np.concatenate([np.ravel(ours[n]) for n in names]),
        np.concatenate([np.ravel(golden[n]) for n in names]),
    )
    return ParamsCheck(
        step=step,
        rel_gap=whole,
        ok=bool(np.all(gaps <= tol)),
        over=[names[i] for i in np.flatnonzero(gaps > tol)],
        worst=names[worst],
        worst_rel_gap=float(gaps[worst]),
        worst_spread=float(own[worst]),
        worst_tolerance=float(tol[worst]),
        tensors={
            n: TensorCheck(float(g), float(o), float(t))
            for n, g, o, t in zip(names, gaps, own, tol, strict=True)
        },
    )


def block_of(name: str) -> int | None:
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blocks" else None


def free_running_record(
    trace: GoldenTrace, rows: list[Metrics], params: dict[int, dict], *, flags: str
) -> ReplayRecord:
    """The record of a free-running replay: its rows (steps 1..) and its params at saved steps."""
    steps = [compare_step(trace, i + 1, row, free=True) for i, row in enumerate(rows)]
    checks = [compare_params(trace, s, params[s]) for s in sorted(params)]
    first = None
    for check in steps:
        first = divergence(trace, check)
        saved = [p for p in checks if p.step == check.step and not p.ok]
        if first is None and saved:
            first = Divergence(check.step, "params", block_of(saved[0].worst))
        if first is not None:
            break
    tolerances = Tolerances(BARS, REPLAY_PARAMS, REPLAY_SPREAD_FACTOR)
    return ReplayRecord(flags, steps, checks, first, tolerances)


def teacher_forced_record(
    trace: GoldenTrace, results: list[tuple[int, Metrics]]
) -> TeacherForcedRecord:
    steps = [compare_step(trace, step, row, free=False) for step, row in results]
    first = next((d for d in (divergence(trace, s) for s in steps) if d is not None), None)
    return TeacherForcedRecord(steps, first)
