"""The LM loss: cross entropy with an ignore index and the logit z-loss (OLMo-core
`olmo_core/nn/functional/cross_entropy_loss.py` with reduction "sum"; the trainer divides by the
batch's count of labels that are not ignored, OLMo-core's `loss_div_factor`), and vocab tiling.

Vocab tiling computes LM head + loss tile by tile under `lax.scan` with rematerialisation, so the
[tokens, V] logits exist for one tile at a time in the forward and the backward. Flat tiling cuts
the flattened [B * T] tokens; seq-major (`Flags.vocab_tiling_seq_major`) cuts the sequence, every
tile holding all rows. On a mesh every tile's rows are split over the batch axes, as MaxText's
(`reshaped_hidden_spec`), so each device computes its share of every tile: a flat tile's rows come
from a few devices' rows, so XLA gathers the hidden states to lay them out; a seq-major tile's rows
are where the batch's already are, and nothing moves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from model.data import IGNORE_INDEX
from model.layout import Layout
from model.precision import full_precision, upcast


def cross_entropy_sums(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [..., V]; labels [...] (IGNORE_INDEX skipped). Returns the sums over the kept tokens
    of CE and of logsumexp(logits)^2 (the z-loss before its weight), in full precision."""
    logits = upcast(logits)
    keep = labels != IGNORE_INDEX
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, jnp.where(keep, labels, 0)[..., None], axis=-1)[..., 0]
    ce = jnp.sum(jnp.where(keep, lse - target, 0.0))
    return ce, jnp.sum(jnp.where(keep, jnp.square(lse), 0.0))


@jax.named_scope("vocab_loss")
def lm_head_loss_sums(
    hidden: jax.Array,
    w_out: jax.Array,
    labels: jax.Array,
    *,
    tiles: int = 1,
    seq_major: bool = False,
    layout: Layout | None = None,
) -> tuple[jax.Array, jax.Array]:
    """`cross_entropy_sums(hidden @ w_out, labels)` in `tiles` tiles, on `layout`'s mesh (None:
    one device).

    hidden [B, T, D] (after the LM-head norm); w_out [D, V]; labels [B, T]. Flat tiling needs
    `tiles` to divide B * T, seq-major to divide T.
    """
    B, T, D = hidden.shape
    tokens = T if seq_major else B * T
    if tokens % tiles:
        axis = "T" if seq_major else "B * T"
        raise ValueError(f"vocab tiles={tiles} must divide {axis}={tokens}")
    if tiles == 1:
        return cross_entropy_sums(hidden @ w_out, labels)
    if seq_major:
        # shape: [B, T, D] -> [tiles, B, T / tiles, D]
        hidden = jnp.moveaxis(hidden.reshape(B, tiles, T // tiles, D), 1, 0)
        labels = jnp.moveaxis(labels.reshape(B, tiles, T // tiles), 1, 0)
        rows = (None, "batch", "length")
    else:
        # shape: [B, T, D] -> [tiles, B * T / tiles, D]
        hidden = hidden.reshape(tiles, (B * T) // tiles, D)
        labels = labels.reshape(tiles, (B * T) // tiles)
        rows = (None, "batch")
    if layout is not None:
        hidden = layout.constrain(hidden, (*rows, "embed"))
        labels = layout.constrain(labels, rows)

    @jax.checkpoint
    def tile(sums, x):
        h, y = x
        ce, z = cross_entropy_sums(h @ w_out, y)
        return (sums[0] + ce, sums[1] + z), None

    zero = jnp.zeros((), full_precision(jnp.result_type(hidden, w_out)))
    (ce, z), _ = lax.scan(tile, (zero, zero), (hidden, labels))
    return ce, z
