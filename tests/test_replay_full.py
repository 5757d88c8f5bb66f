"""The full replay (`tox -e slow`): all 50 steps of OLMo-core's trace free-running, every metric of
every step and the params at the saved steps within tolerance; the teacher-forced view (each saved
step restarted from OLMo-core's params) within the issue's bars alone."""

import json

import pytest

from parity import replay
from parity.trace import load_trace


@pytest.mark.slow
def test_full_free_running_replay_passes(tmp_path):
    code = replay.main(["--view", "free-running", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "replay.json").read_text())
    assert record["first_divergence"] is None, record["first_divergence"]
    assert len(record["steps"]) == load_trace().steps
    assert [p["step"] for p in record["params"]] == [10, 50]
    assert all(p["ok"] for p in record["params"]), record["params"]
    assert code == 0


@pytest.mark.slow
def test_teacher_forced_view_passes(tmp_path):
    code = replay.main(["--view", "teacher-forced", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "replay.json").read_text())
    assert record["view"] == "teacher-forced" and record["passed"], record["first_divergence"]
    assert [s["step"] for s in record["steps"]] == [1, 11]
    assert code == 0
