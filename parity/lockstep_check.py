"""Holding one lockstep step to its tolerances (`goldens.tolerances.LOCKSTEP_*`).

Both sides start from the same state, so each gap is one step's rounding, not compounded chaos:
- routing: each MoE layer's expert counts; a near-tie may send a token slot to another expert on
  one side (at most LOCKSTEP_REROUTED_TOKENS a layer). At such a step the metrics and the
  tensors of the blocks whose MoE layer rerouted a slot are held to LOCKSTEP_REROUTED, the other
  tensors to LOCKSTEP_REROUTED_ELSEWHERE, instead of LOCKSTEP_ROUTED_ALIKE (`bounds`,
  `tensor_bounds`); at most LOCKSTEP_REROUTED_STEPS of any LOCKSTEP_REROUTED_WINDOW steps may
  be such steps (`rerouted_steps`);
- every metric and each MoE layer's LB and router z-loss: its relative gap; the skip decision
  equal;
- every parameter tensor: its gradient before clipping, the whole step's update
  p(s + 1) - p(s) and Adam's moments after it; then the JAX optimizer alone on OLMo-core's
  gradients, its update and Adam's moments. Each gap is |ours - OLMo-core's| over OLMo-core's
  norm of that tensor, held to the step's bounds or, for the few tensors whose own rounding is
  larger (LOCKSTEP_OWN_ROUNDING), their own (`tensor_bounds`). The whole step's update is loose
  at step 1, where Adam turns the rounding of gradients near its eps into full-size updates, and
  tight after it. The optimizer alone is tight: it sees the same gradients;
- OLMo-core's own metrics against the golden trace's: where this CPU reproduces the trace (its
  params bit-identical to the trace's at every saved step the run reaches: `trace_reproduced`),
  every metric of every step bit for bit; elsewhere, and in a run that reaches no saved step,
  within the trace's one-ulp envelope (the free-running check).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from goldens.envelope import rel_gap
from goldens.tolerances import (
    LOCKSTEP_OWN_ROUNDING,
    LOCKSTEP_REROUTED,
    LOCKSTEP_REROUTED_ELSEWHERE,
    LOCKSTEP_REROUTED_STEPS,
    LOCKSTEP_REROUTED_TOKENS,
    LOCKSTEP_REROUTED_WINDOW,
    LOCKSTEP_ROUTED_ALIKE,
    LockstepBounds,
)
from model.train_step import AUX_TERMS, METRICS
from parity.compare import block_of, checked, compare_step, divergence
from parity.lockstep import OlmoCoreStep, StepResult
from parity.olmo_core_state import Tensors
from parity.records import (
    LockstepDivergence,
    LockstepRecord,
    LockstepStep,
    LockstepTolerances,
    Skipped,
    TensorGaps,
    TraceCheck,
)
from parity.trace import GoldenTrace

TENSOR_KINDS = {
    "grad": "grad",
    "update": "update",
    "step_exp_avg": "moments",
    "step_exp_avg_sq": "moments",
    "optimizer_update": "optimizer",
    "exp_avg": "optimizer",
    "exp_avg_sq": "optimizer",
}
"""Each tensor gap of `TensorGaps` ("<kind>_rel_gap") -> its field of `LockstepBounds`."""
ROUNDINGS = 2
"""Float32 roundings of a parameter per OLMo-core AdamW step (`update_gaps`)."""
TOLERANCES = LockstepTolerances(
    LOCKSTEP_ROUTED_ALIKE,
    LOCKSTEP_REROUTED,
    LOCKSTEP_REROUTED_ELSEWHERE,
    LOCKSTEP_REROUTED_TOKENS,
    LOCKSTEP_REROUTED_STEPS,
    LOCKSTEP_REROUTED_WINDOW,
    LOCKSTEP_OWN_ROUNDING,
)
REROUTED_STEPS = "rerouted steps"
"""The name of a "routing" divergence over LOCKSTEP_REROUTED_STEPS (`rerouted_steps`)."""


def _relative(diff: dict[str, float], norm: dict[str, float]) -> dict[str, float]:
    """diff / norm, per tensor: each against its own size."""
    return {n: diff[n] / max(norm[n], np.finfo(float).tiny) for n in norm}


def _norm(x) -> float:
    """The Frobenius norm in float64, summed by numpy itself: `np.linalg.norm` calls BLAS, whose
    threads cost about 1 ms a call to wake on a busy 2-core machine (0.3 s a step for 207
    tensors, 60x the sum's time)."""
    x = np.asarray(x, np.float64)
    return float(np.sqrt(np.sum(x * x)))


def tensor_gaps(ours: Tensors, golden: Tensors) -> dict[str, float]:
    """|ours - golden| / |golden| per tensor."""
    diff = {n: _norm(np.asarray(ours[n], np.float64) - golden[n]) for n in golden}
    return _relative(diff, {n: _norm(g) for n, g in golden.items()})


def update_gaps(before: Tensors, ours: Tensors, golden: Tensors) -> dict[str, float]:
    """The gap of the updates p(s + 1) - p(s) per tensor. OLMo-core rounds p to float32 twice a
    step (the decay p (1 - lr wd) in place, then the Adam step), we once, so an element's new
    values may differ by ROUNDINGS ulps of p whatever the updates were (p = 2.7 and an update of
    6.6e-5: one ulp is 0.4% of it); each element's gap is what exceeds them."""
    diff = {}
    for n, g in golden.items():
        allowed = ROUNDINGS * np.spacing(np.abs(g))
        excess = np.abs(np.asarray(ours[n], np.float64) - g) - allowed
        diff[n] = _norm(np.maximum(excess, 0.0))
    return _relative(
        diff, {n: _norm(np.asarray(g, np.float64) - before[n]) for n, g in golden.items()}
    )


def tokens_rerouted(ours, golden) -> list[int]:
    """Per MoE layer, the token slots one side sent elsewhere: half the L1 distance between the
    expert counts [layers, E] (one slot moved changes two counts by one)."""
    moved = np.abs(np.asarray(ours, np.int64) - np.asarray(golden, np.int64)).sum(-1) // 2
    return moved.tolist()


def bounds(step: int, rerouted: list[int]) -> LockstepBounds:
    """The bounds of step `step` (its metrics'): LOCKSTEP_REROUTED where a MoE layer rerouted a
    token slot; at step 1 `update` is their `first_update`."""
    chosen = LOCKSTEP_REROUTED if any(rerouted) else LOCKSTEP_ROUTED_ALIKE
    return _at_step(chosen, step)


def _at_step(chosen: LockstepBounds, step: int) -> LockstepBounds:
    return dataclasses.replace(chosen, update=chosen.first_update) if step == 1 else chosen


def own_rounding(name: str) -> LockstepBounds | None:
    """LOCKSTEP_OWN_ROUNDING's bounds of parameter `name` ("blocks.3.attention.A_log" as
    "attention.A_log"), if it names them."""
    return LOCKSTEP_OWN_ROUNDING.get(name.split(".", 2)[-1] if name.startswith("blocks.") else name)


def tensor_bounds(step: int, rerouted_blocks: list[int], name: str) -> LockstepBounds:
    """The bounds of parameter `name` at step `step`, where the MoE layers of `rerouted_blocks`
    rerouted a token slot: LOCKSTEP_REROUTED for the tensors of those blocks and for those whose
    own rounding is larger (`own_rounding`: their gradients are sums that nearly cancel, moved
    by one token anywhere), LOCKSTEP_REROUTED_ELSEWHERE for the others; each no tighter than
    `own_rounding`'s."""
    own = own_rounding(name)
    if not rerouted_blocks:
        chosen = LOCKSTEP_ROUTED_ALIKE
    elif block_of(name) in rerouted_blocks or own is not None:
        chosen = LOCKSTEP_REROUTED
    else:
        chosen = LOCKSTEP_REROUTED_ELSEWHERE
    step_bounds = _at_step(chosen, step)
    if own is None:
        return step_bounds
    own = _at_step(own, step)
    return LockstepBounds(
        *(max(getattr(step_bounds, f.name), getattr(own, f.name)) for f in dataclasses.fields(own))
    )


def check_step(trace: GoldenTrace, oc: OlmoCoreStep, ours: StepResult) -> LockstepStep:
    golden = oc.result
    rerouted = tokens_rerouted(ours.metrics["expert_counts"], golden.metrics["expert_counts"])
    bar = bounds(oc.step, rerouted).metric
    metrics = {
        name: checked(ours.metrics[name], golden.metrics[name], 0.0, bar) for name in METRICS
    }
    layers = {
        name: checked(
            ours.metrics[f"{name}_per_layer"],
            golden.metrics[f"{name}_per_layer"],
            np.zeros(len(golden.metrics[f"{name}_per_layer"])),
            bar,
        )
        for name in AUX_TERMS
    }
    before, alone = oc.before.params, ours.optimizer_alone
    gaps = {
        "grad": tensor_gaps(ours.grads, golden.grads),
        "update": update_gaps(before, ours.after.params, golden.after.params),
        "step_exp_avg": tensor_gaps(ours.after.exp_avg, golden.after.exp_avg),
        "step_exp_avg_sq": tensor_gaps(ours.after.exp_avg_sq, golden.after.exp_avg_sq),
        "optimizer_update": update_gaps(before, alone.params, golden.after.params),
        "exp_avg": tensor_gaps(alone.exp_avg, golden.after.exp_avg),
        "exp_avg_sq": tensor_gaps(alone.exp_avg_sq, golden.after.exp_avg_sq),
    }
    tensors = {n: TensorGaps(*(gaps[kind][n] for kind in TENSOR_KINDS)) for n in golden.grads}
    skipped = Skipped(bool(ours.metrics["skipped"]), bool(golden.metrics["skipped"]))
    blocks = [trace.moe_blocks[i] for i, moved in enumerate(rerouted) if moved]
    vs_trace = trace_check(trace, oc) if oc.step <= trace.steps else None
    return LockstepStep(oc.step, metrics, layers, skipped, rerouted, blocks, tensors, vs_trace)


def trace_check(trace: GoldenTrace, oc: OlmoCoreStep) -> TraceCheck:
    """OLMo-core's step `oc` against the trace's: its metrics against the envelope and the
    trace's values (float64, as OLMo-core logs them), its params after a saved step against the
    trace's bits."""
    i, mine = oc.step - 1, oc.result.metrics
    envelope = divergence(trace, compare_step(trace, oc.step, mine, free=True)) is None
    pairs = [(mine[n], trace.metrics[n][i]) for n in (*METRICS, "skipped")]
    pairs += [(mine[f"{n}_per_layer"], trace.metrics[f"{n}_per_block"][i]) for n in AUX_TERMS]
    gap = max(float(np.max(rel_gap(ours, golden))) for ours, golden in pairs)
    params = None
    if oc.step in trace.snapshot_steps:
        saved, after = trace.params(oc.step), oc.result.after.params
        params = all(after[n].tobytes() == saved[n].tobytes() for n in saved)
    return TraceCheck(envelope, gap, params)


def trace_reproduced(steps: Sequence[LockstepStep]) -> bool | None:
    """Whether OLMo-core reproduces the golden trace on this CPU: its params bit-identical to
    the trace's at every saved step among `steps` (None: the run reached none)."""
    seen = [
        s.olmo_core_vs_trace.params_bit_identical
        for s in steps
        if s.olmo_core_vs_trace is not None
        and s.olmo_core_vs_trace.params_bit_identical is not None
    ]
    return all(seen) if seen else None


def rerouted_steps(check: LockstepStep, earlier: Sequence[LockstepStep]) -> int:
    """Steps, of the LOCKSTEP_REROUTED_WINDOW ending at `check` (`earlier`: the steps before it),
    in which a MoE layer rerouted a token slot."""
    window = (c for c in (*earlier, check) if c.step > check.step - LOCKSTEP_REROUTED_WINDOW)
    return sum(any(c.tokens_rerouted) for c in window)


def _over(
    trace: GoldenTrace, check: LockstepStep, earlier: Sequence[LockstepStep], reproduced: bool
) -> list[LockstepDivergence]:
    """Everything over its tolerance at this step; OLMo-core's metrics held to the trace's bits
    where `reproduced`, to its envelope elsewhere."""
    s, out = check.step, []
    for name, c in check.metrics.items():
        if not c.ok:
            out.append(LockstepDivergence(s, "metric", name, None, c.rel_gap, c.tolerance))
    for name, c in check.layers.items():
        for i, ok in enumerate(c.ok):
            if not ok:
                block = trace.moe_blocks[i]
                out.append(
                    LockstepDivergence(s, "layer", name, block, c.rel_gap[i], c.tolerance[i])
                )
    for i, moved in enumerate(check.tokens_rerouted):
        if moved > LOCKSTEP_REROUTED_TOKENS:
            block = trace.moe_blocks[i]
            out.append(
                LockstepDivergence(
                    s, "routing", "tokens rerouted", block, moved, LOCKSTEP_REROUTED_TOKENS
                )
            )
    if any(check.tokens_rerouted):
        steps = rerouted_steps(check, earlier)
        if steps > LOCKSTEP_REROUTED_STEPS:
            out.append(
                LockstepDivergence(
                    s, "routing", REROUTED_STEPS, None, steps, LOCKSTEP_REROUTED_STEPS
                )
            )
    if check.skipped.ours != check.skipped.golden:
        out.append(LockstepDivergence(s, "skipped", "skipped", None, 1.0, 0.0))
    for name, t in check.tensors.items():
        step_bounds = tensor_bounds(s, check.rerouted_blocks, name)
        for kind, field in TENSOR_KINDS.items():
            gap, tol = getattr(t, f"{kind}_rel_gap"), getattr(step_bounds, field)
            if gap > tol:
                out.append(LockstepDivergence(s, kind, name, block_of(name), gap, tol))
    vs_trace = check.olmo_core_vs_trace
    if vs_trace is not None and reproduced and vs_trace.rel_gap > 0:
        out.append(
            LockstepDivergence(
                s, "trace", "OLMo-core's bits vs the trace", None, vs_trace.rel_gap, 0.0
            )
        )
    elif vs_trace is not None and not reproduced and not vs_trace.envelope:
        out.append(LockstepDivergence(s, "trace", "OLMo-core vs the trace", None, np.inf, 0.0))
    return out


def over_tolerance(
    trace: GoldenTrace,
    check: LockstepStep,
    earlier: Sequence[LockstepStep] = (),
    reproduced: bool | None = None,
) -> list[LockstepDivergence]:
    """What is over its tolerance at this step (`earlier`: the steps before it), farthest over
    first; `reproduced`: whether OLMo-core reproduces the trace here (`trace_reproduced`; by
    default as far as `earlier` and this step show)."""
    if reproduced is None:
        reproduced = bool(trace_reproduced([*earlier, check]))
    ratio = lambda d: np.inf if d.tolerance == 0 else d.rel_gap / d.tolerance  # noqa: E731
    return sorted(_over(trace, check, earlier, reproduced), key=ratio, reverse=True)


def trace_held(reproduced: bool | None) -> str:
    """How OLMo-core's metrics are held to the trace's, in words (`LockstepRecord.trace_held`)."""
    if reproduced:
        return "bit-identical: OLMo-core's params at the saved steps reached are the trace's bits"
    if reproduced is None:
        return "envelope: the run reached no saved step to show whether this CPU reproduces it"
    return "envelope: OLMo-core's params at a saved step differ from the trace's on this CPU"


def lockstep_record(
    trace: GoldenTrace, steps: list[LockstepStep], reproduced: bool | None = None
) -> LockstepRecord:
    """The run's record; OLMo-core's metrics held to the trace's bits if `reproduced` (by
    default: if the run's saved steps show it, `trace_reproduced`), else to its envelope."""
    if reproduced is None:
        reproduced = trace_reproduced(steps)
    overs = (over_tolerance(trace, s, steps[:i], bool(reproduced)) for i, s in enumerate(steps))
    first = next((o[0] for o in overs if o), None)
    return LockstepRecord(steps, first, TOLERANCES, trace_held(reproduced))
