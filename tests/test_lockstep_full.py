"""Lockstep over the data's whole first epoch (`tox -e slow`, 19-22 minutes, scheduled first):
every step of it within tolerance on every metric, MoE layer and tensor."""

import json

import pytest

from parity import replay
from parity.trace import load_trace


@pytest.mark.slow
@pytest.mark.cost(1700)
def test_the_whole_first_epoch_passes(tmp_path):
    epoch = load_trace().data.num_batches
    code = replay.main(["--steps", str(epoch), "--out", str(tmp_path), "--window", "50"])
    record = json.loads((tmp_path / "replay.json").read_text())
    assert record["lockstep"]["first_divergence"] is None, record["lockstep"]["first_divergence"]
    assert len(record["lockstep"]["steps"]) == epoch
    assert code == 0
