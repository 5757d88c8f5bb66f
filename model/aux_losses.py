"""The MoE router's auxiliary losses of one layer, as OLMo-core's `load_balancing_loss` (local-batch
granularity) and `router_z_loss` (olmo_core/nn/moe/loss.py, 3.0.0), unweighted: the trainer
multiplies them by their weights and combines the layers (`Flags.moe_aux_loss_reduction`).

    LB = (E / k) * sum_e count_e * mean_tokens(probs_e) / D     (counts carry no gradient)
    Z  = sum_tokens logsumexp(logits)^2 / D

D is `loss_div_factor`, B*T when None; OLMo-core's trainer passes the number of labelled tokens
of the whole batch (all micro-batches; with data parallelism, that count over the devices), so the
per-micro-batch losses add up to the batch's. OLMo-core's global load balancing averages the counts
over the data-parallel ranks, each rank's loss taking its own tokens' scores: summed over the ranks
that is this loss on the whole batch. Without it each rank balances its own rows:
`grouped_load_balancing_loss`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def expert_counts(indices: jax.Array, num_experts: int) -> jax.Array:
    """[..., k] chosen experts -> [E] int32 token slots per expert (no gradient)."""
    one_hot = indices.reshape(-1)[:, None] == jnp.arange(num_experts)  # shape: [N*k, E]
    return jax.lax.stop_gradient(jnp.sum(one_hot, axis=0, dtype=jnp.int32))


def _div_factor(shape: tuple[int, ...], loss_div_factor) -> jax.Array | float:
    B, T, _ = shape
    return B * T if loss_div_factor is None else loss_div_factor


def load_balancing_loss(
    expert_scores: jax.Array,
    expert_counts: jax.Array,
    *,
    top_k: int,
    loss_div_factor=None,
) -> jax.Array:
    """Switch-style load-balancing loss of one layer (OLMo-core `local_batch` granularity).

    expert_scores: [B, T, E] full-precision router probabilities over all experts;
    expert_counts: [E] token slots of the chosen experts (no gradient). Returns a scalar.
    """
    E = expert_scores.shape[-1]
    counts = jax.lax.stop_gradient(expert_counts).astype(expert_scores.dtype)
    mean_scores = jnp.mean(expert_scores.reshape(-1, E), axis=0)  # shape: [B*T, E] -> [E]
    loss = jnp.dot(counts, mean_scores) / _div_factor(expert_scores.shape, loss_div_factor)
    return E / top_k * loss


def grouped_load_balancing_loss(
    expert_scores: jax.Array, indices: jax.Array, *, groups: int, top_k: int, loss_div_factor=None
) -> jax.Array:
    """The rows split into `groups` equal blocks (the devices' rows), each balanced on its own
    counts, as MaxText's per-device load balancing: [groups] losses, each divided by the whole
    batch's `loss_div_factor`. expert_scores [B, T, E]; indices [B, T, k]."""
    B, T, E = expert_scores.shape
    if B % groups:
        raise ValueError(f"{B} rows do not split into {groups} load-balancing groups")
    div = B * T if loss_div_factor is None else loss_div_factor

    def one(scores, chosen):
        counts = expert_counts(chosen, E)
        return load_balancing_loss(scores, counts, top_k=top_k, loss_div_factor=div)

    return jax.vmap(one)(
        expert_scores.reshape(groups, B // groups, T, E),
        indices.reshape(groups, B // groups, T, -1),
    )


def router_z_loss(router_logits: jax.Array, *, loss_div_factor=None) -> jax.Array:
    """Router z-loss of one layer. router_logits: [B, T, E] full precision. Returns a scalar."""
    lse = jax.nn.logsumexp(router_logits, axis=-1)  # shape: [B, T, E] -> [B, T]
    return jnp.sum(jnp.square(lse)) / _div_factor(router_logits.shape, loss_div_factor)
