"""The MoE router's auxiliary losses of one layer, as OLMo-core's `load_balancing_loss` (local-batch
granularity) and `router_z_loss` (olmo_core/nn/moe/loss.py, 3.0.0), unweighted: the trainer
multiplies them by their weights and combines the layers (`Flags.moe_aux_loss_reduction`).

    LB = (E / k) * sum_e count_e * mean_tokens(probs_e) / D     (counts carry no gradient)
    Z  = sum_tokens logsumexp(logits)^2 / D

D is `loss_div_factor`, B*T when None; OLMo-core's trainer passes the number of labelled tokens
of the whole batch (all micro-batches; with data parallelism, that count over the devices), so the
per-micro-batch losses add up to the batch's. Global load balancing averages the counts over the
data devices (`axis_name`).
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
    axis_name: str | None = None,
) -> jax.Array:
    """Switch-style load-balancing loss of one layer (OLMo-core `local_batch` granularity).

    expert_scores: [B, T, E] full-precision router probabilities over all experts;
    expert_counts: [E] token slots of the chosen experts (no gradient). With `axis_name` (inside
    `shard_map`, the data axis; `Flags.moe_global_load_balancing`, OLMo-core
    `global_load_balancing`) the counts are summed over that axis and divided by its size: every
    device balances against the global counts, while its scores stay local. Returns a scalar.
    """
    E = expert_scores.shape[-1]
    counts = jax.lax.stop_gradient(expert_counts).astype(expert_scores.dtype)
    if axis_name is not None:
        counts = jax.lax.pmean(counts, axis_name)
    mean_scores = jnp.mean(expert_scores.reshape(-1, E), axis=0)  # shape: [B*T, E] -> [E]
    loss = jnp.dot(counts, mean_scores) / _div_factor(expert_scores.shape, loss_div_factor)
    return E / top_k * loss


def router_z_loss(router_logits: jax.Array, *, loss_div_factor=None) -> jax.Array:
    """Router z-loss of one layer. router_logits: [B, T, E] full precision. Returns a scalar."""
    lse = jax.nn.logsumexp(router_logits, axis=-1)  # shape: [B, T, E] -> [B, T]
    return jnp.sum(jnp.square(lse)) / _div_factor(router_logits.shape, loss_div_factor)
