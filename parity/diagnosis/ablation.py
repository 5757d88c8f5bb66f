"""Each candidate's free-running replay and its signed gaps to OLMo-core's trace."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from model.train_step import AUX_TERMS, METRICS
from parity.diagnosis.candidates import candidates
from parity.run import Metrics, free_running, release_compiled
from parity.trace import GoldenTrace

GAPS = (*(m for m in METRICS if m != "lr"), "aux")
"""The metrics whose gaps are recorded; "aux" is LB + router z-loss."""


class UnknownCandidateError(ValueError):
    pass


@dataclass(frozen=True)
class Ablation:
    """One candidate's run: its metrics at every step and (ours - golden) / |golden| of every
    `GAPS` metric at every step."""

    name: str
    what: str
    rows: list[Metrics]
    gaps: dict[str, list[float]]


def _aux(metrics) -> np.ndarray:
    return sum(np.asarray(metrics[name], np.float64) for name in AUX_TERMS)


def signed_gaps(trace: GoldenTrace, rows: list[Metrics]) -> dict[str, list[float]]:
    """(ours - golden) / |golden| of every `GAPS` metric at every step."""
    golden = {name: trace.metrics[name][: len(rows)] for name in METRICS}
    ours = {name: np.array([row[name] for row in rows]) for name in METRICS}
    golden["aux"], ours["aux"] = _aux(golden), _aux(ours)
    return {name: ((ours[name] - golden[name]) / np.abs(golden[name])).tolist() for name in GAPS}


def run_all(trace: GoldenTrace, *, steps: int, names: list[str] | None = None) -> list[Ablation]:
    """The candidates named (all by default), each for `steps` steps."""
    chosen = [c for c in candidates(trace.config) if names is None or c.name in names]
    unknown = sorted(set(names or ()) - {c.name for c in chosen})
    if unknown:
        known = [c.name for c in candidates(trace.config)]
        raise UnknownCandidateError(f"unknown candidates {unknown}; known: {known}")
    results = []
    for i, candidate in enumerate(chosen):
        if i:  # a dozen compiled steps in one process exhaust LLVM's memory maps
            release_compiled()
        rows, _ = free_running(trace, candidate.run, steps=steps, on_step=lambda *_: None)
        result = Ablation(candidate.name, candidate.what, rows, signed_gaps(trace, rows))
        results.append(result)
        print(f"{candidate.name}: {_summary(result.gaps)}", flush=True)
    return results


def _summary(gaps: dict[str, list[float]]) -> str:
    return ", ".join(f"{k} {min(v):+.1e}..{max(v):+.1e}" for k, v in gaps.items())
