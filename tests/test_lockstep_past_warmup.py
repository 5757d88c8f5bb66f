"""Lockstep past the micro config's warmup, in the gate: OLMo-core restores the trace's training
state after step 9 (`python -m parity.replay --from-step 10 --steps 12`) and steps 10-12 run on
one device with the LR at its peak. The same steps run again with the two sides one after the
other and an LR 0.1% high from step 12 (a bug only a step after warmup shows): steps 10 and 11
are those of the replay.json of the sides overlapped (the default), step for step, and the fault
is named at step 12 by the JAX optimizer's update.

OLMo-core's own metrics are held to the trace's bits where this CPU reproduces the trace (its
params at step 10 the trace's bits), to the one-ulp envelope elsewhere. Each branch is forced on
a trace that OLMo-core's run here reproduces by construction, so both run on any CPU: a committed
CE, grad norm or MoE layer's LB loss 1% off is named by the first; the last two pass the second."""

import dataclasses
import json

import numpy as np
import pytest

from model.train_step import AUX_TERMS, METRICS
from parity import replay
from parity.faults import InjectedFault
from parity.lockstep import lockstep
from parity.lockstep_check import check_step, lockstep_record, trace_check, trace_reproduced
from parity.run import Run
from parity.trace import load_trace

FIRST, LAST = 10, 12
LR_FAULT = InjectedFault(LAST, train_scale=(("lr", 1.001),))


@pytest.fixture(scope="module")
def overlapped(tmp_path_factory):
    out = tmp_path_factory.mktemp("past-warmup")
    argv = ["--from-step", str(FIRST), "--steps", str(LAST), "--out", str(out), "--window", "3"]
    code = replay.main(argv)
    return code, json.loads((out / "replay.json").read_text())


@pytest.fixture(scope="module")
def sequential():
    """Steps 10-12 with the sides one after the other, the LR fault from step 12: (OLMo-core's
    step, ours)."""
    trace, steps = load_trace(), []
    lockstep(
        trace,
        Run(trace.config, fault=LR_FAULT),
        steps=LAST,
        first=FIRST,
        overlap=False,
        on_step=lambda oc, ours: steps.append((oc, ours)),
    )
    return steps


@pytest.fixture(scope="module")
def checks(sequential):
    trace = load_trace()
    return [check_step(trace, oc, ours) for oc, ours in sequential]


@pytest.fixture(scope="module")
def before_fault(sequential, checks):
    """Steps 10 and 11: (OLMo-core's steps, their checks)."""
    n = LR_FAULT.first - FIRST
    return [oc for oc, _ in sequential[:n]], checks[:n]


def test_steps_past_warmup_pass_with_the_lr_at_its_peak(overlapped):
    code, record = overlapped
    trace = load_trace()
    assert code == 0 and record["passed"], record["first_divergence"]
    assert [s["step"] for s in record["lockstep"]["steps"]] == [10, 11, 12]
    train = trace.config.train
    assert train.warmup_steps <= FIRST
    assert all(s["metrics"]["lr"]["golden"] == pytest.approx(train.lr) for s in record["steps"])


def test_the_overlapped_sides_write_the_sequential_replay_json(overlapped, before_fault):
    """Steps 10 and 11, before the fault acts: the JAX step 10 ran beside OLMo-core's step 11."""
    alone = json.loads(json.dumps(lockstep_record(load_trace(), before_fault[1]).to_json()))
    together, n = overlapped[1], len(alone["steps"])
    assert n == 2
    assert together["steps"][:n] == alone["steps"]
    assert together["lockstep"]["steps"][:n] == alone["lockstep"]["steps"]
    assert together["lockstep"]["trace_held"] == alone["lockstep"]["trace_held"]


def test_an_lr_one_permille_high_past_warmup_is_named_at_its_step(checks):
    first = lockstep_record(load_trace(), checks).first_divergence
    assert first is not None, "missed"
    assert (first.step, first.kind) == (LR_FAULT.first, "optimizer_update"), first


def _reproduced_by(trace, sequential, shift: tuple[str, int, float] | None = None):
    """`trace` with OLMo-core's metrics of these steps as its own, the metric `shift` =
    (name, step, factor) scaled."""
    metrics = {k: np.array(v, copy=True) for k, v in trace.metrics.items()}
    for oc, _ in sequential:
        mine, i = oc.result.metrics, oc.step - 1
        for name in (*METRICS, "skipped"):
            metrics[name][i] = mine[name]
        for name in AUX_TERMS:
            metrics[f"{name}_per_block"][i] = mine[f"{name}_per_layer"]
    if shift is not None:
        name, step, factor = shift
        metrics[name][step - 1] *= factor
    return dataclasses.replace(trace, metrics=metrics)


def _first(trace, olmo_core_steps, checks, reproduced: bool):
    """The first divergence of `checks` with OLMo-core's steps held to `trace`."""
    held = [
        dataclasses.replace(check, olmo_core_vs_trace=trace_check(trace, oc))
        for check, oc in zip(checks, olmo_core_steps, strict=True)
    ]
    return lockstep_record(trace, held, reproduced=reproduced).first_divergence


def test_where_the_trace_is_reproduced_a_committed_metric_one_percent_off_is_named(
    sequential, before_fault
):
    """The grad norm's and a MoE layer's LB loss 1% off lie inside the envelope at step 11 (its
    bars there: 3.0 and 0.29 relative; and a committed metric shifted widens its own envelope,
    the perturbed runs' distance to it); held bit for bit, they and the CE are named."""
    trace, (olmo_core, checks) = load_trace(), before_fault
    assert _first(_reproduced_by(trace, sequential), olmo_core, checks, reproduced=True) is None
    for name in ("ce", "lb_loss_per_block", "grad_norm"):
        shifted = _reproduced_by(trace, sequential, (name, 11, 1.01))
        first = _first(shifted, olmo_core, checks, reproduced=True)
        assert first is not None and (first.step, first.kind) == (11, "trace"), (name, first)
        assert first.rel_gap == pytest.approx(0.01 / 1.01, rel=1e-3), name
        assert _first(shifted, olmo_core, checks, reproduced=False) is None, name


def test_elsewhere_the_envelope_holds_olmo_cores_metrics(sequential, before_fault):
    """OLMo-core's own CE at step 11 1.5x, as a CPU whose OLMo-core left the envelope."""
    trace = _reproduced_by(load_trace(), sequential)
    olmo_core, checks = list(before_fault[0]), before_fault[1]
    assert _first(trace, olmo_core, checks, reproduced=False) is None
    oc = olmo_core[-1]
    metrics = oc.result.metrics | {"ce": oc.result.metrics["ce"] * 1.5}
    olmo_core[-1] = dataclasses.replace(oc, result=dataclasses.replace(oc.result, metrics=metrics))
    first = _first(trace, olmo_core, checks, reproduced=False)
    assert first is not None and (first.step, first.kind) == (11, "trace"), first


def test_the_run_says_whether_this_cpu_reproduces_the_trace(overlapped, checks):
    """Step 10 is a saved step: OLMo-core's params after it decide, and the record says so."""
    assert checks[0].olmo_core_vs_trace.params_bit_identical is not None
    reproduced = trace_reproduced(checks)
    held = overlapped[1]["lockstep"]["trace_held"]
    assert held.startswith("bit-identical" if reproduced else "envelope"), held
    if reproduced:
        assert all(c.olmo_core_vs_trace.rel_gap == 0 for c in checks)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--from-step", "5"], r"--from-step must be one of \[1, 10, 50\]"),
        (["--from-step", "10", "--steps", "9"], r"--steps must lie in 10\.\.302"),
        (["--view", "free-running", "--sequential"], "--sequential is lockstep's"),
        (["--view", "teacher-forced", "--from-step", "10"], "--from-step is lockstep's"),
    ],
)
def test_a_start_lockstep_cannot_take_is_named(argv, message):
    with pytest.raises(SystemExit, match=message):
        replay.main(argv)
