"""The faults of tests/lockstep_faults.py injected into the JAX side (`tox -e slow`): lockstep, from
the trace's latest saved training state before the fault acts, names each at its step (where it
starts to act, or where it is expected), the kind of gap and the metric or tensor; the
free-running view over the trace's 50 steps with the same fault misses it, but for the one it is
expected to see (and the LR 0.1% high, which sits at free-running's LR bar)."""

import pytest

from parity.compare import free_running_record
from parity.lockstep import lockstep
from parity.lockstep_check import check_step, lockstep_record
from parity.run import Run, free_running, release_compiled
from parity.trace import load_trace
from tests.lockstep_faults import FAULTS

pytestmark = pytest.mark.cost(150)


def latest_start(trace, step: int) -> int:
    """The latest step at or before `step` that lockstep can start at: 1, or one after a saved
    training state of the trace (the steps before a fault acts are the gate's and the epoch's)."""
    return max(start for start in trace.starts if start <= step)


@pytest.mark.slow
@pytest.mark.parametrize("fault", FAULTS)
def test_lockstep_names_the_fault_free_running_misses_it(fault):
    trace, expected = load_trace(), FAULTS[fault]
    run = Run(trace.config, fault=expected.fault)
    checks = []
    lockstep(
        trace,
        run,
        steps=expected.step,
        on_step=lambda oc, ours: checks.append(check_step(trace, oc, ours)),
        first=latest_start(trace, expected.fault.first),
    )
    first = lockstep_record(trace, checks).first_divergence
    assert first is not None and first.step == expected.step, first
    assert first.kind in expected.kinds, first
    assert expected.names_it(first.name), first
    if expected.free_running_misses is None:
        return
    rows, params = free_running(trace, run, steps=trace.steps, on_step=lambda *_: None)
    release_compiled()
    free = free_running_record(trace, rows, params, flags="olmo_core")
    assert free.passed == expected.free_running_misses, free.first_divergence
