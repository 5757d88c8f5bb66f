"""Lockstep, the replay's default view: OLMo-core's own train module beside the JAX step, both from
OLMo-core's state every step. Five steps with the JAX side on 8 simulated devices
(`python -m parity.replay --steps 5 --mesh fsdp=4,expert=2`) pass on every metric, MoE layer and
tensor (gradient, update, Adam moments) within the measured LOCKSTEP_* tolerances, OLMo-core's
metrics are the trace's, and replay.json has the issue's format. On one device, one MoE layer's
router gradient 1% off at step 3 is named: step, tensor, block. The other faults and the whole
epoch, on one device: tests/test_lockstep_full.py."""

import json

import pytest

from model.train_step import AUX_TERMS, METRICS
from parity import replay
from parity.lockstep import lockstep
from parity.lockstep_check import TENSOR_KINDS, bounds, check_step, lockstep_record
from parity.run import Run
from parity.trace import load_trace
from tests.lockstep_faults import FAULTS, ROUTER

STEPS = 5
MESH = "fsdp=4,expert=2"


@pytest.fixture(scope="module")
def lockstepped(tmp_path_factory):
    out = tmp_path_factory.mktemp("lockstep")
    code = replay.main(
        ["--steps", str(STEPS), "--mesh", MESH, "--out", str(out), "--window", str(STEPS)]
    )
    return code, json.loads((out / "replay.json").read_text()), out


def test_five_steps_on_a_mesh_pass_on_every_metric_layer_and_tensor(lockstepped):
    code, record, out = lockstepped
    assert code == 0 and record["view"] == "lockstep" and record["passed"]
    assert record["mesh"] == {"data": 1, "fsdp": 4, "expert": 2}
    assert (record["platform"], record["device"]) == ("cpu", "cpu")
    assert record["matmul_precision"] == "highest"  # float32 compute, no --matmul-precision
    assert record["olmo_core_process_group"] == "gloo"
    assert record["first_divergence"] is None
    lock = record["lockstep"]
    assert lock["passed"] and lock["first_divergence"] is None
    assert (
        [s["step"] for s in lock["steps"]]
        == [s["step"] for s in record["steps"]]
        == [1, 2, 3, 4, 5]
    )
    names = set(load_trace().param_names)
    for entry in lock["steps"]:
        assert entry["olmo_core_is_trace"], entry["step"]
        for name in METRICS:
            m = entry["metrics"][name]
            assert set(m) >= {"ours", "golden", "rel_gap"}
            assert m["rel_gap"] <= bounds(entry["tokens_rerouted"]).metric
        for name in AUX_TERMS:
            assert len(entry["layers"][name]["ours"]) == len(load_trace().moe_blocks)
        assert set(entry["tensors"]) == names
        step_bounds = bounds(entry["tokens_rerouted"])
        for tensor, gaps in entry["tensors"].items():
            for kind, field in TENSOR_KINDS.items():
                gap = gaps[f"{kind}_rel_gap"]
                assert gap <= getattr(step_bounds, field), (entry["step"], tensor, kind)
    assert (out / "replay.png").stat().st_size > 10_000


def test_a_router_gradient_one_percent_off_is_named_at_its_step():
    trace = load_trace()
    expected = FAULTS["router_grad_1.01x_at_3"]
    checks = []
    lockstep(
        trace,
        Run(trace.config, fault=expected.fault),
        steps=expected.fault.first,
        on_step=lambda oc, ours: checks.append(check_step(trace, oc, ours)),
    )
    first = lockstep_record(trace, checks).first_divergence
    assert first is not None
    assert (first.step, first.kind, first.name, first.block) == (3, "grad", ROUTER, 3)
