"""The micro model at scale on 8 simulated CPU devices (`model.layout`, `model.expert_parallel`):
one GA-2 train step's accumulation (global load balancing on) from OLMo-core's step-0 weights, on
each (data, fsdp, expert) mesh, gives one device's terms, expert counts and gradients before
clipping. The optimizer is not run: the gradients it would take are compared instead of what
it reports (lr, grad_norm, skipped). All three meshes are slow: the gate holds the mesh (2, 2, 2)
against OLMo-core itself, by lockstep (tests/test_lockstep.py), and the trainer's checkpoints on
it (tests/test_train.py). Where params live: tests/test_sharded_layout.py."""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from flax import nnx

from goldens.tolerances import MESH_SAME_AS_ONE_DEVICE, MESH_SAME_AS_ONE_DEVICE_PER_TENSOR
from model import config as c
from model.convert import from_olmo_core
from parity.run import MeshShape, Run, parts_at
from parity.trace import load_trace
from tests.compare import assert_close, assert_gaps_within, leaf_gaps

MESHES = [(1, 8, 1), (2, 2, 2), (1, 2, 4)]
"""(data, fsdp, expert); 8 rows a micro-batch split over all 8 devices on each: every weight
split 8 ways, all three axes at once, and 4 expert groups with their weights split over fsdp."""


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
    """The accumulation of step 1 (`model.state.StepParts.accumulate`) from the trace's step-0
    params, laid out on the mesh by the jitted part: (terms, gradients before clipping) as
    numpy."""
    cfg = _config()
    graphdef, params = nnx.split(from_olmo_core(load_trace().params(0), cfg.model, flags=cfg.flags))
    run = Run(cfg, mesh=MeshShape(data, fsdp, expert))
    grads, terms = parts_at(run, graphdef, 1)[0].accumulate(params, _batch())
    return jax.tree.map(np.asarray, (terms, grads))


@pytest.fixture(scope="module")
def one_device():
    return _step(1, 1, 1)


def assert_same_step(expected, actual) -> None:
    """(terms, gradients) of one step within MESH_SAME_AS_ONE_DEVICE elementwise and, each
    tensor against its own norm, MESH_SAME_AS_ONE_DEVICE_PER_TENSOR; the expert counts equal."""
    (want_terms, want_grads), (terms, grads) = expected, actual
    counts = "expert_counts"
    np.testing.assert_array_equal(terms[counts], want_terms[counts])
    want_terms = {k: v for k, v in want_terms.items() if k != counts}
    terms = {k: v for k, v in terms.items() if k != counts}
    assert_close("terms", expected=want_terms, actual=terms, tol=MESH_SAME_AS_ONE_DEVICE)
    assert_close("grads", expected=want_grads, actual=grads, tol=MESH_SAME_AS_ONE_DEVICE)
    gaps = leaf_gaps(want_terms, terms) | leaf_gaps(want_grads, grads)
    assert_gaps_within("mesh vs one device", gaps, MESH_SAME_AS_ONE_DEVICE_PER_TENSOR, "a step")


@pytest.mark.slow
@pytest.mark.parametrize(("data", "fsdp", "expert"), MESHES, ids=lambda n: str(n))
def test_a_steps_gradients_on_the_mesh_are_one_devices(one_device, data, fsdp, expert):
    assert_same_step(one_device, _step(data, fsdp, expert))


@pytest.mark.slow
def test_a_one_percent_error_in_the_smallest_gradient_is_seen(one_device):
    """Block 5's A_log gradient (norm 7e-7, under every elementwise atol) 1% off: the elementwise
    check lets it through, the per-tensor one does not."""
    terms, grads = one_device
    wrong = jax.tree_util.tree_map_with_path(
        lambda path, g: (
            g * 1.01 if "[5]['attention']['A_log']" in jax.tree_util.keystr(path) else g
        ),
        grads,
    )
    assert_close("grads", expected=grads, actual=wrong, tol=MESH_SAME_AS_ONE_DEVICE)
    with pytest.raises(AssertionError, match=r"1 of 2\d\d tensors:\n  \['blocks'\]\[5\]"):
        assert_same_step(one_device, (terms, wrong))
