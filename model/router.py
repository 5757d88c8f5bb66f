"""The MoE router with EMO document expert pools, as OLMo-core's `MoERouterV2` and `EmoRouterV2`
(olmo_core/nn/moe/v2/router.py, emo_router.py; olmo_core/ops/moe.py; 3.0.0), softmax gating.

    probs = softmax(W x)                          (full precision, over all E experts)
    EMO: document score = sum of probs over every token of the document (future tokens too);
         each document keeps its top-`pool` experts, the others are masked before top-k
    indices = top_k(probs, masked); weights = probs[indices]    (the unmasked probabilities)
    weights = weights / sum(weights) * top_k      (normalize_expert_weights, restore_weight_scale)

Documents come from EOS (`document_ids_from_eos`). Pools are one number per document: OLMo-core's
draw tensor [B, T] (document d of a row uses column d), `draw_pools` from a JAX key, or the eval
pool. The weight is OLMo-core's flat [E * d_model].

Ties: pool ranks put the lower expert index first on equal document scores, as OLMo-core's
`argsort(descending=True)` does on a CPU for E <= 16 (an insertion sort; for larger E its order of
equal scores has no simple rule); top-k takes the lower index first. Exact ties between router
probabilities do not occur on real inputs; `tests/test_router.py` checks the pool ties against
OLMo-core's `pool_keep_mask`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import EmoConfig, MoEConfig
from model.init import trunc_normal
from model.precision import full_precision


class Routing(NamedTuple):
    """What the router gives the experts and the aux losses."""

    weights: jax.Array
    """[B, T, k] full-precision combine weights of the chosen experts."""
    indices: jax.Array
    """[B, T, k] int32 chosen experts, by decreasing probability."""
    probs: jax.Array
    """[B, T, E] full-precision softmax over all experts (the load-balancing loss's scores)."""
    logits: jax.Array
    """[B, T, E] full precision (the router z-loss's input)."""


def document_ids_from_eos(input_ids: jax.Array, *, eos_token_id: int) -> jax.Array:
    """[B, T] ids -> [B, T] int32 document index per row from 0, an EOS closing its own document:
    `eos.cumsum() - eos` (OLMo-core's `segment_ids_from_eos`)."""
    eos = (input_ids == eos_token_id).astype(jnp.int32)
    return jnp.cumsum(eos, axis=-1, dtype=jnp.int32) - eos


def draw_pools(key: jax.Array, shape: tuple[int, int], *, emo: EmoConfig) -> jax.Array:
    """Per-document pool sizes uniform in [min_pool, max_pool]: [B, T] int32, column d for
    document d (OLMo-core draws the same shape with `torch.randint`)."""
    return jax.random.randint(key, shape, emo.min_pool, emo.max_pool + 1, jnp.int32)


def token_pools(pools: jax.Array | None, document_ids: jax.Array, *, emo: EmoConfig) -> jax.Array:
    """Each token's pool: [B, T] int32 from per-document pools [B, T] (None: the eval pool)."""
    if pools is None:
        return jnp.full(document_ids.shape, emo.eval_pool, jnp.int32)
    return jnp.take_along_axis(pools.astype(jnp.int32), document_ids, axis=1)


def document_scores(probs: jax.Array, document_ids: jax.Array) -> jax.Array:
    """probs [B, T, E], document_ids [B, T] -> [B, T, E]: each token gets the sum of probs over
    its whole document (OLMo-core's `doc_sum_scatter`, summed in token order)."""
    B = probs.shape[0]
    rows = jnp.arange(B)[:, None]
    sums = jnp.zeros_like(probs).at[rows, document_ids].add(probs)  # shape: [B, docs <= T, E]
    return sums[rows, document_ids]


def pool_keep_mask(scores: jax.Array, pools: jax.Array) -> jax.Array:
    """scores [B, T, E], pools [B, T] -> bool [B, T, E]: expert ranks (by decreasing score, lower
    index first on ties) below the token's pool (OLMo-core's `pool_keep_mask`). An expert's rank
    counts the experts ahead of it, compared pairwise: the ranks a stable descending argsort
    gives, without the two sorts XLA's CPU is slow at."""
    e = jnp.arange(scores.shape[-1])
    other, this = scores[..., None, :], scores[..., :, None]  # [B, T, E(this), E(other)]
    ahead = (other > this) | ((other == this) & (e < e[:, None]))
    ranks = jnp.sum(ahead, axis=-1)
    return ranks < pools[..., None]


def chosen(probs: jax.Array, indices: jax.Array) -> jax.Array:
    """probs [..., E] at indices [..., k] (distinct): each the one term of a masked sum over E,
    exact, where `take_along_axis` would gather (and scatter its gradient: slow on TPU)."""
    picked = indices[..., None] == jnp.arange(probs.shape[-1])  # shape: [..., k, E]
    return jnp.sum(jnp.where(picked, probs[..., None, :], 0.0), axis=-1)


def route(
    logits: jax.Array, *, top_k: int, normalize: bool, restore_weight_scale: bool, keep=None
) -> Routing:
    """Softmax top-k routing of full-precision logits [B, T, E]; `keep` [B, T, E] bool masks experts
    before top-k (EMO), the weights stay the unmasked probabilities."""
    probs = jax.nn.softmax(logits, axis=-1)
    selection = probs if keep is None else jnp.where(keep, probs, -jnp.inf)
    _, indices = jax.lax.top_k(selection, top_k)  # shape: [B, T, E] -> [B, T, k]
    weights = chosen(probs, indices)
    if normalize:  # F.normalize(p=1): w / max(|w|_1, 1e-12)
        weights = weights / jnp.maximum(jnp.sum(jnp.abs(weights), -1, keepdims=True), 1e-12)
    if restore_weight_scale:
        weights = weights * top_k
    return Routing(weights, indices.astype(jnp.int32), probs, logits)


class Router(nnx.Module):
    """x [B, T, d_model] -> `Routing`. With `config.emo`, `document_ids` [B, T] are required and
    `pools` are the per-document pool sizes [B, T] (training) or None (evaluation: eval pool).
    `dtype`: the compute dtype; the router computes in full precision whatever it is, unless
    `config.router_dtype` says otherwise. Weight drawn `trunc_normal(std)`."""

    def __init__(
        self, config: MoEConfig, d_model: int, *, std: float, dtype=jnp.float32, rngs: nnx.Rngs
    ):
        self.config, self.d_model = config, d_model
        shape = (config.num_experts * d_model,)
        self.weight = nnx.Param(  # flat [E * d_model], split over fsdp as any weight
            trunc_normal(std)(rngs.params(), shape, full_precision(dtype)), logical_axes=("embed",)
        )

    @jax.named_scope("router")
    def __call__(
        self,
        x: jax.Array,
        *,
        document_ids: jax.Array | None = None,
        pools: jax.Array | None = None,
    ) -> Routing:
        c = self.config
        w = self.weight[...].reshape(c.num_experts, self.d_model)
        precise = full_precision(w.dtype)
        dtype = precise if c.router_dtype is None else jnp.dtype(c.router_dtype)
        # shape: [B, T, D] -> [B, T, E]
        logits = (x.astype(dtype) @ w.astype(dtype).T).astype(precise)
        keep = None
        if c.emo is not None:
            if document_ids is None:
                raise ValueError("EMO routing needs document_ids [B, T]")
            doc_scores = document_scores(jax.nn.softmax(logits, axis=-1), document_ids)
            keep = pool_keep_mask(doc_scores, token_pools(pools, document_ids, emo=c.emo))
        elif pools is not None:
            raise ValueError("pools given to a router without EMO")
        return route(
            logits,
            top_k=c.top_k,
            normalize=c.normalize_expert_weights,
            restore_weight_scale=c.restore_weight_scale,
            keep=keep,
        )
