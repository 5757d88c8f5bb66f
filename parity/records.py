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
        """The `replay.json` dict of the teacher-forced view."""
        return {"view": "teacher-forced"} | dataclasses.asdict(self) | {"passed": self.passed}


@dataclass(frozen=True)
class ReplayRecord:
    """A free-running replay."""

    flags: str
    steps: list[StepCheck]
    params: list[ParamsCheck]
    first_divergence: Divergence | None
    tolerances: Tolerances

    @property
    def passed(self) -> bool:
        return self.first_divergence is None

    def to_json(self) -> dict[str, Any]:
        """The `replay.json` dict of the free-running view."""
        return {"view": "free-running"} | dataclasses.asdict(self) | {"passed": self.passed}


@dataclass(frozen=True)
class TensorGaps:
    """One parameter tensor at one lockstep step, |ours - OLMo-core's| / |OLMo-core's| (Frobenius
    norms of that tensor alone): its gradient before clipping, the whole step's update
    p(s + 1) - p(s) and Adam's two moments after it; the update and Adam's two moments after the
    step of the JAX optimizer alone, on OLMo-core's gradients."""

    grad_rel_gap: float
    update_rel_gap: float
    step_exp_avg_rel_gap: float
    step_exp_avg_sq_rel_gap: float
    optimizer_update_rel_gap: float
    exp_avg_rel_gap: float
    exp_avg_sq_rel_gap: float


@dataclass(frozen=True)
class TraceCheck:
    """OLMo-core's own step in lockstep against the golden trace's: its metrics (every one, each
    MoE layer's, the skip flag) within the trace's one-ulp envelope, their largest relative gap
    to the trace's values (0: the same bits), and at a saved step whether its params
    after the step are the trace's bit for bit (None at other steps)."""

    envelope: bool
    rel_gap: float
    params_bit_identical: bool | None


@dataclass(frozen=True)
class LockstepStep:
    """One lockstep step: every metric and MoE layer (as `StepCheck`), the token slots each MoE
    layer sent to other experts than OLMo-core did and the blocks of the layers that did, every
    tensor, and OLMo-core's own step against the golden trace's (None past the trace's steps)."""

    step: int
    metrics: dict[str, Check]
    layers: dict[str, Check]
    skipped: Skipped
    tokens_rerouted: list[int]
    rerouted_blocks: list[int]
    tensors: dict[str, TensorGaps]
    olmo_core_vs_trace: TraceCheck | None


@dataclass(frozen=True)
class LockstepDivergence:
    """The first step over tolerance and, of what is over there, the farthest over: `kind` one of
    "metric", "layer", "routing", "skipped", a `TensorGaps` kind ("grad", "update",
    "optimizer_update", "exp_avg", "exp_avg_sq") or "trace" (OLMo-core's metrics left the trace's
    bits where it reproduces the trace, its envelope elsewhere); `name` the metric or OLMo-core
    parameter; `block` its block."""

    step: int
    kind: str
    name: str
    block: int | None
    rel_gap: float
    tolerance: float


@dataclass(frozen=True)
class LockstepTolerances:
    """`goldens.tolerances.LockstepBounds` of a step whose expert counts agree, of one where a
    token slot went elsewhere (the blocks it did so in) and of that step's other tensors; the most
    slots rerouted a layer; the most rerouted steps in a window of `rerouted_window` steps; the
    parameters (named within their block) held to their own rounding's bounds where looser."""

    routed_alike: Any
    rerouted: Any
    rerouted_elsewhere: Any
    rerouted_tokens: int
    rerouted_steps: int
    rerouted_window: int
    own_rounding: dict[str, Any]


@dataclass(frozen=True)
class LockstepRecord:
    steps: list[LockstepStep]
    first_divergence: LockstepDivergence | None
    tolerances: LockstepTolerances
    trace_held: str
    """How OLMo-core's metrics were held to the trace's: "bit-identical" where its params at
    every saved step the run reached were the trace's bits, else "envelope" (and why)."""

    @property
    def passed(self) -> bool:
        return self.first_divergence is None

    def to_json(self) -> dict[str, Any]:
        """The `replay.json` dict of the lockstep view: the metric checks of every step at the top
        level (as the other views write them) and the whole record under "lockstep"."""
        whole = dataclasses.asdict(self) | {"passed": self.passed}
        metrics_only = [
            {k: s[k] for k in ("step", "metrics", "layers", "skipped")} for s in whole["steps"]
        ]
        first = whole["first_divergence"]
        return {
            "view": "lockstep",
            "steps": metrics_only,
            "passed": self.passed,
            "first_divergence": first,
            "lockstep": whole,
        }
