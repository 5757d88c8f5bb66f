"""The faults of tests/lockstep_faults.py injected into the JAX side (`tox -e slow`): lockstep, from
the trace's latest saved training state before the fault acts, names each at its step (where it
starts to act, or where it is expected), the kind of gap and the metric or tensor; the faults
that start from the same saved state share one OLMo-core run. The free-running view over the
trace's 50 steps with the same fault misses it, but for the one it is expected to see (and the LR
0.1% high, which sits at free-running's LR bar)."""

from collections import defaultdict

import pytest

from parity.compare import free_running_record
from parity.lockstep import JaxSide, lockstep_sides
from parity.lockstep_check import check_step, lockstep_record
from parity.run import Run, free_running, release_compiled
from parity.trace import load_trace
from tests.lockstep_faults import FAULTS

pytestmark = pytest.mark.slow


def latest_start(trace, step: int) -> int:
    """The latest step at or before `step` that lockstep can start at: 1, or one after a saved
    training state of the trace (the steps before a fault acts are the gate's and the epoch's)."""
    return max(start for start in trace.starts if start <= step)


@pytest.mark.cost(400)
def test_lockstep_names_each_fault_at_its_step():
    trace = load_trace()
    checks = {name: [] for name in FAULTS}
    by_start = defaultdict(list)
    for name, expected in FAULTS.items():
        by_start[latest_start(trace, expected.fault.first)].append(name)
    for start, names in sorted(by_start.items()):
        sides = [
            JaxSide(
                Run(trace.config, fault=FAULTS[name].fault),
                FAULTS[name].step,
                lambda oc, ours, name=name: checks[name].append(check_step(trace, oc, ours)),
            )
            for name in names
        ]
        lockstep_sides(trace, sides, first=start)
        release_compiled()
    missed = {}
    for name, expected in FAULTS.items():
        first = lockstep_record(trace, checks[name]).first_divergence
        if not (
            first is not None
            and first.step == expected.step
            and first.kind in expected.kinds
            and expected.names_it(first.name)
        ):
            missed[name] = first
    assert not missed, missed


@pytest.mark.cost(150)
@pytest.mark.parametrize(
    "fault", [name for name, e in FAULTS.items() if e.free_running_misses is not None]
)
def test_free_running_misses_the_fault(fault):
    """Or sees it, where the fault is expected to show there (`Expected.free_running_misses`)."""
    trace, expected = load_trace(), FAULTS[fault]
    run = Run(trace.config, fault=expected.fault)
    rows, params = free_running(trace, run, steps=trace.steps, on_step=lambda *_: None)
    release_compiled()
    free = free_running_record(trace, rows, params, flags="olmo_core")
    assert free.passed == expected.free_running_misses, free.first_divergence
