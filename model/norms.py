"""RMSNorm, as OLMo-core's `olmo_core.nn.layer_norm.RMSNorm` (full precision, no bias).

Statistics are taken over the last axis only; the gain may carry more axes than that (OLMo-core's
`weight_shape`), e.g. per-head QK-norm gains of shape [H, D] on inputs [B, T, H, D].
"""

import jax
import jax.numpy as jnp
from flax import nnx

from model.precision import full_precision, upcast


def rms_norm(x: jax.Array, weight: jax.Array, *, eps: float) -> jax.Array:
    """x: [..., D]; weight: broadcastable to x, last axis D. Computed in full precision (float32,
    float64 for float64 x), returned in x's dtype: `weight * x / sqrt(mean(x^2) + eps)`."""
    xf = upcast(x)
    variance = jnp.mean(jnp.square(xf), axis=-1, keepdims=True)  # shape: [..., D] -> [..., 1]
    weight = weight.astype(xf.dtype)
    return (weight * (xf * jax.lax.rsqrt(variance + eps))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Thin module over `rms_norm`; `weight_shape` defaults to (size,), initialised to ones in
    `full_precision(dtype)` (dtype: the compute dtype); `axes`: its logical axis names."""

    def __init__(
        self,
        size: int,
        *,
        eps: float,
        weight_shape: tuple[int, ...] | None = None,
        axes: tuple[str, ...] = ("embed",),
        dtype=jnp.float32,
    ):
        self.eps = eps
        self.weight = nnx.Param(
            jnp.ones(weight_shape or (size,), full_precision(dtype)), logical_axes=axes
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], eps=self.eps)
