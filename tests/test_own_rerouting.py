"""parity.own_rerouting: the twin run before each step routes its own forward (a twin moved 1%
instead of one ulp reroutes slots) and leaves OLMo-core's training as it was, bit for bit."""

import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from goldens.trace import fit, train_module
from goldens.train_state import optimizer_state
from parity import cli
from parity import own_rerouting as own
from parity.trace import load_trace


def _one_percent(model, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1 + 0.01 * torch.randn(param.shape, generator=generator))


def test_the_twin_reroutes_on_its_own_and_leaves_training_as_it_was(monkeypatch):
    trace = load_trace()
    monkeypatch.setattr(own, "perturb_one_ulp", _one_percent)
    records = []
    after = own.own_rerouting(trace, 2, records.append)
    assert [r.step for r in records] == [1, 2]
    assert all(len(r.slots) == len(trace.moe_blocks) for r in records)
    assert all(sum(r.slots) > 0 for r in records)
    module = train_module(trace.config)
    with tempfile.TemporaryDirectory() as tmp:
        fit(trace.config, module, Path(tmp), steps=2, callbacks={})
    plain = optimizer_state(module)
    assert [k for k in plain if not np.array_equal(after[k], plain[k])] == []


def test_busiest_window_counts_the_most_rerouted_steps_in_a_row():
    assert own.busiest_window([25, 26, 51, 68, 223, 248], 50) == 4
    assert own.busiest_window([1, 51, 101], 50) == 1
    assert own.busiest_window([], 50) == 0


def test_steps_outside_the_epoch_are_refused():
    with pytest.raises(SystemExit, match=r"--steps must lie in 1\.\.\d+, got 0"):
        cli.main(["own-rerouting", "--steps", "0"])
