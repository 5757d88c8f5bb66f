"""MaxText behaviours that are no config of the model, as wrappers around its public functions:
terms-function wrappers for `parity.run.Run.wrap_terms` and EMO draws for `Run.draws`."""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from model.config import EmoConfig
from model.router import draw_pools
from model.train_step import AUX_TERMS, TermsFn, loss_div_factor

DRAW_SEED = 2026
"""`JaxDraws`: step s draws from `fold_in(key(DRAW_SEED), s)`."""


def _positions(mb) -> jax.Array:
    return jnp.float32(mb["labels"].size)


def micro_batch_mean_logs(terms_fn: TermsFn) -> TermsFn:
    """MaxText's logs before the GA fix: every term but CE normalised by the micro-batch's own
    labelled tokens instead of the batch's D, so their sum over micro-batches is GA times too
    large. Only the logged values change; the gradient stays OLMo-core's."""

    def terms(params, mb, div):
        out = terms_fn(params, mb, div)
        scale = div / loss_div_factor(mb)
        return {k: v if k == "ce" else v + lax.stop_gradient(v * scale - v) for k, v in out.items()}

    return terms


def _router_losses_divided_by(normaliser, terms_fn: TermsFn) -> TermsFn:
    def terms(params, mb, div):
        out = terms_fn(params, mb, div)
        scale = div / normaliser(mb)
        return out | {k: out[k] * scale for k in AUX_TERMS}

    return terms


def aux_per_micro_batch_labels(terms_fn: TermsFn) -> TermsFn:
    """Router losses divided by the micro-batch's labelled tokens, not the batch's D (both the
    value and the gradient: GA times OLMo-core's with equal micro-batches)."""
    return _router_losses_divided_by(loss_div_factor, terms_fn)


def aux_per_micro_batch_positions(terms_fn: TermsFn) -> TermsFn:
    """Router losses divided by the micro-batch's positions, ignored labels included."""
    return _router_losses_divided_by(_positions, terms_fn)


@dataclass(frozen=True)
class JaxDraws:
    """EMO pool sizes drawn by JAX's RNG, as MaxText (which cannot replay torch's): OLMo-core's
    distribution (`model.router.draw_pools`), other values; step s from
    `fold_in(key(DRAW_SEED), s)`."""

    emo: EmoConfig

    def __call__(self, step: int, shape: tuple[int, ...]) -> np.ndarray:
        key = jax.random.fold_in(jax.random.key(DRAW_SEED), step)
        flat = draw_pools(key, (int(np.prod(shape[:-1])), shape[-1]), emo=self.emo)
        return np.asarray(flat).reshape(shape)
