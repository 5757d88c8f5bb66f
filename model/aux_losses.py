"""The MoE router's auxiliary losses of one layer, as OLMo-core's `load_balancing_loss` (local-batch
granularity) and `router_z_loss` (olmo_core/nn/moe/loss.py, 3.0.0), unweighted: the trainer
multiplies them by their weights and combines the layers (`Flags.moe_aux_loss_reduction`).

    LB = (E / k) * sum_e count_e * mean_tokens(probs_e) / D     (counts carry no gradient)
    Z  = sum_tokens logsumexp(logits)^2 / D

D is `loss_div_factor`, B*T when None; OLMo-core's trainer passes the number of labelled tokens
of the whole batch (all micro-batches), so the per-micro-batch losses add up to the batch's.
Averaging counts across devices (global load balancing) is not done here.
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
    *,
    num_experts: int,
    top_k: int,
    expert_scores: jax.Array,
    batch_size_per_expert: jax.Array,
    loss_div_factor=None,
) -> jax.Array:
    """Switch-style load-balancing loss. expert_scores: [B, T, E] float32 router probabilities
    over all experts; batch_size_per_expert: [E] counts of the chosen experts. Returns a scalar."""
    mean_scores = jnp.mean(expert_scores.reshape(-1, num_experts), axis=0)  # shape: [B*T, E] -> [E]
    counts = jax.lax.stop_gradient(batch_size_per_expert).astype(expert_scores.dtype)
    loss = jnp.dot(counts, mean_scores) / _div_factor(expert_scores.shape, loss_div_factor)
    return num_experts / top_k * loss


def router_z_loss(*, expert_logits: jax.Array, loss_div_factor=None) -> jax.Array:
    """Router z-loss. expert_logits: [B, T, E] float32. Returns a scalar."""
    lse = jax.nn.logsumexp(expert_logits, axis=-1)  # shape: [B, T, E] -> [B, T]
    return jnp.sum(jnp.square(lse)) / _div_factor(expert_logits.shape, loss_div_factor)
