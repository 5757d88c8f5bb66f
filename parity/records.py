"""The records of a replay: each metric's check at each step, each saved step's parameter check,
the first divergence. `ReplayRecord.to_json` is `replay.json`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

Value = float | list[float]
"""A total, or one value per MoE layer."""


@dataclass(frozen=True)
class Check:
    """One metric at one step: ours, OLMo-core's, the relative gap, OLMo-core's own spread up to
    this step (0 when teacher-forced), the tolerance, and whether the gap is within it (a list
    each, one per MoE layer, for a per-layer metric)."""

    ours: Value
    golden: Value
    rel_gap: Value
    spread: Value
    tolerance: Value
    ok: bool | list[bool]


@dataclass(frozen=True)
class Skipped:
    """Whether each side skipped the optimizer step."""

    ours: bool
    golden: bool


@dataclass(frozen=True)
class StepCheck:
    """Every metric of one step (`metrics`, keyed by `model.train_step.METRICS`) and each MoE
    layer's aux losses (`layers`, keyed by `model.train_step.AUX_TERMS`)."""

    step: int
    metrics: dict[str, Check]
    layers: dict[str, Check]
    skipped: Skipped


@dataclass(frozen=True)
class TensorCheck:
    rel_gap: float
    spread: float
    tolerance: float


@dataclass(frozen=True)
class ParamsCheck:
    """Every parameter tensor at a saved step against its own tolerance; the one nearest (or
    farthest over) it; the whole model's gap for reference."""

    step: int
    rel_gap: float
    ok: bool
    over: list[str]
    worst: str
    worst_rel_gap: float
    worst_spread: float
    worst_tolerance: float
    tensors: dict[str, TensorCheck]


@dataclass(frozen=True)
class Divergence:
    """The first step and metric over tolerance ("<aux>_per_layer" for one layer's, "skipped",
    "params"), and the OLMo-core block it points at (None when no block is involved)."""

    step: int
    metric: str
    layer: int | None


@dataclass(frozen=True)
class Tolerances:
    bars: dict[str, float]
    params: float
    spread_factor: float


@dataclass(frozen=True)
class TeacherForcedRecord:
    steps: list[StepCheck]
    first_divergence: Divergence | None

    @property
    def passed(self) -> bool:
        return self.first_divergence is None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"passed": self.passed}


@dataclass(frozen=True)
class ReplayRecord:
    """A free-running replay, and its teacher-forced view when one was asked for."""

    flags: str
    steps: list[StepCheck]
    params: list[ParamsCheck]
    first_divergence: Divergence | None
    tolerances: Tolerances
    teacher_forced: TeacherForcedRecord | None = None

    @property
    def passed(self) -> bool:
        """The free-running view's verdict (the teacher-forced view has its own)."""
        return self.first_divergence is None

    def to_json(self) -> dict[str, Any]:
        """The `replay.json` dict."""
        out = dataclasses.asdict(self) | {"passed": self.passed}
        if self.teacher_forced is None:
            del out["teacher_forced"]
        else:
            out["teacher_forced"] = self.teacher_forced.to_json()
        return out
