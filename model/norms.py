"""RMSNorm, as OLMo-core's `olmo_core.nn.layer_norm.RMSNorm` (full precision, no bias).

Statistics are taken over the last axis only; the gain may carry more axes than that (OLMo-core's
`weight_shape`), e.g. per-head QK-norm gains of shape [H, D] on inputs [B, T, H, D].
"""

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float) -> jax.Array:
    """x: [..., D]; weight: broadcastable to x, last axis D. Computed in float32, returned in
    x's dtype: `weight * x / sqrt(mean(x^2) + eps)`."""
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)  # shape: [..., D] -> [..., 1]
    return (weight.astype(jnp.float32) * (x32 * jax.lax.rsqrt(variance + eps))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Thin module over `rms_norm`; `weight_shape` defaults to (size,), initialised to ones."""

    def __init__(self, size: int, *, eps: float, weight_shape: tuple[int, ...] | None = None):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones(weight_shape or (size,), jnp.float32))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], eps=self.eps)
