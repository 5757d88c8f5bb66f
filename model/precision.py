"""Compute dtypes (`ModelConfig.compute_dtype`) and the precision of the maths OLMo-core runs in
float32 (norm statistics, softmaxes, the router, KDA's recurrence, the losses).

    "float32"   params and every computation float32 (OLMo-core's CPU goldens)
    "float64"   params and every computation float64, to compare with an OLMo-core model cast by
                `.to(torch.float64)`; needs `jax_enable_x64`
    "bfloat16"  params float32, activations bfloat16 (MaxText's training precision)

Modules take the compute dtype as `dtype` and create their params in `full_precision(dtype)`. The
float32 maths upcasts with `upcast`: float32 for float32 and bfloat16 inputs, float64 stays float64,
and nothing is promoted past float32 when x64 is merely enabled.

Matmul precision (`ScaleConfig.matmul_precision`, resolved by `matmul_precision`) is set once
for the whole train step (`model.train_step.accumulate`) with `jax.default_matmul_precision`:
JAX writes it into every dot_general and ragged_dot it traces there, the backward's and the
Pallas kernels' included.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from model.config import Config


def full_precision(dtype) -> np.dtype:
    """`dtype` promoted to at least float32: bfloat16 and float32 -> float32, float64 stays
    (becomes float32 without x64, as JAX makes every float64 array)."""
    return jax.dtypes.canonicalize_dtype(jnp.promote_types(dtype, jnp.float32))


def upcast(x: jax.Array) -> jax.Array:
    """x in `full_precision(x.dtype)`."""
    return x.astype(full_precision(x.dtype))


def compute_dtype(name: str) -> np.dtype:
    """The dtype of `ModelConfig.compute_dtype` `name`; float64 needs 64-bit JAX enabled."""
    if name == "float64" and not jax.config.jax_enable_x64:
        raise ValueError(
            'compute_dtype "float64" needs 64-bit JAX: call '
            'jax.config.update("jax_enable_x64", True) before building the model, or build and '
            "run it inside `with jax.enable_x64(True):`"
        )
    return jnp.dtype(name)


def matmul_precision(cfg: Config) -> str:
    """`cfg.scale.matmul_precision`, or where None by the compute dtype: "default" for bfloat16
    (one bfloat16 pass on a TPU, MaxText's), "highest" for float32 and float64."""
    chosen = cfg.scale.matmul_precision
    if chosen is not None:
        return chosen
    return "default" if cfg.model.compute_dtype == "bfloat16" else "highest"


TPU_LANES = 128
"""A TPU vector register's lanes: Pallas blocks' last dimension comes in whole multiples."""


def kernel_precision(*dtypes) -> str | None:
    """The matmul precision of Pallas TPU kernels (megablox's, `model.kda_pallas`,
    `model.attention_pallas`), from the trace's: Mosaic multiplies bfloat16 tiles in one pass
    only ("default"; their products are exact in its float32 accumulator), and has no "high"
    (three bfloat16 passes): float32 tiles run at "highest"."""
    traced = jax.config.jax_default_matmul_precision
    if all(d == jnp.bfloat16 for d in dtypes):
        return "default"
    return "highest" if traced == "high" else traced


def at_kernel_precision(fn, precision: str | None, *args):
    """`fn(*args)` with every matmul it traces, forward and backward, at `precision`
    (`kernel_precision`): a Pallas kernel's custom VJP traces its backward where autodiff
    transposes it, outside any precision set around the call."""

    @jax.custom_vjp
    def run(*args):
        return forward(*args)[0]

    def forward(*args):
        with jax.default_matmul_precision(precision):
            return jax.vjp(fn, *args)

    def backward(vjp, dy):
        with jax.default_matmul_precision(precision):
            return vjp(dy)

    run.defvjp(forward, backward)
    return run(*args)
