"""Global load balancing (`Flags.moe_global_load_balancing`, OLMo-core `global_load_balancing`) on 8
ranks: OLMo-core averages the expert counts over the ranks and each rank takes its own tokens'
scores, divided by its share of D. The mean of those ranks' losses, written here in float64 from
that description, is the whole batch's `load_balancing_loss`, value and gradient: so the model
computes global load balancing on the whole (sharded) batch. Device 0's own value is not the
batch's, and balancing each rank's tokens alone (`grouped_load_balancing_loss`, MaxText) is not
either."""

import jax
import jax.numpy as jnp
import numpy as np

from goldens.tolerances import DEVICE_0_LB_VISIBLE, LOCAL_LB_FACTOR_VISIBLE, WHOLE_BATCH
from model.aux_losses import expert_counts, grouped_load_balancing_loss, load_balancing_loss
from tests.compare import assert_close

RANKS, ROWS, T, E, K = 8, 2, 16, 16, 2
D_TOTAL = float(RANKS * ROWS * T)


def _probs_and_choice(logits):
    probs = jax.nn.softmax(logits, axis=-1)
    return probs, jax.lax.top_k(probs, K)[1]


def _whole_batch(logits):
    probs, chosen = _probs_and_choice(logits)
    return load_balancing_loss(probs, expert_counts(chosen, E), top_k=K, loss_div_factor=D_TOTAL)


def _olmo_core_ranks(logits):
    """[RANKS] each rank's loss: E/k * mean-over-ranks counts . its tokens' mean scores / (D/W)."""
    probs, chosen = _probs_and_choice(logits.astype(jnp.float64))
    counts = jax.lax.stop_gradient(jax.nn.one_hot(chosen, E, dtype=jnp.float64).sum((1, 2)))
    ranks = probs.reshape(RANKS, ROWS * T, E)
    mean_counts = jnp.mean(counts.reshape(RANKS, ROWS, E).sum(1), axis=0)
    return E / K * (ranks.mean(1) @ mean_counts) / (D_TOTAL / RANKS)


def _logits():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((RANKS * ROWS, T, E))
    # each rank's tokens favour other experts: locally unbalanced, globally balanced
    logits += 3.0 * np.eye(E)[np.repeat(np.arange(RANKS) * 2, ROWS)][:, None, :]
    return logits


def test_olmo_core_global_lb_is_the_whole_batch_value_and_gradient():
    with jax.enable_x64(True):
        logits = _logits()
        mean = lambda x: jnp.mean(_olmo_core_ranks(x))  # noqa: E731
        oracle, oracle_grad = jax.value_and_grad(mean)(logits)
        device_0 = _olmo_core_ranks(logits)[0]
    value, grad = jax.value_and_grad(_whole_batch)(logits.astype(np.float32))
    assert_close("value", expected=oracle, actual=value, tol=WHOLE_BATCH)
    assert_close("grad", expected=oracle_grad, actual=grad, tol=WHOLE_BATCH)
    assert abs(float(device_0) - float(oracle)) > DEVICE_0_LB_VISIBLE * float(oracle), (
        "device 0 alone is not the batch"
    )


def test_each_rank_balancing_its_own_rows_is_not_the_whole_batch():
    logits = _logits().astype(np.float32)
    probs, chosen = _probs_and_choice(logits)
    own = grouped_load_balancing_loss(probs, chosen, groups=RANKS, top_k=K, loss_div_factor=D_TOTAL)
    alone = [
        load_balancing_loss(
            probs[r * ROWS : (r + 1) * ROWS],
            expert_counts(chosen[r * ROWS : (r + 1) * ROWS], E),
            top_k=K,
            loss_div_factor=D_TOTAL,
        )
        for r in range(RANKS)
    ]
    assert_close("each rank's rows alone", expected=jnp.stack(alone), actual=own, tol=WHOLE_BATCH)
    whole = _whole_batch(logits)
    assert float(jnp.sum(own)) > LOCAL_LB_FACTOR_VISIBLE * float(whole), (own, whole)
