"""A small LM for train-step tests and the memory bench: embedding -> LM head (CE + z-loss), and
optionally softmax top-k routers on the embeddings whose load-balancing and z-losses join the
terms, as MoE layers would."""

import jax
import jax.numpy as jnp
import numpy as np

from model.aux_losses import expert_counts, load_balancing_loss, router_z_loss
from model.data import olmo_labels, shift_to_inputs_targets
from model.loss import lm_head_loss_sums

TOP_K = 2


def terms_fn(*, tiles: int = 1, seq_major: bool = False):
    """`train_step` terms: CE and z-loss sums divided by D; with params["routers"] [L, D, E],
    per-router "lb_loss" and "router_z_loss" [L] with loss_div_factor D."""

    def lb(probs, div):
        counts = expert_counts(jax.lax.top_k(probs, TOP_K)[1], probs.shape[-1])
        return load_balancing_loss(probs, counts, top_k=TOP_K, loss_div_factor=div)

    def terms(params, mb, div):
        hidden = params["embeddings"][mb["inputs"]]
        sums = lm_head_loss_sums(
            hidden, params["w_out"], mb["labels"], tiles=tiles, seq_major=seq_major
        )
        out = {"ce": sums[0] / div, "z_loss": sums[1] / div}
        if "routers" in params:
            logits = jnp.einsum("btd,lde->lbte", hidden, params["routers"])
            out["lb_loss"] = jax.vmap(lb, in_axes=(0, None))(jax.nn.softmax(logits, -1), div)
            out["router_z_loss"] = jax.vmap(lambda x: router_z_loss(x, loss_div_factor=div))(logits)
        return out

    return terms


def params_and_rows(
    *, vocab: int, d_model: int, rows: int, seq_len: int, routers: int = 0, experts: int = 8
):
    """Random params (with `routers` routers of `experts` experts) and `rows` token rows of
    seq_len + 1, shifted, with OLMo-core labels."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    params = {
        "embeddings": jnp.asarray(normal(vocab, d_model)),
        "w_out": jnp.asarray(normal(d_model, vocab) / d_model**0.5),
    }
    if routers:
        params["routers"] = jnp.asarray(normal(routers, d_model, experts) / d_model**0.5)
    batch = shift_to_inputs_targets(rng.integers(0, vocab, (rows, seq_len + 1)))
    batch["labels"] = olmo_labels(batch["targets"], batch["targets_segmentation"])
    return params, batch


def micro_batches(batch: dict, ga: int) -> dict:
    """[rows, T] -> [ga, rows / ga, T]."""
    return {k: v.reshape(ga, v.shape[0] // ga, *v.shape[1:]) for k, v in batch.items()}
