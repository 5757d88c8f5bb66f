"""A small LM (embedding -> LM head, CE + z-loss) for train-step tests and the memory bench."""

import jax.numpy as jnp
import numpy as np

from model.data import olmo_labels, shift_to_inputs_targets
from model.loss import lm_head_loss_sums


def terms_fn(*, tiles: int = 1, seq_major: bool = False):
    """`train_step` terms of embedding -> w_out: CE and z-loss sums divided by D."""

    def terms(params, mb, div):
        hidden = params["embeddings"][mb["inputs"]]
        ce, z = lm_head_loss_sums(
            hidden, params["w_out"], mb["labels"], tiles=tiles, seq_major=seq_major
        )
        return {"ce": ce / div, "z_loss": z / div}

    return terms


def params_and_rows(*, vocab: int, d_model: int, rows: int, seq_len: int, seed: int = 0):
    """Random params and `rows` token rows of seq_len + 1, shifted, with OLMo-core labels."""
    rng = np.random.default_rng(seed)
    params = {
        "embeddings": jnp.asarray(rng.standard_normal((vocab, d_model), dtype=np.float32)),
        "w_out": jnp.asarray(
            rng.standard_normal((d_model, vocab), dtype=np.float32) / d_model**0.5
        ),
    }
    batch = shift_to_inputs_targets(rng.integers(0, vocab, (rows, seq_len + 1)))
    batch["labels"] = olmo_labels(batch["targets"], batch["targets_segmentation"])
    return params, batch


def micro_batches(batch: dict, ga: int) -> dict:
    """[rows, T] -> [ga, rows / ga, T]."""
    return {k: v.reshape(ga, v.shape[0] // ga, *v.shape[1:]) for k, v in batch.items()}
