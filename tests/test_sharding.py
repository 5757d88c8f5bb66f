"""The micro model at scale on 8 simulated CPU devices (`model.sharding`, `model.expert_parallel`):
one GA-2 train step (global load balancing on) from OLMo-core's step-0 weights, on each (data,
fsdp, expert) mesh, gives one device's metrics, expert counts and gradients. Where params live:
tests/test_sharded_layout.py."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from goldens.tolerances import MESH_SAME_AS_ONE_DEVICE, MESH_SAME_AS_ONE_DEVICE_PER_TENSOR
from model import config as c
from model import train_step as ts
from model.convert import from_olmo_core
from parity.run import MeshShape, Run, take_step
from parity.trace import load_trace
from tests.compare import assert_close, assert_gaps_within, leaf_gaps

MESHES = [(1, 8, 1), (2, 2, 2), (1, 2, 4)]
"""(data, fsdp, expert); 8 rows a micro-batch split over all 8 devices on each: every weight
split 8 ways, all three axes at once, and 4 expert groups with their weights split over fsdp.
(1, 4, 2) is lockstep's mesh in the gate (tests/test_lockstep.py)."""


def _config() -> c.Config:
    cfg = load_trace().config
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch_size=16))


@functools.cache
def _batch() -> dict[str, np.ndarray]:
    """The trace's steps 1 and 2 side by side: [GA 2, 8 rows, ...], with OLMo-core's draws."""
    trace = load_trace()
    steps = [trace.micro_batches(step, trace.config.flags) for step in (1, 2)]
    return {k: np.concatenate([s[k] for s in steps], axis=1) for k in steps[0]}


def _step(data: int, fsdp: int, expert: int):
    """One train step from the trace's step-0 params, laid out on the mesh by the jitted step:
    (metrics, gradients) as numpy."""
    cfg = _config()
    graphdef, params = nnx.split(from_olmo_core(load_trace().params(0), cfg.model, flags=cfg.flags))
    run = Run(cfg, mesh=MeshShape(data, fsdp, expert))
    _, metrics, grads = take_step(run, graphdef, ts.init_state(params, cfg), _batch())
    return jax.tree.map(np.asarray, (metrics, grads))


@pytest.fixture(scope="module")
def one_device():
    return _step(1, 1, 1)


def assert_same_step(expected, actual) -> None:
    """(metrics, gradients) of one step within MESH_SAME_AS_ONE_DEVICE elementwise and, each
    tensor against its own norm, MESH_SAME_AS_ONE_DEVICE_PER_TENSOR; the expert counts equal."""
    (want_metrics, want_grads), (metrics, grads) = expected, actual
    counts = "expert_counts"
    np.testing.assert_array_equal(metrics[counts], want_metrics[counts])
    want_metrics = {k: v for k, v in want_metrics.items() if k != counts}
    metrics = {k: v for k, v in metrics.items() if k != counts}
    assert_close("metrics", expected=want_metrics, actual=metrics, tol=MESH_SAME_AS_ONE_DEVICE)
    assert_close("grads", expected=want_grads, actual=grads, tol=MESH_SAME_AS_ONE_DEVICE)
    gaps = leaf_gaps(want_metrics, metrics) | leaf_gaps(want_grads, grads)
    assert_gaps_within("mesh vs one device", gaps, MESH_SAME_AS_ONE_DEVICE_PER_TENSOR, "a step")


@pytest.mark.parametrize(("data", "fsdp", "expert"), MESHES, ids=lambda n: str(n))
def test_a_train_step_on_the_mesh_is_one_devices(one_device, data, fsdp, expert):
    assert_same_step(one_device, _step(data, fsdp, expert))


def test_a_one_percent_error_in_the_smallest_gradient_is_seen(one_device):
    """Block 5's A_log gradient (norm 7e-7, under every elementwise atol) 1% off: the elementwise
    check lets it through, the per-tensor one does not."""
    metrics, grads = one_device
    wrong = jax.tree_util.tree_map_with_path(
        lambda path, g: (
            g * 1.01 if "[5]['attention']['A_log']" in jax.tree_util.keystr(path) else g
        ),
        grads,
    )
    assert_close("grads", expected=grads, actual=wrong, tol=MESH_SAME_AS_ONE_DEVICE)
    with pytest.raises(AssertionError, match=r"1 of 2\d\d tensors:\n  \['blocks'\]\[5\]"):
        assert_same_step(one_device, (metrics, wrong))
