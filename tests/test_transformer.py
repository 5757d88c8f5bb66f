"""The whole micro model against OLMo-core's `OLMoDDPModel` through its fp64 oracle
(goldens/oracle/model_*.safetensors), at OLMo-core's initial weights and at trained ones, both
through `from_olmo_core`: in training with OLMo-core's recorded pool draws the logits, CE, z-loss,
per-layer LB and router z-losses, the expert counts (exactly) and the gradient of every parameter of
OLMo-core's objective; in evaluation the logits.

Formula parity: our float64 model within FORMULA_PARITY of OLMo-core's float64 run, per tensor.
Rounding parity: our float32 model within ROUNDING_PARITY times OLMo-core float32's own distance to
that oracle, per tensor."""

import jax
import numpy as np
import pytest

from goldens.tolerances import DOCUMENT_ISOLATION
from model.config import Flags
from model.convert import from_olmo_core, to_olmo_core
from tests.compare import assert_close, assert_formula_parity, assert_rounding_parity
from tests.micro_olmo_core import CFG, WEIGHTS, eval_logits, model_outputs, olmo_core_model


@pytest.fixture(scope="module")
def olmo_core(golden):
    """(the trained oracle, our float32 model with OLMo-core's trained weights)."""
    return golden("oracle/model_trained.safetensors"), olmo_core_model(golden, "trained")


@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_formula_parity_with_olmo_core_float64(golden, weights):
    oracle = golden(f"oracle/model_{weights}.safetensors")
    with jax.enable_x64(True):
        ours, counts = model_outputs(olmo_core_model(golden, weights, "float64"), oracle)
        assert_formula_parity(f"model at {weights} weights", oracle, ours)
    np.testing.assert_array_equal(counts, oracle["counts"])


@pytest.mark.parametrize("weights", list(WEIGHTS))
def test_rounding_parity_with_olmo_core_float32(golden, weights):
    oracle = golden(f"oracle/model_{weights}.safetensors")
    ours, counts = model_outputs(olmo_core_model(golden, weights), oracle)
    assert_rounding_parity(f"model at {weights} weights", oracle, ours)
    np.testing.assert_array_equal(counts, oracle["counts"])


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
    g, model = olmo_core
    with pytest.raises(ValueError, match=message):
        model(g["input_ids"], **kwargs)


def test_mixers_mask_documents_only_without_the_flag(olmo_core):
    """Changing row 0's second document (tokens 1..49) leaves the later documents' logits
    unchanged when the mixers mask documents (`olmoe3_mixers_ignore_segment_ids` off), and changes
    them with OLMo-core's behaviour (flag on). Evaluation: the eval pool keeps every expert."""
    g, model = olmo_core
    ids = g["input_ids"]
    changed = ids.copy()
    changed[0, 1:50] = (changed[0, 1:50] + 1) % 256
    masked = from_olmo_core(to_olmo_core(model), CFG, flags=Flags())
    for m, isolated in ((masked, True), (model, False)):
        before, after = eval_logits(m, ids)[0, 51:], eval_logits(m, changed)[0, 51:]
        if isolated:  # rounding differs inside the chunked KDA; 8 blocks amplify it
            assert_close("later documents", expected=before, actual=after, tol=DOCUMENT_ISOLATION)
        else:
            gap = np.abs(np.asarray(after) - np.asarray(before)).max()
            assert gap > 100 * DOCUMENT_ISOLATION.atol


def test_pool_key_draws_one_pool_per_layer_and_document(olmo_core):
    """A key gives every MoE layer its own uniform draw in [min_pool, max_pool]."""
    _, model = olmo_core
    emo = CFG.moe.emo
    pools = model.pool_sizes((2, 256), train=True, pool_key=jax.random.key(1))
    assert pools.shape == (len(CFG.moe_layers), 2, 256)
    assert emo.min_pool == pools.min() and pools.max() == emo.max_pool
    assert len({np.asarray(p).tobytes() for p in pools}) == len(CFG.moe_layers)
