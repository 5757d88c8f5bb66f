"""The free-running view on the golden trace: `python -m parity.replay --view free-running
--steps 5` (OLMo-core flags) passes, writes the record in the issue's format and the plot, and every
step of it is within the issue's bars; OLMo-core's total aux loss is our sum over layers (MaxText's
mean over them: tests/test_diagnosis.py); `olmo-parity replay --flags maxtext` diverges on the aux
loss at step 1 and says so. The lockstep view (the default): tests/test_lockstep.py."""

import json
import os

import pytest

from goldens.tolerances import (
    AUX_LAYER_SUM,
    MAXTEXT_LB_FACTOR_VISIBLE,
    REPLAY_CE,
    REPLAY_METRIC,
    STEP_ONE,
)
from model.train_step import METRICS
from parity import cli, replay
from parity.trace import load_trace
from tests.compare import assert_close

STEPS = 5


@pytest.fixture(scope="module")
def replayed(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay")
    code = replay.main(
        ["--view", "free-running", "--steps", str(STEPS), "--out", str(out), "--window", "5"]
    )
    return code, json.loads((out / "replay.json").read_text()), out


def test_five_steps_pass_within_the_issue_bars(replayed):
    code, record, out = replayed
    assert code == 0 and record["passed"] and record["first_divergence"] is None
    assert record["view"] == "free-running"
    assert [s["step"] for s in record["steps"]] == list(range(1, STEPS + 1))
    for entry in record["steps"]:
        for name in METRICS:
            m = entry["metrics"][name]
            assert set(m) >= {"ours", "golden", "rel_gap"}, name
            bar = REPLAY_CE if name == "ce" else REPLAY_METRIC
            assert m["rel_gap"] <= bar, (entry["step"], name, m)
        assert entry["skipped"] == {"ours": False, "golden": False}
    assert (out / "replay.png").stat().st_size > 10_000


def test_olmo_core_total_aux_loss_is_the_sum_over_layers(replayed):
    """Step 1 starts from OLMo-core's weights: our LB and router z-loss, summed over the MoE
    layers, are the totals OLMo-core logged (to the whole-model bar), and so are the layers."""
    _, record, _ = replayed
    first = record["steps"][0]
    for name in ("lb_loss", "router_z_loss"):
        m = first["metrics"][name]
        assert_close(name, expected=m["golden"], actual=m["ours"], tol=STEP_ONE)
        layers = first["layers"][name]
        assert_close(
            f"{name} per layer", expected=layers["golden"], actual=layers["ours"], tol=STEP_ONE
        )
        assert_close(
            f"{name} total", expected=m["ours"], actual=sum(layers["ours"]), tol=AUX_LAYER_SUM
        )


def test_maxtext_flags_diverge_on_the_aux_loss(tmp_path, capsys):
    """Through the console script `olmo-parity replay`."""
    args = ["--view", "free-running", "--steps", "1", "--flags", "maxtext", "--out", str(tmp_path)]
    code = cli.main(["replay", *args])
    record = json.loads((tmp_path / "replay.json").read_text())
    assert code == 1 and not record["passed"]
    first = record["first_divergence"]
    assert (first["step"], first["metric"]) == (1, "lb_loss")
    assert first["layer"] in load_trace().moe_blocks
    lb = record["steps"][0]["metrics"]["lb_loss"]
    assert lb["ours"] < lb["golden"] / MAXTEXT_LB_FACTOR_VISIBLE, (
        "MaxText averages the layers' LB, OLMo-core sums them"
    )
    assert "first divergence at step 1, LB loss" in capsys.readouterr().out


def test_a_platform_jax_cannot_find_is_named(tmp_path, monkeypatch):
    """`--platform tpu` where JAX has no TPU (the tests run JAX on the CPU) exits naming it,
    having asked libtpu for its accurate transcendentals first."""
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_accurate_exp=false --xla_foo=1")
    with pytest.raises(SystemExit, match="--platform tpu: JAX finds no tpu device"):
        replay.main(["--platform", "tpu", "--steps", "1", "--out", str(tmp_path)])
    flags = os.environ["LIBTPU_INIT_ARGS"].split()
    assert flags[0] == "--xla_foo=1" and "--xla_tpu_accurate_exp=true" in flags
    assert "--xla_tpu_accurate_exp=false" not in flags


def test_tpu_transcendentals_off_a_tpu_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="--tpu-transcendentals needs --platform tpu, not cpu"):
        replay.main(["--tpu-transcendentals", "default", "--out", str(tmp_path)])
