"""The full replay (`tox -e slow`): all 50 steps of OLMo-core's trace free-running, every metric of
every step and the params at the saved steps within tolerance, and the trainer (`parity.train`)
over the same 50 steps gives those numbers bit for bit (one free-running run serves both); the
teacher-forced view (each saved step restarted from OLMo-core's params) within the issue's bars
alone."""

import json

import pytest

from parity import replay
from parity.compare import free_running_record
from parity.run import Run, free_running
from parity.trace import bundled_data, load_trace
from parity.train import Plan, train
from parity.train_data import DataFiles


@pytest.mark.slow
@pytest.mark.cost(200)
def test_full_free_running_replay_passes_and_the_trainer_gives_its_steps():
    trace = load_trace()
    rows, params = free_running(
        trace, Run(trace.config), steps=trace.steps, on_step=lambda *_: None
    )
    record = free_running_record(trace, rows, params, flags="olmo_core")
    assert record.first_divergence is None, record.first_divergence
    assert len(record.steps) == trace.steps
    assert [p.step for p in record.params] == [10, 50]
    assert all(p.ok for p in record.params), record.params
    tokens, indices = bundled_data()
    plan = Plan(
        trace.config, trace.steps, DataFiles(tuple(tokens), indices, "uint16"), init="trace"
    )
    _, trained = train(plan, log=lambda _: None)
    differing = [r["step"] for r, w in zip(trained, rows, strict=True) if {k: r[k] for k in w} != w]
    assert differing == []


@pytest.mark.slow
def test_teacher_forced_view_passes(tmp_path):
    code = replay.main(["--view", "teacher-forced", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "replay.json").read_text())
    assert record["view"] == "teacher-forced" and record["passed"], record["first_divergence"]
    assert [s["step"] for s in record["steps"]] == [1, 11]
    assert code == 0
