"""What the free-running replay gates besides the totals: each MoE layer's LB and router z-loss
against the per-layer spread, and each parameter tensor at the saved steps against its own spread.
OLMo-core's own logged values pass; moving LB from one layer to another (totals unchanged) and a
small tensor off by 10% fail, naming the layer or tensor."""

import numpy as np

from goldens.tolerances import REPLAY_SPREAD_FACTOR
from model.train_step import AUX_TERMS, METRICS
from parity.compare import compare_params, compare_step, divergence
from parity.trace import load_trace

STEP = 5
"""Early enough that each layer's tolerance (the bar, or the spread times REPLAY_SPREAD_FACTOR)
is well under the 5% moved below."""


def _olmo_core_row(trace, step: int) -> dict:
    """OLMo-core's own logged metrics of `step` in the shape of one of our train-step rows."""
    i = step - 1
    row = {name: float(trace.metrics[name][i]) for name in METRICS}
    row |= {f"{n}_per_layer": trace.metrics[f"{n}_per_block"][i].tolist() for n in AUX_TERMS}
    return row | {"skipped": bool(trace.metrics["skipped"][i])}


def test_olmo_core_itself_passes_every_layer():
    trace = load_trace()
    check = compare_step(trace, STEP, _olmo_core_row(trace, STEP), free=True)
    assert divergence(trace, check) is None
    assert all(all(check.layers[n].ok) for n in AUX_TERMS)


def test_lb_moved_between_layers_fails_that_layer():
    """The total stays OLMo-core's, so only the per-layer gate can see it."""
    trace = load_trace()
    row = _olmo_core_row(trace, STEP)
    layers = np.array(row["lb_loss_per_layer"])
    shift = 0.05 * layers[0]
    layers[0] -= shift
    layers[3] += shift
    row["lb_loss_per_layer"] = layers.tolist()
    check = compare_step(trace, STEP, row, free=True)
    assert check.metrics["lb_loss"].ok
    assert divergence(trace, check).metric == "lb_loss_per_layer"
    assert check.layers["lb_loss"].ok[0] is False and check.layers["lb_loss"].ok[3] is False


def test_one_small_tensor_off_fails_the_params_check():
    """A_log of one KDA block (2 numbers among 1.3M) 10% off: the whole model's gap barely moves,
    the tensor's own gate fails and is named."""
    trace = load_trace()
    params = dict(trace.params(10))
    assert compare_params(trace, 10, params).ok
    name = "blocks.4.attention.A_log"
    params[name] = params[name] * 1.1
    check = compare_params(trace, 10, params)
    assert not check.ok and check.over == [name]
    golden = trace.params(10)
    norms = np.array([np.linalg.norm(golden[n]) for n in trace.param_names])
    runs = trace.perturbed["params_rel_diff_step10"]  # [runs, params]
    whole_spread = max(np.linalg.norm(r * norms) / np.linalg.norm(norms) for r in runs)
    assert check.rel_gap < REPLAY_SPREAD_FACTOR * whole_spread, "a whole-model gate passes it"
