"""Running NNX modules in tests: one jitted forward and one jitted VJP, shared by the golden tests
(the module's graph is static, so each module type compiles once per input shape)."""

import functools

import jax
from flax import nnx


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, *args):
    return nnx.merge(graphdef, state)(*args)


def apply(module: nnx.Module, *args):
    """`module(*args)` under jit."""
    graphdef, state = nnx.split(module)
    return _apply(graphdef, state, *args)


@functools.partial(jax.jit, static_argnums=0)
def _vjp(graphdef, state, x, cotangent, *args):
    y, vjp = jax.vjp(lambda s, x: nnx.merge(graphdef, s)(x, *args), state, x)
    return y, vjp(cotangent)


def module_vjp(module: nnx.Module, x, cotangent, *args):
    """(y, (grad of the module's state, grad of x)) of `module(x, *args)` for `cotangent`, a
    pytree shaped like y, under jit."""
    graphdef, state = nnx.split(module)
    return _vjp(graphdef, state, x, cotangent, *args)
