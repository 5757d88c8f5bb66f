"""The whole micro model against OLMo-core's `OLMoDDPModel` (goldens/model_*.safetensors), with
OLMo-core's weights through `from_olmo_core`: in training with OLMo-core's recorded pool draws the
logits, CE, z-loss, per-layer LB and router z-losses, expert counts (exactly) and the gradient of
every parameter of OLMo-core's objective; in evaluation the logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from goldens.tolerances import (
    MODEL_GRAD_FLOOR,
    MODEL_GRAD_OF_NORM,
    MODEL_LOGITS,
    MODEL_LOSS,
    Tol,
)
from model.config import Flags
from model.convert import from_olmo_core, model_entries, params_to_olmo_core, to_olmo_core
from model.data import IGNORE_INDEX
from model.loss import cross_entropy_sums
from tests.compare import assert_close
from tests.micro_olmo_core import CFG, golden_gradients, olmo_core_model


@pytest.fixture(scope="module")
def olmo_core(golden):
    """(train golden, golden gradients by OLMo-core key, our model with OLMo-core's weights)."""
    train = golden("model_train.safetensors")
    return train, golden_gradients(golden), olmo_core_model(golden)


@functools.partial(jax.jit, static_argnums=0)
def _train(graphdef, state, input_ids, labels, pool_draws, weights):
    """OLMo-core's training objective: (CE + z_w z-loss) / D + sum over MoE layers of
    lb_w LB + rz_w router z (each divided by D); its value parts and gradient."""
    lb_w, rz_w, z_w = weights
    div = jnp.sum(labels != IGNORE_INDEX).astype(jnp.float32)

    def objective(state):
        out = nnx.merge(graphdef, state)(
            input_ids, train=True, pool_draws=pool_draws, loss_div_factor=div
        )
        ce, z = cross_entropy_sums(out.logits, labels)
        losses = {"ce": ce / div, "z": z_w * z / div}
        aux = jnp.sum(lb_w * out.aux.lb_loss + rz_w * out.aux.z_loss)
        return losses["ce"] + losses["z"] + aux, (out, losses)

    (_, (out, losses)), grads = jax.value_and_grad(objective, has_aux=True)(state)
    return out, losses, grads


def test_training_matches_olmo_core(olmo_core):
    g, golden_grads, model = olmo_core
    config = g.entry["config"]
    weights = (config["lb_loss_weight"], config["router_z_loss_weight"], config["z_loss_weight"])
    graphdef, state = nnx.split(model)
    out, losses, grads = _train(
        graphdef, state, g["input_ids"], g["labels"], g["pool_draws"], weights
    )
    assert_close("logits", expected=g["logits"], actual=out.logits, tol=MODEL_LOGITS)
    np.testing.assert_array_equal(out.aux.counts, g["counts"])
    assert_close(
        "losses",
        expected={
            "ce_loss": g["ce_loss"][0],  # OLMo-core's finalised losses have shape [1]
            "z_loss": g["z_loss"][0],
            "lb_loss": g["lb_loss"],
            "router_z_loss": g["router_z_loss"],
        },
        actual={
            "ce_loss": losses["ce"],
            "z_loss": losses["z"],
            "lb_loss": out.aux.lb_loss,
            "router_z_loss": out.aux.z_loss,
        },
        tol=MODEL_LOSS,
    )
    ours = params_to_olmo_core(grads, model_entries(CFG))
    for key, expected in golden_grads.items():
        bound = MODEL_GRAD_OF_NORM * float(np.linalg.norm(expected)) + MODEL_GRAD_FLOOR
        tol = Tol(rtol=0.0, atol=bound)
        assert_close(f"grad.{key}", expected=expected, actual=ours[key], tol=tol)


_eval_logits = nnx.jit(lambda m, ids: m(ids).logits)


def test_eval_matches_olmo_core(olmo_core, golden):
    """Evaluation: no draws, every document keeps the eval pool."""
    g, _, model = olmo_core
    logits = _eval_logits(model, g["input_ids"])
    expected = golden("model_eval.safetensors")["logits"]
    assert_close("logits", expected=expected, actual=logits, tol=MODEL_LOGITS)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"train": True}, "exactly one of pool_draws, pool_key"),
        ({"train": False, "pool_key": jax.random.key(0)}, "pool_key given without EMO training"),
        ({"train": True, "pool_draws": np.zeros((6, 2, 256), np.int32)}, "pool_draws: shape"),
    ],
    ids=["train-without-pools", "eval-with-key", "draws-of-6-layers"],
)
def test_pool_inputs_are_checked(olmo_core, kwargs, message):
    g, _, model = olmo_core
    with pytest.raises(ValueError, match=message):
        model(g["input_ids"], **kwargs)


def test_mixers_mask_documents_only_without_the_flag(olmo_core, golden):
    """Changing row 0's second document (tokens 1..49) leaves the later documents' logits
    unchanged when the mixers mask documents (`olmoe3_mixers_ignore_segment_ids` off), and changes
    them with OLMo-core's behaviour (flag on). Evaluation: the eval pool keeps every expert."""
    g, _, model = olmo_core
    ids = g["input_ids"]
    changed = ids.copy()
    changed[0, 1:50] = (changed[0, 1:50] + 1) % 256
    masked = from_olmo_core(to_olmo_core(model), CFG, flags=Flags())
    for m, isolated in ((masked, True), (model, False)):
        before, after = _eval_logits(m, ids)[0, 51:], _eval_logits(m, changed)[0, 51:]
        if isolated:  # rounding differs inside the chunked KDA; 8 blocks amplify it
            assert_close("later documents", expected=before, actual=after, tol=MODEL_LOGITS)
        else:
            assert np.abs(np.asarray(after) - np.asarray(before)).max() > 100 * MODEL_LOGITS.atol


def test_pool_key_draws_one_pool_per_layer_and_document(olmo_core):
    """A key gives every MoE layer its own uniform draw in [min_pool, max_pool]."""
    _, _, model = olmo_core
    emo = CFG.moe.emo
    pools = model.pool_sizes((2, 256), train=True, pool_key=jax.random.key(1))
    assert pools.shape == (len(CFG.moe_layers), 2, 256)
    assert emo.min_pool == pools.min() and pools.max() == emo.max_pool
    assert len({np.asarray(p).tobytes() for p in pools}) == len(CFG.moe_layers)
