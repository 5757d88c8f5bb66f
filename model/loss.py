"""The LM loss: cross entropy with an ignore index and the logit z-loss (OLMo-core
`olmo_core/nn/functional/cross_entropy_loss.py` with reduction "sum"; the trainer divides by the
batch's count of labels that are not ignored, OLMo-core's `loss_div_factor`), and vocab tiling.

Vocab tiling computes LM head + loss tile by tile under `lax.scan` with rematerialisation, so the
[tokens, V] logits in full precision exist for one tile at a time in the forward and the backward;
the backward pass recomputes each tile's logits with the LM head's matmul, or keeps them from the
forward in the compute dtype (`keep_logits`), a matmul fewer for [tokens, V] of memory.

Flat tiling cuts the flattened [B * T] tokens; seq-major (`Flags.vocab_tiling_seq_major`) cuts the
sequence, every tile holding all rows. On a mesh every tile's rows are split over the batch axes,
as MaxText's (`reshaped_hidden_spec`), so each device computes its share of every tile: a flat
tile's rows come from a few devices' rows, so XLA gathers the hidden states to lay them out; a
seq-major tile's rows are where the batch's already are, and nothing moves.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from model.data import IGNORE_INDEX
from model.layout import Layout
from model.precision import full_precision, upcast

TILE_LOGITS = "vocab_tile_logits"
"""The name a tile's logits carry for `jax.checkpoint`'s policy."""


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
    keep_logits: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """`cross_entropy_sums(hidden @ w_out, labels)` in `tiles` tiles, on `layout`'s mesh (None:
    one device). The backward pass recomputes each tile's logits, or with `keep_logits` keeps
    them from the forward (`ScaleConfig.vocab_tiles_keep_logits`).

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

    def tile(sums, x):
        h, y = x
        ce, z = cross_entropy_sums(checkpoint_name(h @ w_out, TILE_LOGITS), y)
        return (sums[0] + ce, sums[1] + z), None

    keep = jax.checkpoint_policies.save_only_these_names(TILE_LOGITS) if keep_logits else None
    tile = jax.checkpoint(tile, policy=keep)

    zero = jnp.zeros((), full_precision(jnp.result_type(hidden, w_out)))
    (ce, z), _ = lax.scan(tile, (zero, zero), (hidden, labels))
    return ce, z
