"""Parameter initialisers with OLMo-core's distributions (olmo_core/nn/transformer/init.py)."""

import jax
import jax.numpy as jnp
from flax import nnx

from model.precision import full_precision


def trunc_normal(std: float):
    """Normal(0, std) truncated to [-3 std, 3 std], as OLMo-core's `init_linear`."""

    def init(key, shape, dtype=jnp.float32):
        return std * jax.random.truncated_normal(key, -3.0, 3.0, shape, dtype)

    return init


def log_uniform(low: float, high: float):
    """log(U(low, high)), as OLMo-core initialises KDA's A_log."""

    def init(key, shape, dtype=jnp.float32):
        return jnp.log(jax.random.uniform(key, shape, dtype, low, high))

    return init


def linear(
    d_in: int,
    d_out: int,
    std: float,
    rngs: nnx.Rngs,
    *,
    axes: tuple[str, str],
    bias: bool = False,
    dtype=jnp.float32,
) -> nnx.Linear:
    """A linear layer, kernel [in, out] drawn `trunc_normal(std)`, bias (if any) zero; computes in
    `dtype` (the compute dtype), params in `full_precision(dtype)`. `axes`: the kernel's logical
    axis names (`model.layout`); the bias takes the output's."""
    return nnx.Linear(
        d_in,
        d_out,
        use_bias=bias,
        kernel_init=trunc_normal(std),
        dtype=dtype,
        param_dtype=full_precision(dtype),
        rngs=rngs,
        kernel_metadata={"logical_axes": axes},
        bias_metadata={"logical_axes": axes[1:]},
    )
