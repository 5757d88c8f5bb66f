"""`ScaleConfig.matmul_precision` (model.precision): the train step traces every dot_general and
ragged_dot, forward and backward, in the GA loop, under remat and inside the Pallas megablox
kernels, at the precision the config resolves to, whatever JAX's default (the tests' is
"highest"). The step is traced, not compiled."""

import dataclasses
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.extend import core

from model import train_step as ts
from model.config import MATMUL_PRECISIONS, ScaleConfig, micro, olmo_core
from model.moe import megablox_matmul, routed_experts
from model.objective import model_terms_fn
from model.precision import matmul_precision
from model.state import abstract_params

DOTS = ("dot_general", "ragged_dot_general")
MOST_MATMULS_OF_THE_STEP = 300
"""The micro train step (GA 2, remat "full") traces more dots than this: forward, recomputed
forward and backward of 8 blocks and the LM head."""


def _dot_precisions(jaxpr, in_kernel: bool = False) -> Counter:
    """(in a Pallas kernel or not, precision) of every dot in `jaxpr` and in the jaxprs its
    equations hold, at any depth."""
    found = Counter()
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in DOTS:
            found[in_kernel, eqn.params["precision"]] += 1
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, core.ClosedJaxpr):
                    sub = sub.jaxpr
                if isinstance(sub, core.Jaxpr):
                    found += _dot_precisions(sub, in_kernel or name == "pallas_call")
    return found


def _config(precision, dtype="float32"):
    cfg = olmo_core(micro())
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, compute_dtype=dtype),
        scale=ScaleConfig(remat_policy="full", matmul_precision=precision),
    )


def _train_step_precisions(cfg) -> Counter:
    graphdef, params = abstract_params(cfg)
    state = jax.eval_shape(lambda p: ts.init_state(p, cfg), params)
    ga, rows, T = cfg.train.ga_steps, cfg.train.micro_batch_size, cfg.train.seq_len
    tokens = jax.ShapeDtypeStruct((ga, rows, T), jnp.int32)
    draws = jax.ShapeDtypeStruct((ga, rows, len(cfg.model.moe_layers), T), jnp.int32)
    batch = {"inputs": tokens, "labels": tokens, "inputs_segmentation": tokens, "pool_draws": draws}
    terms = model_terms_fn(graphdef, cfg)
    step = lambda s, mb: ts.train_step(s, mb, cfg=cfg, terms_fn=terms)  # noqa: E731
    return _dot_precisions(jax.make_jaxpr(step)(state, batch).jaxpr)


@pytest.mark.parametrize(
    ("precision", "dtype", "resolved"),
    [
        (None, "float32", "highest"),
        (None, "bfloat16", "default"),
        ("default", "float32", "default"),
        ("high", "float32", "high"),
    ],
)
def test_the_train_step_runs_every_matmul_at_the_configured_precision(precision, dtype, resolved):
    cfg = _config(precision, dtype)
    assert matmul_precision(cfg) == resolved
    found = _train_step_precisions(cfg)
    expected = (lax.Precision(resolved),) * 2
    assert {p for _, p in found} == {expected}, found
    assert sum(found.values()) > MOST_MATMULS_OF_THE_STEP


def test_float64_compute_resolves_to_highest():
    assert matmul_precision(_config(None, "float64")) == "highest"


@pytest.mark.parametrize(
    ("precision", "dtype", "in_kernels"),
    [
        ("default", "float32", "default"),
        ("highest", "float32", "highest"),
        ("highest", "bfloat16", "default"),
        ("high", "float32", "highest"),
    ],
)
def test_the_megablox_kernels_take_the_precision_too(precision, dtype, in_kernels):
    """A train step whose objective runs the routed experts by megablox at 128-wide widths: the
    dots inside its Pallas kernels (gmm forward; gmm and tgmm backward) carry the precision
    Mosaic compiles nearest it (`model.precision.kernel_precision`): bfloat16 tiles in one pass
    ("default"), float32 tiles at "highest" for "high"."""
    cfg = _config(precision)
    E, N, k, L, H = 4, 256, 2, 128, 128
    params = {
        "w_up_gate": jax.ShapeDtypeStruct((E, 2 * H, L), jnp.float32),
        "w_down": jax.ShapeDtypeStruct((E, H, L), jnp.float32),
    }
    batch = {
        "z": jax.ShapeDtypeStruct((2, N, L), jnp.float32),
        "indices": jax.ShapeDtypeStruct((2, N, k), jnp.int32),
        "weights": jax.ShapeDtypeStruct((2, N, k), jnp.float32),
        "labels": jax.ShapeDtypeStruct((2, 1, N), jnp.int32),
    }

    def terms(p, mb, div):
        y = routed_experts(
            mb["z"].astype(dtype),
            mb["indices"],
            mb["weights"].astype(dtype),
            p["w_up_gate"].astype(dtype),
            p["w_down"].astype(dtype),
            matmul=megablox_matmul,
        )
        return {"ce": jnp.sum(y.astype(jnp.float32) ** 2) / div, "z_loss": jnp.zeros(())}

    accumulate = lambda p, mb: ts.accumulate(p, mb, cfg=cfg, terms_fn=terms)  # noqa: E731
    found = _dot_precisions(jax.make_jaxpr(accumulate)(params, batch).jaxpr)
    kernel = {p for (in_kernel, p), n in found.items() if in_kernel}
    outside = {p for (in_kernel, p), n in found.items() if not in_kernel}
    assert sum(n for (in_kernel, _), n in found.items() if in_kernel) >= 4, found
    assert kernel == {(lax.Precision(in_kernels),) * 2}, found
    assert outside <= {(lax.Precision(precision),) * 2}, found


@pytest.mark.parametrize("bad", ["fp32", "HIGHEST", "bfloat16"])
def test_an_unknown_precision_is_refused(bad):
    with pytest.raises(ValueError, match=r"ScaleConfig.matmul_precision: must be one of"):
        ScaleConfig(matmul_precision=bad)
    assert bad not in MATMUL_PRECISIONS
