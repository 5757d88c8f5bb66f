"""OLMo-core's state and weights to and from the JAX trainer (`parity.olmo_core_state`).

Exported params (the trace's step-10 params through `from_olmo_core`) load into OLMo-core's own
micro model with strict=True, bit for bit the trace's, and its evaluation logits on a micro-batch
of the trace are ours within EXPORTED_LOGITS; one weight 1% off fails that. OLMo-core's saved
state after step 49 becomes a JAX train state whose step 50 lands on OLMo-core's params after
step 50 within lockstep's bounds for that step, its metrics on the trace's; a state of another
config is refused, naming the key."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx
from safetensors import safe_open

from goldens.export import make_torch_deterministic
from goldens.store import resolve
from goldens.tolerances import BITWISE, EXPORTED_LOGITS
from goldens.train_state import GRAD_NORMS, LOSSES
from model import optim
from model.convert import from_olmo_core, model_entries, param_path, params_to_olmo_core
from model.state import abstract_params
from model.train_step import METRICS
from parity.lockstep_check import bounds, tensor_bounds, update_gaps
from parity.olmo_core_state import export_params, load_training_state, train_state, training_state
from parity.run import Run, micro_batches, take_step
from parity.trace import STATE, load_trace
from tests.compare import assert_close
from tests.micro_olmo_core import CFG, eval_logits

EXPORTED, RESUMED = 10, 49
"""The trace's params exported (a snapshot step); the step whose saved state is resumed."""
FAULT = "blocks.4.attention.w_v.weight"
"""A KDA value projection, scaled by 1.01 before export: 21x over EXPORTED_LOGITS."""


@pytest.fixture(scope="module")
def trace():
    return load_trace()


@pytest.fixture(scope="module")
def exported(trace):
    """(our model with the trace's step-10 params, a micro-batch of the trace's step 11 [b, T],
    our evaluation logits on it [b, T, V], OLMo-core's micro model, run as the goldens were:
    single-threaded torch)."""
    from goldens.runtime.models import build

    make_torch_deterministic()
    cfg = trace.config
    model = from_olmo_core(trace.params(EXPORTED), cfg.model, flags=cfg.flags)
    ids = trace.micro_batches(EXPORTED + 1, cfg.flags)["inputs"][0]
    weights = {k: getattr(cfg.train, k) for k in ("lb_loss_weight", "router_z_loss_weight")}
    return model, ids, np.asarray(eval_logits(model, ids)), build(cfg.model, **weights)


def _olmo_core_logits(olmo_core, path, ids) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """The file at `path` loaded into OLMo-core's model (strict), and its evaluation logits."""
    import torch

    loaded = safetensors.numpy.load_file(path)
    olmo_core.load_state_dict({k: torch.from_numpy(v) for k, v in loaded.items()}, strict=True)
    olmo_core.eval()
    with torch.no_grad():
        return loaded, olmo_core(torch.from_numpy(ids.astype(np.int64))).numpy()


def test_exported_params_load_into_olmo_core_and_give_our_logits(trace, exported, tmp_path):
    model, ids, ours, olmo_core = exported
    path = tmp_path / "params.safetensors"
    export_params(nnx.state(model, nnx.Param), CFG, path)
    loaded, logits = _olmo_core_logits(olmo_core, path, ids)
    golden = trace.params(EXPORTED)
    assert loaded.keys() == golden.keys()
    for key, value in golden.items():
        assert (loaded[key].dtype, loaded[key].shape) == (value.dtype, value.shape), key
        assert loaded[key].tobytes() == value.tobytes(), key
    with safe_open(path, "np") as f:
        assert json.loads(f.metadata()["model_config"]) == CFG.as_dict()
    assert_close("OLMo-core's logits", expected=logits, actual=ours, tol=EXPORTED_LOGITS)


def test_one_weight_one_percent_off_fails_the_logits(exported, tmp_path):
    model, ids, ours, olmo_core = exported
    path = next(e.path for e in model_entries(CFG) if e.torch_key == FAULT)

    def scale(tree_path, value):
        return value * 1.01 if param_path(tree_path) == path else value

    faulty = jax.tree_util.tree_map_with_path(scale, nnx.state(model, nnx.Param))
    export_params(faulty, CFG, tmp_path / "faulty.safetensors")
    _, logits = _olmo_core_logits(olmo_core, tmp_path / "faulty.safetensors", ids)
    with pytest.raises(AssertionError, match="max abs error"):
        assert_close("OLMo-core's logits", expected=logits, actual=ours, tol=EXPORTED_LOGITS)


@pytest.fixture(scope="module")
def abstract(trace):
    """(graphdef, abstract params) of the trace's model."""
    return abstract_params(trace.config)


@pytest.fixture(scope="module")
def resumed(trace, abstract):
    """(OLMo-core's flat state after step 49, its `training_state`, our `train_state` of it, and
    our step 50 from it: (state, metrics))."""
    cfg = trace.config
    run = Run(cfg)
    graphdef, template = abstract
    flat = trace.state(RESUMED)
    before = training_state(flat, cfg.model)
    state = train_state(before, template, cfg, RESUMED)
    batch = jax.tree.map(jnp.asarray, micro_batches(trace, run, RESUMED + 1))
    after, metrics, _ = take_step(run, graphdef, state, batch)
    return flat, before, state, (after, metrics)


def test_train_state_puts_the_moments_and_history_where_optim_reads_them(resumed):
    flat, _, state, _ = resumed
    mu, nu = optim.moments(state.opt_state)
    for tensors, suffix in ((state.params, "main"), (mu, "exp_avg"), (nu, "exp_avg_sq")):
        ours = {
            k: v.reshape(-1) for k, v in params_to_olmo_core(tensors, model_entries(CFG)).items()
        }
        expected = {k: flat[f"{k}.{suffix}"] for k in ours}
        assert_close(suffix, expected=expected, actual=ours, tol=BITWISE)
    assert int(state.opt_state.adam[0].count) == flat["embeddings.weight.step"][0] == RESUMED
    assert int(state.step) == RESUMED
    skip, kept = state.opt_state.skip, len(flat[LOSSES])
    assert int(skip.count) == kept
    np.testing.assert_array_equal(np.asarray(skip.losses)[-kept:], flat[LOSSES])
    np.testing.assert_array_equal(np.asarray(skip.grad_norms)[-kept:], flat[GRAD_NORMS])


def test_step_50_from_olmo_core_state_lands_on_olmo_core_params(trace, resumed):
    """Within lockstep's bounds for step 50 routed alike (the trace keeps no expert counts)."""
    _, before, _, (after, metrics) = resumed
    step = RESUMED + 1
    ours = params_to_olmo_core(after.params, model_entries(CFG))
    gaps = update_gaps(before.params, ours, trace.params(step))
    over = {n: g for n, g in gaps.items() if not g <= tensor_bounds(step, [], n).update}
    assert not over, f"updates over lockstep's bounds: {over}"
    bar = bounds(step, []).metric
    for name in METRICS:
        golden = trace.metrics[name][step - 1]
        assert abs(float(metrics[name]) - golden) <= bar * abs(golden), name
    assert bool(metrics["skipped"]) == bool(trace.metrics["skipped"][step - 1])


def _without(flat: dict, key: str | None) -> dict:
    return {k: v for k, v in flat.items() if k != key}


@pytest.mark.parametrize(
    ("drop", "put"),
    [
        pytest.param("blocks.3.attention.w_q.weight.exp_avg", None, id="missing-key"),
        pytest.param(None, "blocks.8.attention.A_log.main", id="unknown-key"),
        pytest.param(None, "blocks.5.routed_experts.w_down.main", id="other-shape"),
    ],
)
def test_a_state_of_another_config_is_refused_naming_the_key(trace, drop, put):
    """`drop` a key, or `put` one of shape [2]."""
    flat = _without(trace.state(9), drop) | ({put: np.zeros(2, np.float32)} if put else {})
    with pytest.raises(ValueError, match=rf"{re.escape(drop or put)}.*another model config"):
        training_state(flat, CFG)


def test_a_state_file_loads_and_its_errors_name_the_file(trace, tmp_path):
    loaded = load_training_state(resolve(STATE.format(9)), CFG)
    flat = trace.state(9)
    assert loaded.count == flat["embeddings.weight.step"][0] == 9
    assert loaded.losses == flat[LOSSES].tolist()
    for name, value in loaded.params.items():
        assert value.reshape(-1).tobytes() == flat[f"{name}.main"].tobytes(), name
    bad = tmp_path / "state.safetensors"
    safetensors.numpy.save_file(_without(flat, LOSSES), bad)
    with pytest.raises(
        ValueError, match=re.escape(f"{bad}: OLMo-core training state: missing keys ['{LOSSES}']")
    ):
        load_training_state(bad, CFG)


def test_more_adam_updates_than_trainer_steps_are_refused(trace, abstract):
    cfg = trace.config
    before = training_state(trace.state(9), cfg.model)
    with pytest.raises(ValueError, match="9 Adam updates, more than the 8 trainer steps"):
        train_state(before, abstract[1], cfg, 8)
