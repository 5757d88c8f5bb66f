"""`ModelConfig.compute_dtype` (model.precision): float64 runs in float64 (how close it comes to
OLMo-core's float64: the fp64 oracle tests); float64 without x64 is a clear error; float32 stays
float32 with x64 enabled; bfloat16 keeps float32 params, bfloat16 activations and float32 losses
and gradients.

The model is the micro config's sizes in two blocks (KDA + dense feed-forward, attention + latent
MoE with EMO pools), KDA chunks of 16 so that T=40 ends in a partial chunk. One jitted function
runs each dtype (one compile each); x64 is switched on only inside `jax.enable_x64(True)`."""

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from goldens.tolerances import Tol
from model import optim
from model.config import ModelConfig, micro, olmo_core
from model.convert import from_olmo_core, to_olmo_core
from model.loss import cross_entropy_sums
from model.objective import model_terms_fn
from model.transformer import Transformer
from tests.compare import assert_close

B, T = 2, 40
X64_RECIPE = 'jax.config.update("jax_enable_x64", True)'


def _config(compute_dtype: str) -> ModelConfig:
    model = micro().model
    return dataclasses.replace(
        model,
        n_layers=2,
        layer_types=("kda", "attention"),
        dense_layers=(0,),
        kda=dataclasses.replace(model.kda, chunk_size=16),
        compute_dtype=compute_dtype,
    )


def _model(compute_dtype: str) -> Transformer:
    return Transformer(
        _config(compute_dtype),
        ignore_segment_ids=True,
        kda_inverse="forward_substitution",
        rngs=nnx.Rngs(0),
    )


def _batch() -> dict[str, np.ndarray]:
    """int32 numpy inputs (never int64: they are built once and used with x64 on and off)."""
    cfg = _config("float32")
    rng = np.random.default_rng(0)
    input_ids = rng.integers(0, cfg.eos_token_id, (B, T), dtype=np.int32)
    input_ids[:, 13], input_ids[0, 29] = cfg.eos_token_id, cfg.eos_token_id
    emo = cfg.moe.emo
    return {
        "input_ids": input_ids,
        "labels": rng.integers(0, cfg.eos_token_id, (B, T), dtype=np.int32),
        "pool_draws": rng.integers(emo.min_pool, emo.max_pool + 1, (1, B, T), dtype=np.int32),
    }


def _objective(graphdef, state, batch):
    """CE + 1e-5 z-loss (per token) + the weighted router losses, and what it is made of."""
    model = nnx.merge(graphdef, state)
    h, aux = model.hidden(batch["input_ids"], train=True, pool_draws=batch["pool_draws"])
    logits = model.lm_head(h)
    ce, z = cross_entropy_sums(logits, batch["labels"])
    n = batch["labels"].size
    losses = {"ce": ce / n, "z_loss": z / n, "lb_loss": aux.lb_loss, "router_z_loss": aux.z_loss}
    total = losses["ce"] + 1e-5 * losses["z_loss"] + jnp.sum(0.01 * aux.lb_loss + 1e-5 * aux.z_loss)
    return total, {"hidden": h, "logits": logits, "losses": losses, "counts": aux.counts}


@functools.partial(jax.jit, static_argnums=0)
def _run(graphdef, state, batch):
    """The objective's parts and its gradient."""
    grad_fn = jax.value_and_grad(functools.partial(_objective, graphdef), has_aux=True)
    (_, out), grads = grad_fn(state, batch)
    return {**out, "grads": grads}


def _dtypes(tree) -> set[str]:
    return {str(x.dtype) for x in jax.tree.leaves(tree)}


def _equations(jaxpr):
    """Every equation of `jaxpr` and of the jaxprs nested in it (scan bodies, custom rules)."""
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for item in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(item, "jaxpr", item)
                if hasattr(inner, "eqns"):
                    yield from _equations(inner)


@pytest.fixture(scope="module")
def fp32_model():
    return _model("float32")


def test_float64_is_float64(fp32_model):
    """Params, activations, losses and gradients of the float32 model's weights in a float64 model
    (through OLMo-core's state dict, as a float64 OLMo-core model gives them) are all float64.
    Shapes only: the fp64 oracle tests run it (tests/test_transformer.py, tests/test_blocks.py)."""
    with jax.enable_x64(True):
        model = from_olmo_core(to_olmo_core(fp32_model), _config("float64"))
        graphdef, state = nnx.split(model)
        run = jax.eval_shape(functools.partial(_run, graphdef), state, _batch())
    assert _dtypes(state) == {"float64"}
    assert _dtypes({k: run[k] for k in ("hidden", "logits", "losses", "grads")}) == {"float64"}


def test_float64_round_trip_keeps_float64(fp32_model):
    """OLMo-core float64 weights (off the float32 grid) come back bit for bit, in float64."""
    rng = np.random.default_rng(1)
    state_dict = {
        key: value.astype(np.float64) * (1 + 1e-12 * rng.standard_normal(value.shape))
        for key, value in to_olmo_core(fp32_model).items()
    }
    with jax.enable_x64(True):
        back = to_olmo_core(from_olmo_core(state_dict, _config("float64")))
    assert back.keys() == state_dict.keys()
    for key, value in state_dict.items():
        assert back[key].dtype == np.float64, key
        np.testing.assert_array_equal(back[key], value, err_msg=key)


@pytest.mark.parametrize(
    "build",
    [
        pytest.param(lambda _: _model("float64"), id="Transformer"),
        pytest.param(lambda m: from_olmo_core(to_olmo_core(m), _config("float64")), id="convert"),
    ],
)
def test_float64_without_x64_says_how_to_enable_it(fp32_model, build):
    with jax.enable_x64(False), pytest.raises(ValueError, match=re.escape(X64_RECIPE)) as error:
        build(fp32_model)
    assert "jax.enable_x64(True)" in str(error.value)


def test_float32_stays_float32_with_x64(fp32_model):
    """With x64 on, the float32 model inits the same params and its forward, backward and
    optimizer state hold no float64 value anywhere (default-dtype zeros or aranges would)."""
    with jax.enable_x64(True):
        model = _model("float32")
        graphdef, state = nnx.split(model)
        assert_close(
            "params", expected=nnx.state(fp32_model), actual=state, tol=Tol(rtol=0.0, atol=0.0)
        )
        objective = functools.partial(_objective, graphdef)
        jaxpr = jax.make_jaxpr(jax.value_and_grad(objective, has_aux=True))(state, _batch())
        opt_state = optim.init(state, olmo_core(micro()))
    floats = collections.Counter(
        str(v.aval.dtype)
        for eqn in _equations(jaxpr.jaxpr)
        for v in eqn.outvars
        if jnp.issubdtype(v.aval.dtype, jnp.floating)
    )
    assert set(floats) == {"float32"}, floats
    assert _dtypes(jaxpr.out_avals) <= {"float32", "int32"}
    assert _dtypes(opt_state) <= {"float32", "int32"}


@pytest.fixture(scope="module")
def bf16_model():
    return _model("bfloat16")


def test_bfloat16_params_stay_float32_and_run(fp32_model, bf16_model):
    """Params are the float32 model's; activations bfloat16; losses and gradients float32 and
    finite."""
    assert_close(
        "params",
        expected=nnx.state(fp32_model),
        actual=nnx.state(bf16_model),
        tol=Tol(rtol=0.0, atol=0.0),
    )
    run = jax.device_get(_run(*nnx.split(bf16_model), _batch()))
    assert run["hidden"].dtype == run["logits"].dtype == jnp.bfloat16
    assert _dtypes(run["losses"]) == _dtypes(run["grads"]) == {"float32"}
    for name in ("losses", "grads"):
        bad = [
            k for k, v in jax.tree_util.tree_leaves_with_path(run[name]) if not np.isfinite(v).all()
        ]
        assert not bad, f"{name}: non-finite {bad}"


def test_bfloat16_matmuls(bf16_model):
    """In the training objective (`model.objective`), every linear layer, expert matmul and the
    LM head multiply bfloat16 by bfloat16; attention, KDA and the router stay float32; no
    matmul mixes dtypes. The losses come back float32 (the expert counts int32)."""
    cfg = dataclasses.replace(olmo_core(micro()), model=_config("bfloat16"))
    graphdef, state = nnx.split(bf16_model)
    batch = _batch()
    micro_batch = {
        "inputs": batch["input_ids"],
        "labels": batch["labels"],
        "inputs_segmentation": np.ones((B, T), np.int32),
        "pool_draws": np.swapaxes(batch["pool_draws"], 0, 1),  # shape: [L, b, T] -> [b, L, T]
    }
    terms = model_terms_fn(graphdef, cfg)
    jaxpr = jax.make_jaxpr(terms)(state, micro_batch, jnp.float32(B * T))
    matmuls = collections.Counter(
        tuple(str(v.aval.dtype) for v in (*eqn.invars[:2], eqn.outvars[0]))
        for eqn in _equations(jaxpr.jaxpr)
        if eqn.primitive.name in ("dot_general", "ragged_dot_general")
    )
    assert set(matmuls) == {("bfloat16",) * 3, ("float32",) * 3}, matmuls
    linears = sum(isinstance(m, nnx.Linear) for _, m in nnx.iter_graph(bf16_model))
    experts = 2 * 2 + 2  # two SharedExperts (dense block 0, shared expert of block 1), routed
    assert matmuls["bfloat16", "bfloat16", "bfloat16"] == linears + experts
    shapes = jax.eval_shape(terms, state, micro_batch, jnp.float32(B * T))
    assert {k: str(v.dtype) for k, v in shapes.items()} == {
        "ce": "float32",
        "z_loss": "float32",
        "lb_loss": "float32",
        "router_z_loss": "float32",
        "expert_counts": "int32",
    }
