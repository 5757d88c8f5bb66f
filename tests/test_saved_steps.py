"""goldens-check's saved steps: each later trace snapshot's step, run by OLMo-core alone from the
committed state one step before it, holds to one step's rounding on this CPU, and a 1% error in any
tensor's update or any metric of that step, or a 1% shift of a late committed snapshot that the
free-running envelope lets through, is named at its step."""

import dataclasses
import shutil

import numpy as np
import pytest
from safetensors.numpy import save_file

from goldens import check
from goldens.envelope import param_spread
from goldens.store import GOLDENS_DIR, load_golden, read_manifest, sha256_of, write_manifest
from goldens.tolerances import REGENERATE_TRACE
from goldens.trace import STATE_STEPS


@pytest.fixture(scope="module")
def regenerated():
    """Steps 10 and 50 run by OLMo-core from the committed states (about 20 s)."""
    return check.regenerate_saved_steps()


def test_saved_steps_hold_to_one_steps_rounding(regenerated):
    assert [step.step for step in regenerated] == [s + 1 for s in STATE_STEPS]
    report, failures = check.saved_steps_report(GOLDENS_DIR, regenerated)
    assert failures == []
    assert len(report) == 2 * len(regenerated)  # each step's snapshot and metrics


def _off_by_one_percent(step, snapshot: dict, before: dict):
    """The regenerated step with every tensor's update and every metric 1% off (a skipped step
    flipped): each gap is its own tensor's, so all at once is each alone."""
    params = {
        name: prior + 1.01 * (step.params[name] - prior)
        for name, prior in check.weights_before(before, snapshot).items()
    }
    metrics = {
        name: (1 - value) if name == "skipped" else 1.01 * value
        for name, value in step.metrics.items()
    }
    return dataclasses.replace(step, params=params, metrics=metrics)


@pytest.mark.parametrize("index", range(len(STATE_STEPS)))
def test_a_one_percent_error_in_any_update_or_metric_is_named_at_its_step(regenerated, index):
    step = regenerated[index]
    snapshot = load_golden(check.SNAPSHOT.format(step.step)).tensors
    before = load_golden(check.STATE.format(step.step - 1)).tensors
    gaps = check.saved_step_gaps(GOLDENS_DIR, _off_by_one_percent(step, snapshot, before))
    assert [(g.name, g.gap) for g in gaps if g.ok] == []
    assert {g.name for g in gaps} >= set(snapshot) | {
        f"ce[{step.step - 1}]",
        f"lr[{step.step - 1}]",
    }
    assert all(g.step == step.step for g in gaps)


def _with_snapshot_shifted(root, step: int, name: str, factor: float) -> None:
    """goldens/ copied to `root` with one tensor of the step's committed snapshot times
    `factor`, its manifest sha256 updated (as a re-export with a wrong step would leave it)."""
    shutil.copytree(GOLDENS_DIR / "trace", root / "trace")
    shutil.copy(GOLDENS_DIR / "manifest.json", root / "manifest.json")
    path = check.SNAPSHOT.format(step)
    tensors = dict(load_golden(path).tensors)
    tensors[name] = (tensors[name] * factor).astype(tensors[name].dtype)
    save_file(tensors, str(root / path))
    manifest = read_manifest(root)
    manifest["files"][path]["sha256"] = sha256_of(root / path)
    write_manifest(manifest, root)


def test_a_one_percent_shift_in_a_late_snapshot_the_envelope_allows_is_named(tmp_path, regenerated):
    """The step-50 tensor that OLMo-core's own one-ulp runs move farthest: a 1% shift of it is
    well inside the free-running envelope, and named by its step run alone."""
    step = STATE_STEPS[-1] + 1
    perturbed = load_golden(check.TRACE_PERTURBED)
    spreads = param_spread(perturbed[f"params_rel_diff_step{step}"])
    name = perturbed.entry["config"]["params"][int(np.argmax(spreads))]
    assert REGENERATE_TRACE.factor * spreads.max() > 0.01  # the envelope lets it through
    _with_snapshot_shifted(tmp_path, step, name, 1.01)
    _, failures = check.saved_steps_report(tmp_path, regenerated)
    assert len(failures) == 1
    assert failures[0].startswith(
        f"trace/params_step{step}.safetensors {name}: step {step} run alone from "
        f"trace/state_step{step - 1}.safetensors: gap "
    )
