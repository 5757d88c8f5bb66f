"""The LM loss: cross entropy with an ignore index and the logit z-loss (OLMo-core
`olmo_core/nn/functional/cross_entropy_loss.py` with reduction "sum"; the trainer divides by the
batch's count of labels that are not ignored, OLMo-core's `loss_div_factor`), and vocab tiling.

Vocab tiling bounds the [tokens, V] logits in full precision to one tile's worth at a time. The
forward pass walks the tokens in tiles (all V columns each) and keeps each token's logsumexp; the
backward pass (a custom VJP) walks the vocabulary in as many tiles (all tokens each), so each
tile's columns of the LM head's weight gradient are one matmul, written once, where a walk over
tokens adds every tile's [D, V] product into one buffer. The backward pass recomputes each
tile's logits with the LM head's matmul, or takes them from the forward's in the compute dtype
(`keep_logits`), a matmul fewer for [tokens, V] of memory.

Flat tiling cuts the flattened [B * T] tokens; seq-major (`Flags.vocab_tiling_seq_major`) cuts the
sequence, every tile holding all rows. On a mesh every tile's rows are split over the batch axes,
as MaxText's (`reshaped_hidden_spec`), so each device computes its share of every tile: a flat
tile's rows come from a few devices' rows, so XLA gathers the hidden states to lay them out; a
seq-major tile's rows are where the batch's already are, and nothing moves.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from model.data import IGNORE_INDEX
from model.layout import Layout
from model.precision import full_precision, upcast


def _terms(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(CE sum, z sum, lse [...]) of logits [..., V] in full precision; labels [...]."""
    logits = upcast(logits)
    keep = labels != IGNORE_INDEX
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, jnp.where(keep, labels, 0)[..., None], axis=-1)[..., 0]
    ce = jnp.sum(jnp.where(keep, lse - target, 0.0))
    return ce, jnp.sum(jnp.where(keep, jnp.square(lse), 0.0)), lse


def cross_entropy_sums(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """logits [..., V]; labels [...] (IGNORE_INDEX skipped). Returns the sums over the kept tokens
    of CE and of logsumexp(logits)^2 (the z-loss before its weight), in full precision."""
    return _terms(logits, labels)[:2]


def _token_tiles(hidden, w_out, labels, keep_logits: bool):
    """The sums over token tiles hidden [tiles, ..., D], labels [tiles, ...], each tile's logits
    made once; and what the backward pass needs: lse [tiles, ...] and (`keep_logits`) the
    logits [tiles, ..., V] in the compute dtype."""

    def tile(sums, x):
        h, y = x
        logits = h @ w_out
        ce, z, lse = _terms(logits, y)
        return (sums[0] + ce, sums[1] + z), (lse, logits if keep_logits else None)

    zero = jnp.zeros((), full_precision(jnp.result_type(hidden, w_out)))
    return lax.scan(tile, (zero, zero), (hidden, labels))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled_sums(hidden, w_out, labels, keep_logits: bool):
    """`cross_entropy_sums(hidden @ w_out, labels)` over token tiles hidden [tiles, ..., D]. Its
    backward pass walks the vocabulary in as many tiles (`_vocab_tiles_backward`)."""
    return _token_tiles(hidden, w_out, labels, keep_logits=False)[0]


def _tiled_sums_forward(hidden, w_out, labels, keep_logits):
    sums, (lse, logits) = _token_tiles(hidden, w_out, labels, keep_logits)
    return sums, (hidden, w_out, labels, lse, logits)


def _vocab_tiles_backward(keep_logits, residuals, cotangents):
    """Gradients a vocab tile at a time (V / tiles columns, every token): each tile's columns of
    the weight gradient are one matmul over all tokens, written once; the hidden states'
    gradient sums the tiles' products in full precision, rounded to the compute dtype once.
    Over kept tokens,
        d sums / d logits = (dce + 2 dz lse) p - dce onehot(label),   p = exp(logits - lse)."""
    hidden, w_out, labels, lse, logits = residuals
    dce, dz = cotangents
    tiles, V = hidden.shape[0], w_out.shape[-1]
    width = V // tiles
    tokens = tuple(range(hidden.ndim - 1))  # every axis but D: the tiles and their rows
    keep = labels != IGNORE_INDEX
    softmax_weight = jnp.where(keep, dce + 2 * dz * lse, 0.0)[..., None]
    label_weight = jnp.where(keep, dce, 0.0)[..., None]
    sum_dtype = full_precision(hidden.dtype)

    def vocab_tile(carry, j):
        d_hidden, d_w = carry
        first = j * width
        w_j = lax.dynamic_slice_in_dim(w_out, first, width, axis=-1)  # [D, V / tiles]
        if keep_logits:
            logits_j = lax.dynamic_slice_in_dim(logits, first, width, axis=-1)
        else:
            logits_j = hidden @ w_j
        p = jnp.exp(upcast(logits_j) - lse[..., None])
        is_label = labels[..., None] == first + jnp.arange(width)
        d_logits = p * softmax_weight - jnp.where(is_label, label_weight, 0.0)
        d_logits = d_logits.astype(logits_j.dtype)
        d_w_j = jnp.tensordot(hidden, d_logits, axes=(tokens, tokens))  # [D, V / tiles]
        d_hidden = d_hidden + jnp.matmul(d_logits, w_j.T, preferred_element_type=sum_dtype)
        d_w = lax.dynamic_update_slice_in_dim(d_w, d_w_j.astype(d_w.dtype), first, axis=-1)
        return (d_hidden, d_w), None

    zeros = (jnp.zeros(hidden.shape, sum_dtype), jnp.zeros(w_out.shape, w_out.dtype))
    (d_hidden, d_w), _ = lax.scan(vocab_tile, zeros, jnp.arange(tiles))
    return d_hidden.astype(hidden.dtype), d_w, None


_tiled_sums.defvjp(_tiled_sums_forward, _vocab_tiles_backward)


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

    hidden [B, T, D] (after the LM-head norm); w_out [D, V]; labels [B, T]. `tiles` must divide V,
    and B * T (flat tiling) or T (seq-major).
    """
    B, T, D = hidden.shape
    tokens = T if seq_major else B * T
    if tokens % tiles:
        axis = "T" if seq_major else "B * T"
        raise ValueError(f"vocab tiles={tiles} must divide {axis}={tokens}")
    if w_out.shape[-1] % tiles:
        raise ValueError(f"vocab tiles={tiles} must divide the vocab V={w_out.shape[-1]}")
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
    return _tiled_sums(hidden, w_out, labels, keep_logits)
