"""Every diagnosis candidate on the golden batch (`tox -e slow`): a 2-step ablation of OLMo-core's
trace through the report generator, and at step 1, where every run starts from OLMo-core's weights,
each candidate's code path changes what it should and nothing it should not."""

import json

import numpy as np
import pytest

from goldens.tolerances import (
    FORWARD_VISIBLE,
    STEP_ONE_GAP,
    STEP_ONE_METRIC,
    STEP_ONE_VISIBLE,
)
from model.data import IGNORE_INDEX
from model.train_step import AUX_TERMS
from parity.diagnosis import __main__ as diagnosis
from parity.diagnosis.ablation import GAPS
from parity.trace import load_trace
from tests.compare import assert_close


@pytest.fixture(scope="module")
def step_1(tmp_path_factory):
    out = tmp_path_factory.mktemp("diagnosis")
    assert diagnosis.main(["--steps", "2", "--out", str(out)]) == 0
    record = json.loads((out / "diagnosis.json").read_text())
    assert (out / "diagnosis.md").read_text().count("| `") == len(record["candidates"])
    return {c["name"]: {k: v[0] for k, v in c["gaps"].items()} for c in record["candidates"]}


@pytest.mark.slow
def test_every_candidate_changes_what_it_should(step_1):
    trace = load_trace()
    n_moe, ga = len(trace.moe_blocks), trace.config.train.ga_steps
    batch = trace.micro_batches(1, trace.config.flags)
    d = float(np.sum(batch["labels"] != IGNORE_INDEX))
    positions = float(batch["labels"][0].size)
    same_forward = ("ce",)
    expected_aux_factor = {
        "aux_mean": 1 / n_moe,
        "ga_logs": ga,
        "lb_div_micro_batch": ga,
        "lb_div_positions": d / positions,
    }
    for name, factor in expected_aux_factor.items():
        for metric in AUX_TERMS:
            assert_close(
                f"{name} {metric}",
                expected=factor - 1,
                actual=step_1[name][metric],
                tol=STEP_ONE_GAP,
            )
        assert abs(step_1[name]["ce"]) <= STEP_ONE_METRIC, name
    assert_close(
        "ga_logs z_loss", expected=ga - 1, actual=step_1["ga_logs"]["z_loss"], tol=STEP_ONE_GAP
    )
    assert abs(step_1["ga_logs"]["grad_norm"]) <= STEP_ONE_METRIC, "only the logs change"
    assert abs(step_1["lb_div_micro_batch"]["grad_norm"]) > STEP_ONE_VISIBLE, (
        "the LB gradient changes"
    )
    for name in GAPS:
        assert abs(step_1["olmo_core"][name]) <= STEP_ONE_METRIC, name
        assert abs(step_1["warmup_from_0"][name]) <= STEP_ONE_METRIC, name  # LR 0 moves nothing yet
    assert abs(step_1["lb_per_device"]["lb_loss"]) > STEP_ONE_VISIBLE
    assert all(abs(step_1["lb_per_device"][m]) <= STEP_ONE_METRIC for m in same_forward)
    assert abs(step_1["router_bf16"]["router_z_loss"]) > FORWARD_VISIBLE
    for name in ("jax_draws", "segments_per_row"):
        assert abs(step_1[name]["lb_loss"]) > FORWARD_VISIBLE, name
    # at OLMo-core's step-0 weights the routed experts barely move the loss (CE 1e-6 .. 2e-5);
    # their output scale, and the mixers' documents, show in the gradient (floor: STEP_ONE_METRIC)
    for name in ("no_weight_norm", "no_scale_restore", "mixers_per_document"):
        assert abs(step_1[name]["grad_norm"]) > STEP_ONE_VISIBLE, name
